"""A live adapter change interrupted: the server is stopped (SIGTERM) while a removed adapter still serves a
request that started on it. The removal is current at once (the adapter takes no new request; the running one
finishes with it), the server ends within its drain time, no thread is left, and a restart serves what the
state store says serves (the removal)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

from chatmodel import build_chat_model
from helpers import wait_until
from lora import adapters_manifest, train_adapter
from manifests import replace_like_an_editor
from servers import Server


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        return dict(json.loads(r.read())[0])


def _models(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


def _unread_stream(port: int, model: str) -> socket.socket:
    """A stream of about 6 MB of events whose client reads nothing: its request holds the adapter until the
    server ends it (see test_serve_security's unread stream)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                       "n": 8, "logprobs": True, "top_logprobs": 20, "temperature": 1.0, "stream": True,
                       "logit_bias": {"257": -100}}).encode()  # never "</s>": every choice makes its 2000 tokens
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def test_sigterm_while_a_removed_adapter_still_serves_its_request(tmp_path: Path) -> None:
    base = build_chat_model(tmp_path / "base", context=2100)
    pirate = train_adapter(base, tmp_path / "pirate", text="user: hi\nassistant: arr", steps=2)
    manifests = tmp_path / "m"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    path.write_text(adapters_manifest(base, {"pirate": pirate}, max_tokens=2000))
    state = tmp_path / "state"
    server = Server(manifests, state, "--stream-send-timeout", "600", "--drain-timeout", "3")
    with server:
        before = _status(server.url)
        sock = _unread_stream(server.port, "chat:pirate")
        try:
            wait_until(lambda: server.metric("deploykit_in_flight_requests", deployment="chat") == 1, 60,
                       "the stream holds the adapter")
            replace_like_an_editor(path, adapters_manifest(base, {}, max_tokens=2000))
            wait_until(lambda: "chat:pirate" not in _models(server.url), 60,
                       "the removal began (the adapter takes no new request)")
            assert server.process is not None
            started = time.monotonic()
            code = server.stop()
            took = time.monotonic() - started
        finally:
            sock.close()
    assert code == 0 and took < 30, (code, took, server.stderr[-3000:])
    assert "threads still running" not in server.stderr, server.stderr[-3000:]
    # the stream cut by the end of the drain is one line in the log, not an application error
    assert "Exception in ASGI application" not in server.stderr, server.stderr[-3000:]
    assert "POST /v1/chat/completions: still running when the drain time ran out; ended" in server.stderr

    with Server(manifests, state) as again:  # the removal was recorded when it took effect: the restart serves it
        now = wait_until(lambda: (st := _status(again.url))["revision"] > before["revision"] and st["phase"] == "Ready"
                         and st, 120, "the removal serves after the restart")
        assert _models(again.url) == {"chat"} and now["adapters"] == []
