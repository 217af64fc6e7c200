"""``x-deploykit-revision`` and ``x-deploykit-generation``: every ``/v1`` answer names what served it; and
when each request arrived (``arrival``: time to first token counts from there).

An endpoint marks its request's scope with the generation it pinned (``mark``); this ASGI wrapper adds
the two headers to the response start, so a streamed answer carries them too (its status and headers
go out before its first token). During a canary they say which generation a request ran on.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from ..control.live.pool import Generation

SCOPE_KEY = "deploykit.served_by"
ARRIVED_KEY = "deploykit.arrived"


def arrival(request: Request) -> float:
    """``time.monotonic()`` when the request reached the API (now, for an app without this wrapper)."""
    return float(request.scope.get(ARRIVED_KEY) or time.monotonic())


def mark(request: Request, gen: Generation) -> None:
    """Record on the request which revision and generation serve it."""
    request.scope[SCOPE_KEY] = (gen.revision, gen.number)


class ServedBy:
    """Adds the headers to every response whose request was marked."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVED_KEY] = time.monotonic()

        async def send_marked(message: Message) -> None:
            served = scope.get(SCOPE_KEY)
            if message["type"] == "http.response.start" and served is not None:
                revision, generation = served
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-deploykit-revision", str(revision).encode()),
                                                  (b"x-deploykit-generation", str(generation).encode())]}
            await send(message)

        await self.app(scope, receive, send_marked)
