"""Clients that go away early never pin a generation: against a real `deploykit serve`, with raw sockets.

Every path that pins a generation must release it exactly once, whatever the client does: gone before
the response starts, gone mid-stream, gone while queued for a batch slot, or refused (429, 400) after the
pin was taken. Each test waits for `deploykit_in_flight_requests` to come back and for the engine's slots
to be freed; the last one shows that replaced generations are freed (RSS) after early disconnects and
reloads, and that SIGTERM then stops at once.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chatmodel import build_chat_model
from manifests import replace_like_an_editor
from servers import Server, get
from test_serve import chat_manifest

MODEL = "tiny-chat"


def send(server: Server, path: str, body: dict) -> socket.socket:
    """A raw HTTP request on its own connection, left open for the test to close when it likes."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def completion(prompt: str = "long", *, stream: bool, max_tokens: int = 3000, model: str = MODEL) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def chat(*, stream: bool, max_tokens: int = 3000) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def in_flight(server: Server, model: str = MODEL) -> float:
    return server.metric("deploykit_in_flight_requests", deployment=model)


def settled(server: Server, pins: int = 0, model: str = MODEL) -> Callable[[], bool]:
    """In-flight back to ``pins`` and no engine slot held beyond them."""
    def check() -> bool:
        engine = (server.metric("deploykit_requests_running", model_name=model)
                  + server.metric("deploykit_requests_waiting", model_name=model))
        return in_flight(server, model) == pins and engine == pins
    return check


def leave_early(server: Server, model: str, max_tokens: int) -> None:
    """The three ways a client leaves early, on any engine: right after sending (stream and not), and
    after the first bytes of a stream; then every pin and slot must be given back."""
    send(server, "/v1/completions", completion(stream=True, max_tokens=max_tokens, model=model)).close()
    send(server, "/v1/completions", completion(stream=False, max_tokens=max_tokens, model=model)).close()
    sock = send(server, "/v1/completions", completion(stream=True, max_tokens=max_tokens, model=model))
    read_until(sock, b"HTTP/1.1 200")
    sock.close()
    wait_until(settled(server, model=model), f"{model}: every pin is released and every slot freed", timeout=150)


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before {marker!r}: {seen!r}"
        seen += chunk
    return seen


def status_code(sock: socket.socket) -> int:
    head = read_until(sock, b"\r\n\r\n")
    return int(head.split(b" ", 2)[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("disconnects")
    model = build_chat_model(root / "model", context=4096)
    (root / "manifests").mkdir()
    (root / "manifests" / "chat.yaml").write_text(chat_manifest(
        model, serving="{max_tokens: 3000, max_concurrent: 1, max_queued: 2}"))
    with Server(root / "manifests", root / "state") as s:
        yield s
    assert "Traceback" not in s.stderr and "Exception in ASGI application" not in s.stderr, s.stderr


@pytest.mark.parametrize("body", [completion(stream=True), chat(stream=True), completion(stream=False),
                                  chat(stream=False)], ids=["completion-stream", "chat-stream",
                                                            "completion", "chat"])
def test_gone_right_after_sending(server, body):
    def disconnects() -> float:  # a client gone before the server read its body counts under model_name=""
        return sum(server.metric("deploykit_client_disconnects_total", model_name=m) for m in (MODEL, ""))

    before = disconnects()
    for _ in range(3):
        send(server, "/v1/completions" if "prompt" in body else "/v1/chat/completions", body).close()
    wait_until(settled(server), "every pin is released and every slot freed")
    wait_until(lambda: disconnects() == before + 3, "each disconnect is counted once")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_gone_while_its_answer_is_generated(server, stream):
    before = server.metric("deploykit_generation_tokens_total", model_name=MODEL)  # the module's server counts on
    sock = send(server, "/v1/completions", completion(stream=stream))
    if stream:
        read_until(sock, b"data: ")  # the first bytes of the stream arrived
    wait_until(lambda: server.metric("deploykit_requests_running", model_name=MODEL) == 1, "it decodes")
    assert in_flight(server) == 1
    sock.close()
    wait_until(settled(server), "the pin is released and the slot freed")
    tokens = server.metric("deploykit_generation_tokens_total", model_name=MODEL) - before
    assert tokens < 3000  # it stopped early


def test_gone_while_queued_and_refused_after_pinning(server):
    running = send(server, "/v1/completions", completion(stream=True))
    read_until(running, b"data: ")
    queued = [send(server, "/v1/completions", completion(stream=True)),
              send(server, "/v1/chat/completions", chat(stream=False))]
    wait_until(lambda: server.metric("deploykit_requests_waiting", model_name=MODEL) == 2, "two wait")
    assert in_flight(server) == 3
    refused = send(server, "/v1/completions", completion(stream=True))  # the queue is full: 429
    assert status_code(refused) == 429
    too_long = send(server, "/v1/completions", completion("x" * 3000, stream=True))  # context exceeded: 400
    assert status_code(too_long) == 400
    assert in_flight(server) == 3  # the refused requests released what they pinned
    for sock in queued:
        sock.close()
    wait_until(settled(server, pins=1), "the queued requests left the queue and released their pins")
    running.close()
    refused.close()
    too_long.close()
    wait_until(settled(server), "the running request released its pin")
    answer = send(server, "/v1/completions", completion("next", stream=False, max_tokens=4))
    assert status_code(answer) == 200  # the slot is free: a new request is served at once
    answer.close()


def test_generations_replaced_after_early_disconnects_are_freed(tmp_path):
    """Early disconnects before each of three blue-green reloads: the old generations are freed and the
    server's RSS comes back to one generation's worth; SIGTERM then stops promptly."""
    model = build_chat_model(tmp_path / "model", hidden=512, layers=12, intermediate=2048, context=4096)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    shards = ["1GiB", "64MiB", "48MiB", "32MiB"]
    path.write_text(chat_manifest(model, strategy="blue-green", shard=shards[0], serving="{max_tokens: 3000}"))
    with Server(manifests, tmp_path / "state") as server:
        assert server.process is not None
        first = rss(server.process.pid)
        for generation, shard in enumerate(shards[1:], start=2):
            for i in range(10):
                sock = send(server, "/v1/completions", completion(stream=i % 2 == 0))
                if i % 4 == 0:
                    read_until(sock, b"HTTP/1.1")  # some leave after their response started
                sock.close()
            replace_like_an_editor(path, chat_manifest(model, strategy="blue-green", shard=shard,
                                                       serving="{max_tokens: 3000}"))
            wait_until(lambda: get(f"{server.url}/status")[1][0]["generation"] == generation,
                       f"generation {generation} serves", timeout=120)
        wait_until(settled(server), "no request is left in flight", timeout=30)
        wait_until(lambda: rss(server.process.pid) - first < size / 2,
                   f"RSS back to one generation (model {size >> 20} MiB)", timeout=30)
        started = time.monotonic()
        assert server.stop() == 0
        assert time.monotonic() - started < 15, "SIGTERM waited for requests that were gone"
    assert "still in flight" not in server.stderr, server.stderr
    assert "Traceback" not in server.stderr, server.stderr


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
