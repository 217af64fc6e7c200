"""``LeasedStream``: a streamed answer that owns its request's lease and engine runs.

Starlette runs a stream's body only while the client listens: if the client is gone before the body
starts, the body never runs (so a ``finally`` in it never runs either), and if it goes mid-stream the
body is cancelled where it waits. Releasing the lease inside the body therefore leaked a pinned
generation per early disconnect. Here the response itself ends the runs and releases the lease when it
is done, whether the body ran to its end, stopped halfway or never started.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..errors import client_gone

if TYPE_CHECKING:
    from .common import Lease
    from .generation import Run

log = logging.getLogger(__name__)


class LeasedStream(StreamingResponse):
    """An SSE response over ``body`` that cancels ``runs`` and releases ``lease`` once it is over."""

    def __init__(self, body: AsyncIterator[bytes], *, lease: Lease, runs: Sequence[Run], model: str) -> None:
        self._body = body
        self.lease, self.runs, self.model = lease, list(runs), model
        self.finished = False
        super().__init__(self._tracked(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _tracked(self) -> AsyncIterator[bytes]:
        async for chunk in self._body:
            yield chunk
        self.finished = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client closed the connection while a chunk was being sent
            pass
        finally:
            with anyio.CancelScope(shield=True):  # the body's own cleanup, even while being cancelled
                await _close(self._body)
            for run in self.runs:
                run.cancel()
            self.lease.release()
            if not self.finished:
                client_gone(scope, self.model, streamed=True)


async def _close(body: Any) -> None:
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # pragma: no cover - the body failed while closing: nothing is left to free
            log.debug("closing a stream body failed", exc_info=True)
