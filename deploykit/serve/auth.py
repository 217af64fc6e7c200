"""Bearer API keys, the Host check and the request body limits, as ASGI middleware in front of every route.

With a key, every route but ``/healthz`` and ``/readyz`` needs ``Authorization: Bearer <key>``; keys are
compared in constant time. The control API (``/control/...``) is separate: it needs the control token
(``control_token``, the one in ``server.json``), never the inference key, and without a control token
it answers 401 to everyone. With a key, ``/status`` (paths, process ids, plans, commits) is the
operator's: it needs the control token too. Bodies larger than the limit are refused with 413 before
they are read whole (by Content-Length, or by counting a chunked body as it arrives), and a body must
arrive within ``body_timeout`` seconds (408); a refused body is read away (to give the client its 413) only
within that time and up to ``DRAIN_FACTOR`` times the limit, else the connection is closed.

``allowed_hosts`` (set by ``deploykit serve`` when it listens on loopback without a key): a request whose
``Host`` header names anything else is refused with 421 before any route runs. A web page the browser
fetched from a name that the page's owner then points at 127.0.0.1 (DNS rebinding) sends its own name as
``Host``; without the check it could reach an open loopback ``/v1``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import DeploykitError
from .errors import client_gone, error_body

UNKNOWN_MODEL = ""  # deploykit_client_disconnects_total{model_name}: a client gone before its body said

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
OPERATOR_PATHS = frozenset({"/status", "/sources"})  # with an API key: the control token's, not the key's
CONTROL_PREFIX = "/control/"
WEBHOOK_PREFIX = "/hooks/"  # a git host's push notification: its route checks the source's webhook secret
DEFAULT_MAX_BODY = 4 * 2**20
BODY_TIMEOUT = 30.0
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
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


async def _drain(receive: Receive, *, limit: int, timeout: float) -> bool:
    """Read a refused body away, at most ``limit`` bytes within ``timeout`` seconds: True when it ended in
    time, False when the client was slower or sent more (its connection is then closed, not read on: a
    declared body that never arrives would otherwise hold the connection, and 1024 of them every route)."""
    loop = asyncio.get_running_loop()
    deadline, seen = loop.time() + timeout, 0
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request" or not message.get("more_body", False):
            return True
        seen += len(message.get("body", b""))
        if seen > limit:
            return False


def _declared_length(scope: Scope) -> int | None:
    """The body length the request declares (``Content-Length``), at most 10**18 (never ``int()`` of a long
    run of digits); None without one."""
    length = dict(scope.get("headers", [])).get(b"content-length")
    if length is None or not length.isdigit():
        return None
    return int(length) if len(length) <= 18 else 10**18


def _host_name(scope: Scope) -> str | None:
    """The name in the request's ``Host`` header, without its port ("[::1]:8765" -> "::1"); None without
    one (HTTP/1.0 allows that; a browser always sends it)."""
    host = dict(scope.get("headers", [])).get(b"host")
    if host is None:
        return None
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Guard:
    """API key check, Host check and body limits for an ASGI app."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
                 control_token: str | None = None, allowed_hosts: frozenset[str] | None = None,
                 body_timeout: float = BODY_TIMEOUT) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.control_token = control_token
        self.allowed_hosts, self.body_timeout = allowed_hosts, body_timeout
        self.stopping = False  # set by the server on SIGTERM/SIGINT

    @staticmethod
    def _bearer(scope: Scope, key: str) -> bool:
        headers = dict(scope.get("headers", []))
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _control(self, scope: Scope) -> bool:
        return bool(self.control_token) and self._bearer(scope, self.control_token)  # type: ignore[arg-type]

    def _authorised(self, scope: Scope) -> bool:
        if scope["path"].startswith(CONTROL_PREFIX):  # never open: the control token or nothing
            return self._control(scope)
        if not self.api_key or scope["path"] in OPEN_PATHS or scope["path"].startswith(WEBHOOK_PREFIX):
            return True
        if scope["path"] in OPERATOR_PATHS:
            return self._control(scope)
        return self._bearer(scope, self.api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed_hosts is not None and _host_name(scope) not in self.allowed_hosts | {None}:
            await _reply(send, 421, "this server answers only requests addressed to "
                         f"{', '.join(sorted(self.allowed_hosts))} (Host header); it listens on loopback "
                         "without an API key", "invalid_host")
            return
        scope.setdefault("state", {})["control"] = self._control(scope)  # /readyz says more to the operator
        if not self._authorised(scope):
            control = scope["path"].startswith(CONTROL_PREFIX)
            control = control or scope["path"] in OPERATOR_PATHS
            message = ("missing or wrong control token: send 'Authorization: Bearer <token>' with the token "
                       "from <state dir>/server.json" if control else
                       "missing or wrong API key: send 'Authorization: Bearer <key>'")
            await _reply(send, 401, message, "invalid_control_token" if control else "invalid_api_key",
                         [(b"www-authenticate", b"Bearer")])
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body:
            limit = DRAIN_FACTOR * self.max_body
            # read it away (bounded, within the body timeout): the client then sees the 413, not a
            # connection reset mid-upload; one too slow or too large gets the 413 and a closed connection
            drained = declared <= limit and await _drain(receive, limit=limit, timeout=self.body_timeout)
            await _reply(send, 413, f"the request body is {declared} bytes; the limit is {self.max_body}",
                         "request_too_large", [] if drained else [(b"connection", b"close")])
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (bounded) before the app sees it, then hand it over unchanged."""
        chunks: list[bytes] = []
        seen = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            try:  # one deadline for the whole body: a client dripping bytes cannot hold the request
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await _reply(send, 408, f"the request body did not arrive within {self.body_timeout:g} s",
                             "request_timeout", [(b"connection", b"close")])
                return
            if message["type"] != "http.request":  # the client went away before its body was read
                client_gone(scope, UNKNOWN_MODEL, streamed=False)  # counted, its model not known yet
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

        try:
            await self.app(scope, replay, send)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            # uvicorn cancels what still runs once the drain time is over: one line, not a traceback
            log.warning("%s %s: still running when the drain time ran out; ended", scope.get("method"),
                        scope["path"])


def guard(app: Any, *, api_key: str | None, max_body: int = DEFAULT_MAX_BODY,
          control_token: str | None = None) -> Guard:
    return Guard(app, api_key=api_key, max_body=max_body, control_token=control_token)


def loopback_hosts(host: str, api_key: str | None) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``host`` answers: loopback names when it listens on loopback
    without a key (DNS rebinding), else any (None)."""
    return LOOPBACK_NAMES | {host.lower()} if is_loopback(host) and not api_key else None
