"""Serving a generation through something that steps a batch one token at a time (a ``Stepper``: pipeline
stages on a Ray cluster, tensor-parallel rank processes): ``SteppedRuntime`` has the interface the OpenAI
routes use of ``TextRuntime`` (``kind``, ``tokenizer``, ``limits``, ``context_length``, ``eos_ids``,
``complete``, ``close`` and an ``engine`` with ``submit(request, listener)`` / ``cancel`` / ``stats`` /
``close``: a ``TextEngine``).

The engine batches *statically*: waiting requests (up to ``max_concurrent``) start together as one
left-padded batch and run until all of them finish or are cancelled; requests arriving meanwhile wait
for the next batch. Each batch is one request group on the stepper: its KV caches are freed when the
batch ends, whether it finished, was cancelled or failed. Sampling is per request (greedy, temperature,
top_p, seed, penalties, logit_bias, logprobs, grammars), with the in-process engine's sampler (``sampling.py``);
admission is the shared ``Admission``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Callable, Protocol

from ..errors import ApplyError
from .admission import Admission, stop_reason
from .grammar import Grammars
from .requests import GenerationRequest, GenerationResult, RequestHandle
from .sampling import next_token, request_generator
from .health import HealthResult, within
from .runtime import Limits, TextRuntime

log = logging.getLogger(__name__)


class Stepper(Protocol):
    def step(self, group: str, ids: Any, mask: Any, positions: Any) -> Any: ...
    def release(self, group: str) -> None: ...
    def close(self) -> None: ...


class SteppedEngine:
    """Requests through a ``Stepper`` (``step`` / ``release``), one static batch at a time, on one thread."""

    def __init__(self, pipeline: Any, tokenizer: Any, eos_ids: set[int], *, max_batch_size: int = 16,
                 max_queued: int = 64, name: str = "stepped") -> None:
        self.pipeline, self.tokenizer, self.eos_ids = pipeline, tokenizer, set(eos_ids)
        self.max_batch_size, self.max_queued = max_batch_size, max_queued
        self._queue = Admission(max_queued=max_queued)
        self.grammars = Grammars(tokenizer, stop_ids=sorted(self.eos_ids))  # as wide as the tokenizer
        self._thread = threading.Thread(target=self._loop, name=f"deploykit-{name}-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        if request.prompt_logprobs is not None or request.max_new_tokens < 1:
            raise ValueError("echo's prompt logprobs and max_tokens 0 are not served by this engine "
                             "(pipeline stages, tensor-parallel ranks)")
        grammar = self.grammars.matcher(request.grammar) if request.grammar is not None else None
        h = RequestHandle(request, self._queue.check(request), rng=request_generator(request), listener=listener,
                          grammar=grammar)
        idle = self._queue.running == 0  # the next static batch starts at once only when none runs
        self._queue.put(h, free_slots=self.max_batch_size if idle else 0)
        return h

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # its row is skipped; a batch of only finished rows ends at once

    def stats(self) -> dict[str, int]:
        return self._queue.stats()

    def close(self, timeout: float | None = None) -> None:
        self._queue.close()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while self._queue.wait_for_work(0.5):
            batch = self._queue.take(self.max_batch_size)
            if batch:
                self._queue.running = len(batch)
                try:
                    self._run(batch)
                finally:
                    self._queue.running = 0

    def _run(self, rows: list[RequestHandle]) -> None:
        import torch

        group = uuid.uuid4().hex
        prompts = [list(h.request.prompt_ids) for h in rows]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        try:
            with torch.inference_mode():
                while not all(h.done for h in rows):
                    logits = self.pipeline.step(group, ids, mask, positions)
                    last = []
                    for i, h in enumerate(rows):
                        if h.done:
                            last.append(h.tokens[-1] if h.tokens else 0)
                            continue
                        tok, lp = next_token(logits[i].float(), h.request, h.tokens, h.rng, h.grammar)
                        h.push(tok, lp)
                        last.append(tok)
                        if reason := stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer):
                            h.finish(reason)
                    ids = torch.tensor(last)[:, None]
                    mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
                    positions = mask.sum(1, keepdim=True) - 1
        except Exception as exc:  # a stage or rank failure fails this batch, not the engine
            log.warning("batch failed: %r", exc)
            for h in rows:
                h.finish("error", repr(exc))
        finally:
            self.pipeline.release(group)


class SteppedRuntime(TextRuntime):
    """A causal LM served through a ``Stepper`` (pipeline stages, tensor-parallel ranks); the OpenAI routes
    use it as a TextRuntime."""

    kind = "text"
    name = "stepped"

    def __init__(self, pipeline: Any, tokenizer: Any, limits: Limits, *, context_length: int,
                 eos_ids: set[int]) -> None:
        engine = SteppedEngine(pipeline, tokenizer, eos_ids, max_batch_size=limits.max_concurrent,
                               max_queued=limits.max_queued, name=self.name)
        super().__init__(engine, tokenizer, limits, context_length=context_length)
        self.pipeline = pipeline

    def health_check(self, text: str, *, timeout: float) -> HealthResult:
        """``rollout.health_check`` through the stages: one forward of ``text``, next-token logits must be
        finite; ApplyError on a failure or a timeout (as ``engine.health.check`` for in-process models)."""
        import torch

        ids = torch.tensor([self.tokenizer(text)["input_ids"] or [0]])
        mask = torch.ones_like(ids)
        group = f"health-{uuid.uuid4().hex}"

        def forward() -> Any:
            try:
                return self.pipeline.step(group, ids, mask, mask.cumsum(1) - 1)
            finally:
                self.pipeline.release(group)

        logits, elapsed = within(forward, timeout=timeout, name=f"deploykit-{self.name}-health")
        if not bool(torch.isfinite(logits).all()):
            raise ApplyError("health check failed: the model's output is not finite (NaN or inf)")
        return HealthResult(elapsed, f"causal-lm forward through {self.describe()} on {ids.shape[1]} tokens, "
                                     f"output {tuple(logits.shape)} finite")

    def describe(self) -> str:
        return "the model"

    def close(self, timeout: float | None = 30.0) -> None:
        try:
            self.engine.close(timeout)
        finally:
            self.pipeline.close()
