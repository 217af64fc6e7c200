"""Bearer API keys and the request body limit, as ASGI middleware in front of every route.

With a key, every route but ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer <key>``; keys are
compared in constant time. The control API (``/control/...``) is separate: it needs the control token
(``control_token``, the one in ``server.json``), never the inference key, and without a control token
it answers 401 to everyone. Bodies larger than the limit are refused with 413 before they are read
whole (by Content-Length, or by counting a chunked body as it arrives).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import DeploykitError
from .errors import error_body

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
CONTROL_PREFIX = "/control/"
DEFAULT_MAX_BODY = 4 * 2**20
DRAIN_FACTOR = 16  # bodies up to this many times the limit are read (and dropped) before the 413


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to expose the API beyond this machine without a key."""
    if not api_key and not is_loopback(host):
        raise DeploykitError(f"refusing to listen on {host} without an API key: anyone who can reach it could "
                             "use the models; pass --api-key KEY (or set DEPLOYKIT_API_KEY), or bind 127.0.0.1")


async def _reply(send: Send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = []) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class Guard:
    """API key check and body size limit for an ASGI app."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
                 control_token: str | None = None) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.control_token = control_token

    @staticmethod
    def _bearer(scope: Scope, key: str) -> bool:
        headers = dict(scope.get("headers", []))
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _authorised(self, scope: Scope) -> bool:
        if scope["path"].startswith(CONTROL_PREFIX):  # never open: the control token or nothing
            return bool(self.control_token) and self._bearer(scope, self.control_token)  # type: ignore[arg-type]
        if not self.api_key or scope["path"] in OPEN_PATHS:
            return True
        return self._bearer(scope, self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorised(scope):
            control = scope["path"].startswith(CONTROL_PREFIX)
            message = ("missing or wrong control token: send 'Authorization: Bearer <token>' with the token "
                       "from <state dir>/server.json" if control else
                       "missing or wrong API key: send 'Authorization: Bearer <key>'")
            await _reply(send, 401, message, "invalid_control_token" if control else "invalid_api_key",
                         [(b"www-authenticate", b"Bearer")])
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            if int(length) <= DRAIN_FACTOR * self.max_body:  # read it away: the client then sees the 413,
                await _drain(receive)                         # not a connection reset mid-upload
            await _reply(send, 413, f"the request body is {int(length)} bytes; the limit is {self.max_body}",
                         "request_too_large")
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (bounded) before the app sees it, then hand it over unchanged."""
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body:
                await _reply(send, 413, f"the request body is larger than the limit of {self.max_body} bytes",
                             "request_too_large")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: the real channel, for disconnects

        await self.app(scope, replay, send)


def guard(app: Any, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
          control_token: str | None = None) -> Guard:
    return Guard(app, api_key=api_key, max_body=max_body, control_token=control_token)
