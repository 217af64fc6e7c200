"""Serving a generation through a pipeline: ``PipelineRuntime`` has the interface the OpenAI routes use
of ``engine.runtime.TextRuntime`` (``kind``, ``tokenizer``, ``limits``, ``context_length``, ``eos_ids``,
``complete``, ``close`` and an ``engine`` with ``submit(request, listener)`` / ``cancel`` / ``stats`` /
``close``), backed by stage actors on a Ray cluster.

The engine batches *statically*: waiting requests (up to ``max_concurrent``) start together as one
left-padded batch and run until all of them finish or are cancelled; requests arriving meanwhile wait
for the next batch. Each batch is one request group on the stages: its KV caches are freed on every
stage when the batch ends, whether it finished, was cancelled or failed. Sampling is per request
(greedy, temperature, top_p, seed), with the same sampler as the in-process engine (penalties, logit_bias and logprobs included).
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

from ..engine.health import HealthResult, within
from ..errors import ApplyError
from ..engine.batching import GenerationRequest, GenerationResult, QueueFull, RequestHandle
from ..engine.sampling import next_token, request_generator
from ..engine.runtime import MAX_DEFAULT_CONTEXT, Limits, TextRuntime
from ..engine.text import RequestError
from ..placement.planner import Plan
from ..spec.manifest import LoadedManifest
from .pipeline import RayPipeline, stages_of
from .ray_env import ClusterError, connect

log = logging.getLogger(__name__)


class PipelineEngine:
    """Requests through a pipeline (``step`` / ``release``), one static batch at a time, on one thread."""

    def __init__(self, pipeline: Any, tokenizer: Any, eos_ids: set[int], *, max_batch_size: int = 16,
                 max_queued: int = 64) -> None:
        self.pipeline, self.tokenizer, self.eos_ids = pipeline, tokenizer, set(eos_ids)
        self.max_batch_size, self.max_queued = max_batch_size, max_queued
        self._waiting: deque[RequestHandle] = deque()
        self._running = 0
        self._cond, self._closing, self._ids = threading.Condition(), threading.Event(), itertools.count()
        self._thread = threading.Thread(target=self._loop, name="deploykit-pipeline-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        if self._closing.is_set():
            raise RuntimeError("engine is closed")
        if not request.prompt_ids or request.max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        if request.prompt_logprobs is not None:
            raise ValueError("prompt logprobs (echo) are not served through pipeline stages")
        h = RequestHandle(request, f"req-{next(self._ids)}", rng=request_generator(request), listener=listener)
        with self._cond:
            if len(self._waiting) >= self.max_queued:
                self._waiting = deque(w for w in self._waiting if not w.done)
            if len(self._waiting) >= self.max_queued:
                raise QueueFull(f"{self.max_queued} requests already waiting")
            self._waiting.append(h)
            self._cond.notify()
        return h

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # its row is skipped; a batch of only finished rows ends at once

    def stats(self) -> dict[str, int]:
        with self._cond:
            waiting = sum(not h.done for h in self._waiting)
        return {"running": self._running, "waiting": waiting}

    def close(self, timeout: float | None = None) -> None:
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

    def _stop_hit(self, h: RequestHandle, tok: int) -> str | None:
        r = h.request
        tail = self.tokenizer.decode(h.tokens[-(max(map(len, r.stop_strings)) + 8):]) if r.stop_strings else ""
        if tok in self.eos_ids or tok in r.stop_token_ids or any(s in tail for s in r.stop_strings):
            return "stop"
        return "length" if len(h.tokens) >= r.max_new_tokens else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._waiting) or self._closing.is_set(), 0.5)
                if not self._waiting:
                    if self._closing.is_set():
                        return
                    continue
                batch: list[RequestHandle] = []
                while self._waiting and len(batch) < self.max_batch_size:
                    h = self._waiting.popleft()
                    if not h.done:
                        batch.append(h)
                self._running = len(batch)
            if batch:
                try:
                    self._run(batch)
                finally:
                    self._running = 0

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
                        tok, lp = next_token(logits[i].float(), h.request, h.tokens, h.rng)
                        h.push(tok, lp)
                        last.append(tok)
                        if reason := self._stop_hit(h, tok):
                            h.finish(reason)  # type: ignore[arg-type]
                    ids = torch.tensor(last)[:, None]
                    mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
                    positions = mask.sum(1, keepdim=True) - 1
        except Exception as exc:  # a stage failure fails this batch, not the engine
            log.warning("pipeline batch failed: %r", exc)
            for h in rows:
                h.finish("error", repr(exc))
        finally:
            self.pipeline.release(group)


class PipelineRuntime(TextRuntime):
    """A causal LM served through pipeline stages; the OpenAI routes use it as a TextRuntime."""

    kind = "text"

    def __init__(self, pipeline: Any, tokenizer: Any, limits: Limits, *, context_length: int,
                 eos_ids: set[int]) -> None:  # no super().__init__: there is no in-process model
        if tokenizer is None:
            raise RequestError("this model ships no tokenizer: it cannot serve text", code="no_tokenizer")
        self.loaded = None  # type: ignore[assignment]
        self.pipeline = pipeline
        self.tokenizer = tokenizer
        self.limits = limits
        self.context_length = context_length
        self.engine = PipelineEngine(pipeline, tokenizer, eos_ids,  # type: ignore[assignment]
                                     max_batch_size=limits.max_concurrent, max_queued=limits.max_queued)

    @property
    def eos_ids(self) -> set[int]:
        return set(self.engine.eos_ids)

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

        logits, elapsed = within(forward, timeout=timeout, name="deploykit-pipeline-health")
        if not bool(torch.isfinite(logits).all()):
            raise ApplyError("health check failed: the model's output is not finite (NaN or inf)")
        return HealthResult(elapsed, f"causal-lm forward through {len(getattr(self.pipeline, 'specs', []))} "
                                     f"stages on {ids.shape[1]} tokens, output {tuple(logits.shape)} finite")

    def close(self, timeout: float | None = 30.0) -> None:
        try:
            self.engine.close(timeout)
        finally:
            self.pipeline.close()


def _eos_ids(checkpoint: Path, config: Any) -> set[int]:
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def build_pipeline_runtime(loaded_manifest: LoadedManifest, plan: Plan, limits: Limits, *,
                           checkpoint: Path | None = None, num_cpus: float = 1.0, threads: int | None = None,
                           timeout: float = 600.0) -> PipelineRuntime:
    """Start the stages of a multi-node ``plan`` on the manifest's Ray cluster and return the runtime
    that serves requests through them (see docs/scale-out.md for the contract)."""
    spec = loaded_manifest.manifest.spec
    if spec.cluster is None:
        raise ClusterError(f"{loaded_manifest.name}: a pipeline needs spec.cluster")
    if not plan.nodes or len(plan.nodes) != spec.placement.nodes:
        raise ClusterError(f"{loaded_manifest.name}: the plan has {len(plan.nodes) or 1} node(s), the manifest "
                           f"asks for {spec.placement.nodes}: plan it again")
    if spec.model.task != "causal-lm":
        raise ClusterError(f"{loaded_manifest.name}: pipeline stages serve causal-lm models only")
    source = checkpoint or loaded_manifest.model_path
    connect(spec.cluster.address)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(source, trust_remote_code=spec.model.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(loaded_manifest.model_path)
    cpus = max(0.01, num_cpus)
    specs = stages_of(plan, source, dtype=spec.model.dtype, threads=threads or max(1, int(cpus)))
    num_gpus = 1.0 if any(s.device != "cpu" for s in specs) else 0.0
    pipeline = RayPipeline.start(specs, num_cpus=cpus, num_gpus=num_gpus, timeout=timeout)
    own = getattr(config, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
    context = int(limits.context_length or min(own, MAX_DEFAULT_CONTEXT))
    try:
        return PipelineRuntime(pipeline, tokenizer, limits, context_length=context,
                               eos_ids=_eos_ids(source, config))
    except Exception:
        pipeline.close()
        raise
