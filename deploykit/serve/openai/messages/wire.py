"""What Anthropic's clients expect of the wire around ``/v1/messages``, below routing: the API key sent
as ``x-api-key`` (read as ``Authorization: Bearer`` when that header is absent), and every error answer
on these paths, from whichever layer (the key check, body limits, validation, admission's 429s, the
route), in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}`` with the same status.
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not read: the API served is the
one docs/serving.md describes.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, openai_error: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error body as Anthropic's (the field a refusal is about stays named in the message)."""
    error = openai_error.get("error") or {}
    message = str(error.get("message") or "error")
    param = error.get("param")
    if param and not message.startswith(f"{param}:"):
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


class AnthropicWire:
    """The ASGI wrapper, outermost: ``x-api-key`` in, Anthropic-shaped errors out, on ``/v1/messages``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @property
    def stopping(self) -> bool:
        """The wrapped app's (``auth.Guard``: the server sets it on SIGTERM)."""
        return bool(getattr(self.app, "stopping", False))

    @stopping.setter
    def stopping(self, value: bool) -> None:
        setattr(self.app, "stopping", value)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        headers = list(scope.get("headers", []))
        names = {k.lower() for k, _ in headers}
        key = next((v for k, v in headers if k.lower() == b"x-api-key"), None)
        if key is not None and b"authorization" not in names:
            scope = {**scope, "headers": headers + [(b"authorization", b"Bearer " + key)]}
        await self.app(scope, receive, _ErrorsReshaped(send))


class _ErrorsReshaped:
    """``send`` that holds an error answer's start until its (JSON) body is whole, then sends both reshaped."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: Message | None = None
        self._body = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] >= 400:
            self._start = message
            return
        if self._start is None or message["type"] != "http.response.body":
            await self._send(message)
            return
        self._body += message.get("body", b"")
        if message.get("more_body", False):
            return
        start, body = self._start, self._body
        self._start = None
        try:
            body = json.dumps(anthropic_error(start["status"], json.loads(body))).encode()
        except (ValueError, AttributeError):
            pass  # not an OpenAI-shaped error: sent as it is
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await self._send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
