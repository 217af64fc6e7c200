"""One generation request from submission to its last token: text deltas, stop strings, usage, metrics,
and cancellation when the client goes away (the engine frees the slot; a cancelled request gets no
final output from transformers' batching, so nothing here waits for one)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from ...engine.batching import GenerationRequest, GenerationResult, RequestHandle, TokenLogprobs
from ...engine.text import TextStream
from ..errors import APIError
from .common import TokenEvents, submit

if TYPE_CHECKING:
    from ...control.pool import Generation
    from ...engine.runtime import TextRuntime
    from ..metrics import ServingMetrics

DISCONNECT_POLL_SECONDS = 0.5


@dataclass
class Outcome:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    unsent: str = ""  # the end of ``text`` known only once generation ended
    logprobs: list[TokenLogprobs] | None = None  # the tokens of ``text`` (EOS excluded), when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class Delta:
    """Text that became final, and the logprobs of the tokens it comes from (when asked for)."""

    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)


async def _watch_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    cancel()


class Run:
    """One request on a generation's engine. ``deltas()`` yields text as it becomes final (stop strings
    held back, then cut); afterwards ``outcome`` holds the whole text, finish reason and usage."""

    def __init__(self, gen: Generation, dep_name: str, request: GenerationRequest, http: Request,
                 metrics: ServingMetrics) -> None:
        self.gen, self.request, self.http, self.metrics = gen, request, http, metrics
        self.runtime: TextRuntime = gen.runtime  # type: ignore[assignment]
        self.labels = metrics.labels(dep_name, gen.number)
        self.outcome: Outcome | None = None
        self.handle: RequestHandle | None = None
        self.logprobs: list[TokenLogprobs] = []  # of the tokens handed out so far

    async def deltas(self) -> AsyncIterator[Delta]:
        runtime, metrics = self.runtime, self.metrics
        events = TokenEvents()
        started = time.monotonic()
        self.handle = handle = submit(runtime, self.request, events)
        text = TextStream(runtime.tokenizer, stop=self.request.stop_strings, skip_ids=sorted(runtime.eos_ids))
        watcher = asyncio.create_task(_watch_disconnect(self.http, lambda: runtime.engine.cancel(handle)))
        parts: list[str] = []
        pending: list[TokenLogprobs] = []  # logprobs of tokens whose text is held back
        result: GenerationResult | None = None
        try:
            async for event in events:
                if isinstance(event, GenerationResult):
                    result = event
                    break
                if not parts and not text.ids:
                    metrics.time_to_first_token.labels(*self.labels).observe(time.monotonic() - started)
                if self.request.logprobs is not None and not text.stopped and event not in runtime.eos_ids:
                    pending.append(handle.logprobs[len(text.ids)])  # pushed before the listener heard
                delta = text.push(event)
                if text.stopped:  # a stop string: end the request now, the rest is not wanted
                    runtime.engine.cancel(handle)
                if delta:
                    parts.append(delta)
                    yield self._delta(delta, pending)
        finally:
            watcher.cancel()
            with suppress(asyncio.CancelledError):
                await watcher
            if result is None:  # the client went away (or this task was cancelled): free the slot
                runtime.engine.cancel(handle)
        self.outcome = _finish(text, parts, result, metrics, self.labels, started)
        if self.request.logprobs is not None:
            self.outcome.logprobs = self.logprobs  # complete once the last delta below is out
        self.outcome.prompt_logprobs = result.prompt_logprobs if result is not None else None
        if self.outcome.unsent or pending:
            yield self._delta(self.outcome.unsent, pending)

    def _delta(self, text: str, pending: list[TokenLogprobs]) -> Delta:
        delta = Delta(text, list(pending))
        self.logprobs.extend(pending)
        pending.clear()
        return delta


async def generate(gen: Generation, dep_name: str, request: GenerationRequest, http: Request,
                   metrics: ServingMetrics) -> Outcome:
    """Run ``request`` to its end and return the whole outcome (no streaming)."""
    run = Run(gen, dep_name, request, http, metrics)
    async for _ in run.deltas():
        pass
    assert run.outcome is not None
    return run.outcome


def _finish(text: TextStream, parts: list[str], result: GenerationResult | None, metrics: ServingMetrics,
            labels: tuple[str, str], started: float) -> Outcome:
    if result is None:
        raise asyncio.CancelledError  # cancelled before the engine answered
    if result.finish_reason == "error":
        raise APIError(500, f"generation failed: {result.error}", code="generation_failed")
    if result.finish_reason == "cancelled" and not text.stopped:
        raise asyncio.CancelledError  # the client disconnected: nobody reads the answer
    reason = "stop" if text.stopped or result.finish_reason == "stop" else "length"
    rest = text.finish()
    if rest:
        parts.append(rest)
    completion = len(result.token_ids)
    metrics.prompt_tokens.labels(*labels).inc(result.prompt_tokens)
    metrics.generation_tokens.labels(*labels).inc(completion)
    metrics.request_latency.labels(*labels).observe(time.monotonic() - started)
    return Outcome("".join(parts), reason, result.prompt_tokens, completion, unsent=rest)
