"""llama-server's stream of server-sent events, rewritten as deploykit's: its id and model name, usage only
when asked for, llama.cpp's timings and build fingerprint dropped, an event's size bounded. Bytes in, bytes
out: the relay (``relay.py``) owns the connection, this owns the rewriting."""

from __future__ import annotations

import json
from typing import Any

from ...engine.llamacpp.client import UpstreamError

MAX_EVENT_BYTES = 4 << 20  # one upstream SSE event (a token, its logprobs, usage): more is a broken engine
NOT_RELAYED = ("timings", "system_fingerprint")  # llama.cpp's build ("b0-unknown") and timings


class Rewriter:
    """llama-server's SSE bytes, with deploykit's id and model name. The first event is parsed once to learn
    the upstream id, model and fingerprint, as the bytes llama-server wrote them (raw UTF-8: a model named
    after a GGUF path with non-ASCII characters is not the ``json.dumps`` escape of it); later events are
    rewritten by a bytes replace. An event with ``usage``, ``timings`` or ``error`` (keys: inside JSON
    strings their quotes would be escaped) is parsed: usage is counted and passed on only if the client
    asked for it, timings and the fingerprint dropped, an error raised. An event is at most
    ``MAX_EVENT_BYTES``: an engine that never ends one fails the stream instead of growing it."""

    def __init__(self, our_id: str, model: str, wants_usage: bool) -> None:
        self.our_id, self.model, self.wants_usage = our_id, model, wants_usage
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama-server's, of the last event: its drafts counted
        self.ended = False
        self._pending = b""
        self._swaps: list[tuple[bytes, bytes]] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send for ``chunk`` (whole events only; a partial one waits for the next chunk)."""
        events = (self._pending + chunk).split(b"\n\n")
        self._pending = events.pop()
        if len(self._pending) > MAX_EVENT_BYTES:
            self._pending = b""
            raise UpstreamError(502, f"the engine sent an event of more than {MAX_EVENT_BYTES} bytes")
        return b"".join(self._event(e) for e in events if e.strip())

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return b""  # comments, keep-alives: not deploykit's to forward
        data = event[6:]
        if data == b"[DONE]":
            self.ended = True
            return b"data: [DONE]\n\n"
        if data.strip() == b"null":  # llama-server's separator between the prompts of one request: no event
            return b""
        if self._swaps is None or b'"usage"' in data or b'"timings"' in data or b'"error"' in data:
            return self._parsed(data)
        for old, new in self._swaps:
            data = data.replace(old, new)
        return b"data: " + data + b"\n\n"

    def _parsed(self, data: bytes) -> bytes:
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            raise UpstreamError(int(error.get("code", 500)), str(error.get("message", error)))
        if self._swaps is None:
            self._swaps = _swaps(data, event, {"id": self.our_id, "model": self.model})
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        for key in NOT_RELAYED:
            event.pop(key, None)
        usage = event.get("usage") if not event.get("choices") else None
        if usage is not None:
            self.usage = usage
            if not self.wants_usage:
                return b""
        elif not self.wants_usage:
            event.pop("usage", None)
        event.update(id=self.our_id, model=self.model)
        return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _swaps(raw: bytes, event: dict[str, Any], ours: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The byte replacements that turn later events of this stream into deploykit's: each of ``ours``'
    keys given its value, the fingerprint removed. Each upstream pair is looked for in ``raw`` as written,
    escaped (``json.dumps``'s default) or not (llama-server's)."""
    swaps: list[tuple[bytes, bytes]] = []
    for key, value in ours.items():
        if isinstance(event.get(key), str):
            swaps.extend((old, _quoted(key, value)) for old in _forms(key, event[key]) if old in raw)
    fingerprint = event.get("system_fingerprint")
    if isinstance(fingerprint, str):
        for old in _forms("system_fingerprint", fingerprint):
            swaps.extend((pair, b"") for pair in (b"," + old, old + b",") if pair in raw)
    return swaps


def _forms(key: str, value: str) -> list[bytes]:
    """``"key":"value"`` as JSON writers write it: raw UTF-8 first, then with non-ASCII escaped."""
    forms = [f"{json.dumps(key)}:{json.dumps(value, ensure_ascii=False)}".encode(), _quoted(key, value)]
    return forms[:1] if forms[0] == forms[1] else forms


def _quoted(key: str, value: str) -> bytes:
    return f"{json.dumps(key)}:{json.dumps(value)}".encode()
