"""The HTTP/1 connections of ``deploykit serve``: uvicorn's h11 protocol, bounded before a request starts.

The body limit (``auth.Guard``) only sees a request once its headers are in. Before that a client could
hold a connection and memory for as long as it liked: uvicorn's httptools protocol (the one it picks when
httptools is installed) takes headers of any size, and neither protocol limits how long the headers may
take, so a client dripping one byte at a time kept its connection forever. Here:

- the request line and headers together may be at most ``MAX_HEADER_BYTES`` (431 beyond, then close);
- they must arrive within ``header_timeout`` seconds of the connection opening or of their first byte
  (408, then close); a connection idle between requests is uvicorn's keep-alive timeout's;
- h11 frames every answer as the client's HTTP version allows: an HTTP/1.0 client gets a stream without
  chunked transfer-encoding (ended by closing the connection), which it can read;
- past uvicorn's ``limit_concurrency`` (open connections or requests in progress) a request is answered 503
  with ``Retry-After`` and an OpenAI-shaped body, as every other refusal (uvicorn's own is plain text).

Answers written here are OpenAI-shaped errors, written before any route runs.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

import h11
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

MAX_HEADER_BYTES = 32 * 1024
HEADER_TIMEOUT = 10.0
BUSY_RETRY_AFTER = 1  # seconds: connections come and go fast
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedH11(H11Protocol):
    """``H11Protocol`` with a deadline on each request's headers (``header_timeout``, seconds)."""

    header_timeout = HEADER_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        # uvicorn checks its limit where it picks the app and answers in plain text past it: the check is
        # made here instead, in the app it picks (the same counts; this request's task is counted already)
        self._limit, self.limit_concurrency = self.limit_concurrency, None
        if self._limit is not None:
            self.app = partial(self._within_limit, self.app)

    async def _within_limit(self, app: ASGI3Application, scope: Any, receive: Any, send: Any) -> None:
        assert self._limit is not None
        if len(self.connections) >= self._limit or len(self.tasks) > self._limit:
            self.logger.warning("Exceeded concurrency limit.")
            body = json.dumps(error_body(503, f"the server is at its limit of {self._limit} connections and "
                                              "requests; retry shortly", code="server_busy")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                    (b"retry-after", b"%d" % BUSY_RETRY_AFTER), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._waiting_for_head():
            self._watch_head()
        else:
            self._stop_watching()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request: headers with no end within the limit are too large, else not HTTP."""
        received = self.conn.trailing_data[0]
        if len(received) > MAX_HEADER_BYTES and received.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4) < 0:
            self._refuse(431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes", "headers_too_large")
        else:
            self._refuse(400, "the request is not valid HTTP", "invalid_http")

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_head(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.header_timeout, self._head_overdue)

    def _stop_watching(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self._waiting_for_head():
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout:g} s",
                         "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """An error answer written straight to the socket (no request exists yet), then close."""
        self._stop_watching()
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, message, code=code)).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body)))
        self.transport.write(head + body)
        self.transport.close()


def bounded_h11(header_timeout: float = HEADER_TIMEOUT) -> type[BoundedH11]:
    """The protocol class for uvicorn's ``http`` setting, with this header deadline."""
    return type("BoundedH11", (BoundedH11,), {"header_timeout": header_timeout})
