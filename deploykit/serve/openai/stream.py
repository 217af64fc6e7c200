"""``LeasedStream``: a streamed answer that owns its request's lease and engine runs.

Starlette runs a stream's body only while the client listens: if the client is gone before the body
starts, the body never runs (so a ``finally`` in it never runs either), and if it goes mid-stream the
body is cancelled where it waits. Releasing the lease inside the body therefore leaked a pinned
generation per early disconnect. Here the response itself ends the runs and releases the lease when it
is done, whether the body ran to its end, stopped halfway or never started.

A client that stops reading (its socket buffers full) would hold the stream, its lease and so its
generation for ever, across reloads: a send that waits ``SEND_TIMEOUT`` seconds (``deploykit serve
--stream-send-timeout``: the app's ``state.stream_send_timeout``) ends the stream as if the client had gone
(``_SendDeadline``: one timer per stream that looks every quarter of the timeout, so the stream ends between
1 and 1.25 times it; a cancel scope and timer around every send, ``anyio.fail_after``, cost 15-50 us a
chunk, more than relaying a llama.cpp event).

A failure once the stream started (a generation that fails, a bug) cannot change the status any more:
the stream then ends with an OpenAI-shaped error event and ``data: [DONE]``, as vLLM's do, rather than
a connection cut without a word (a face with its own wire format, ``/v1/responses`` or ``/v1/messages``,
renders the error its own way: ``failure``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from ..errors import APIError, ClientGone, client_gone, error_body
from .common import sse

if TYPE_CHECKING:
    from .common import Lease
    from .generation import Run

log = logging.getLogger(__name__)
SEND_TIMEOUT = 30.0  # seconds one chunk may wait for a client that does not read


class LeasedStream(StreamingResponse):
    """An SSE response over ``body`` that cancels ``runs`` and releases ``lease`` once it is over."""

    def __init__(self, body: AsyncIterator[bytes], *, lease: Lease, runs: Sequence[Run], model: str,
                 failure: Callable[[dict[str, Any]], list[bytes]] | None = None) -> None:
        self._body = body
        self._failure = failure or _openai_failure
        self.lease, self.runs, self.model = lease, list(runs), model
        self.finished = False
        super().__init__(self._tracked(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _tracked(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._body:
                yield chunk
        except ClientGone:
            return  # nobody reads the rest; counted as a disconnect below
        except Exception as exc:  # the status is sent already: say it in the stream, then end it
            for chunk in self._failure(_failure(exc, self.model)):
                yield chunk
        self.finished = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = getattr(scope["app"].state, "stream_send_timeout", SEND_TIMEOUT) if "app" in scope else SEND_TIMEOUT
        try:
            with anyio.CancelScope() as cancel:
                bounded = _SendDeadline(send, timeout, cancel)
                try:
                    await super().__call__(scope, receive, bounded)
                finally:
                    bounded.close()
            if bounded.expired:  # the client stopped reading: the same as gone
                log.warning("%s: a stream's client read nothing for %g s; the stream is ended", self.model, timeout)
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


class _SendDeadline:
    """``send``, bounded: a send still waiting ``timeout`` seconds after it began cancels ``scope``. One timer
    per stream, re-armed every quarter of the timeout, instead of one per chunk."""

    def __init__(self, send: Send, timeout: float, scope: anyio.CancelScope) -> None:
        self._send, self._timeout, self._scope = send, timeout, scope
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None  # when the send in progress began
        self.expired = False
        self._timer = self._loop.call_later(timeout / 4, self._look)

    async def __call__(self, message: Any) -> None:
        self._since = self._loop.time()
        try:
            await self._send(message)
        finally:
            self._since = None

    def _look(self) -> None:
        since = self._since
        if since is not None and self._loop.time() - since >= self._timeout:
            self.expired = True
            self._scope.cancel()
        else:
            self._timer = self._loop.call_later(self._timeout / 4, self._look)

    def close(self) -> None:
        self._timer.cancel()


def _openai_failure(error: dict[str, Any]) -> list[bytes]:
    return [sse(error), sse("[DONE]")]


def _failure(exc: Exception, model: str) -> dict[str, Any]:
    """The error event of a stream that failed after it started (logged here for the operator)."""
    if isinstance(exc, APIError):
        log.warning("%s: a stream failed after it started: %s", model, exc.message)
        return error_body(exc.status, exc.message, param=exc.param, code=exc.code)
    log.error("%s: a stream failed after it started", model, exc_info=exc)
    return error_body(500, f"internal error ({type(exc).__name__}); the server logged the details",
                      code="internal_error")


async def _close(body: Any) -> None:
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # pragma: no cover - the body failed while closing: nothing is left to free
            log.debug("closing a stream body failed", exc_info=True)
