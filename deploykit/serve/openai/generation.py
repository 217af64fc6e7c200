"""One generation request from submission to its last token: text deltas, stop strings, usage, metrics,
and cancellation when the client goes away (the engine frees the slot; a cancelled request gets no
final output from transformers' batching, so nothing here waits for one)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from ...engine.requests import GenerationRequest, GenerationResult
from ...engine.sampling import TokenLogprobs
from ...engine.text import TextStream
from ..errors import APIError, ClientGone
from .common import TokenEvents, submit

if TYPE_CHECKING:
    from ...control.live.pool import Generation
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
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # the tokens of ``text`` (EOS excluded), when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, if one did


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
    """One request on a generation's engine. ``start()`` submits it (429 when the queue is full);
    ``deltas()`` yields text as it becomes final (stop strings held back, then cut); afterwards
    ``outcome`` holds the whole text, finish reason and usage. ``cancel()`` frees its engine slot at
    any time, from any code path, any number of times."""

    def __init__(self, gen: Generation, dep_name: str, request: GenerationRequest, http: Request,
                 metrics: ServingMetrics) -> None:
        self.gen, self.request, self.http, self.metrics = gen, request, http, metrics
        self.runtime: TextRuntime = gen.runtime  # type: ignore[assignment]
        self.labels = metrics.labels(dep_name, gen.number)
        self.outcome: Outcome | None = None
        self.handle: Any = None
        self.events: TokenEvents | None = None
        self.started = 0.0
        self.ttft: float | None = None
        self.logprobs: list[TokenLogprobs] = []  # of the tokens handed out so far

    def start(self) -> None:
        self.events = TokenEvents()
        self.started = time.monotonic()
        self.handle = submit(self.runtime, self.request, self.events)

    def cancel(self) -> None:
        if self.handle is not None:
            self.runtime.engine.cancel(self.handle)  # a no-op once the request has ended

    async def deltas(self) -> AsyncIterator[Delta]:
        if self.handle is None:
            self.start()
        assert self.events is not None
        metrics = self.metrics
        text = TextStream(self.runtime.tokenizer, stop=self.request.stop_strings,
                          skip_ids=sorted(self.runtime.eos_ids))
        watcher = asyncio.create_task(_watch_disconnect(self.http, self.cancel))
        parts: list[str] = []
        pending: list[TokenLogprobs] = []  # logprobs of tokens whose text is held back
        result: GenerationResult | None = None
        try:
            async for event in self.events:
                if isinstance(event, GenerationResult):
                    result = event
                    break
                if not parts and not text.ids:
                    self.ttft = time.monotonic() - self.started
                    metrics.time_to_first_token.labels(*self.labels).observe(self.ttft)
                if self.request.logprobs is not None and not text.stopped and event not in self.runtime.eos_ids:
                    pending.append(self.handle.logprobs[len(text.ids)])  # pushed before the listener heard
                delta = text.push(event)
                if text.stopped:  # a stop string: end the request now, the rest is not wanted
                    self.cancel()
                if delta:
                    parts.append(delta)
                    yield self._delta(delta, pending)
        finally:
            watcher.cancel()
            if result is None:  # the client went away (or this task was cancelled): free the slot
                self.cancel()
        if result is not None:  # what a canary's traffic gates read (a client that left counts for neither)
            self.gen.traffic.record(ttft=self.ttft, failed=result.finish_reason == "error")
            metrics.requests.labels(*self.labels).inc()
        self.outcome = _finish(text, parts, result, metrics, self.labels, self.started)
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


async def whole(run: Run) -> Outcome:
    """Run a started request to its end and return the whole outcome (no streaming)."""
    async for _ in run.deltas():
        pass
    assert run.outcome is not None
    return run.outcome


def _finish(text: TextStream, parts: list[str], result: GenerationResult | None, metrics: ServingMetrics,
            labels: tuple[str, str], started: float) -> Outcome:
    if result is None:
        raise ClientGone(labels[0])  # cancelled before the engine answered
    if result.finish_reason == "error":
        raise APIError(500, f"generation failed: {result.error}", code="generation_failed")
    if result.finish_reason == "cancelled" and not text.stopped:
        raise ClientGone(labels[0])  # the client disconnected: nobody reads the answer
    reason = "stop" if text.stopped or result.finish_reason == "stop" else "length"
    rest = text.finish()
    if rest:
        parts.append(rest)
    completion = len(result.token_ids)
    metrics.prompt_tokens.labels(*labels).inc(result.prompt_tokens)
    metrics.generation_tokens.labels(*labels).inc(completion)
    metrics.request_latency.labels(*labels).observe(time.monotonic() - started)
    return Outcome("".join(parts), reason, result.prompt_tokens, completion, unsent=rest,
                   cached_tokens=result.cached_tokens, stop_sequence=_stop_sequence(text))


def _stop_sequence(text: TextStream) -> str | None:
    """Which stop string ended ``text`` (the one found first), or None."""
    if not text.stop or not text.stopped_by_string:  # no stop strings: no decoding the whole text again
        return None
    whole = str(text.tokenizer.decode([i for i in text.ids if i not in text.skip_ids], skip_special_tokens=True))
    found = [(whole.find(s), s) for s in text.stop if s in whole]
    return min(found)[1] if found else None
