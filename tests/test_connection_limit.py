"""Past its connection limit, deploykit's HTTP protocol answers as every other refusal does: 503, an
OpenAI-shaped body with a code, and Retry-After (uvicorn's own answer is the plain text "Service
Unavailable"). A real uvicorn server with deploykit's protocol (``connections.bounded_h11``) on a free port,
a limit of 2, and an app that holds the first request until the test lets it go."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import uvicorn

from deploykit.serve.connections import bounded_h11


def test_past_the_limit_a_request_gets_an_openai_shaped_503_and_the_others_are_served() -> None:
    release, entered = threading.Event(), threading.Event()

    async def app(scope, receive, send):
        if scope["path"] == "/hold":
            entered.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, http=bounded_h11(), limit_concurrency=2, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="test-uvicorn")
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        with httpx.Client(base_url=url, timeout=30) as first:
            assert first.get("/").text == "ok"  # under the limit: served
        with httpx.Client(base_url=url, timeout=30) as held, httpx.Client(base_url=url, timeout=30) as other:
            results: list[httpx.Response] = []
            holding = threading.Thread(target=lambda: results.append(held.get("/hold")), name="test-hold")
            holding.start()
            assert entered.wait(30)
            refused = other.get("/")  # its connection is the second open one: at the limit
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "server_busy" and "limit of 2" in error["message"]
            release.set()
            holding.join(30)
            assert [r.text for r in results] == ["ok"]  # the held request was answered, not cut
        with httpx.Client(base_url=url, timeout=30) as again:
            assert again.get("/").text == "ok"  # below the limit again
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()
