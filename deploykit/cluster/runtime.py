"""Serving a generation through a pipeline: ``PipelineRuntime`` has the interface the OpenAI routes use
of ``engine.runtime.TextRuntime`` (``kind``, ``tokenizer``, ``limits``, ``context_length``, ``eos_ids``,
``complete``, ``close`` and an ``engine`` with ``submit(request, listener)`` / ``cancel`` / ``stats`` /
``close``), backed by stage actors on a Ray cluster.

The engine batches *statically*: waiting requests (up to ``max_concurrent``) start together as one
left-padded batch and run until all of them finish or are cancelled; requests arriving meanwhile wait
for the next batch. Each batch is one request group on the stages: its KV caches are freed on every
stage when the batch ends, whether it finished, was cancelled or failed. Sampling is per request
(greedy, temperature, top_p, seed), with the same sampler as the in-process engine.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..engine.health import HealthResult, within
from ..errors import ApplyError
from ..engine.admission import Admission, stop_reason
from ..engine.batching import GenerationRequest, GenerationResult, RequestHandle, request_generator, sample_token
from ..engine.runtime import MAX_DEFAULT_CONTEXT, Limits, TextRuntime
from ..engine.serving import ServingSpec
from ..engine.text import RequestError
from ..names import Task
from ..placement.planner import Plan
from .pipeline import RayPipeline, stages_of
from .ray_env import ClusterError, connect

log = logging.getLogger(__name__)


class PipelineEngine:
    """Requests through a pipeline (``step`` / ``release``), one static batch at a time, on one thread."""

    def __init__(self, pipeline: Any, tokenizer: Any, eos_ids: set[int], *, max_batch_size: int = 16,
                 max_queued: int = 64) -> None:
        self.pipeline, self.tokenizer, self.eos_ids = pipeline, tokenizer, set(eos_ids)
        self.max_batch_size, self.max_queued = max_batch_size, max_queued
        self._queue = Admission(max_queued=max_queued)
        self._thread = threading.Thread(target=self._loop, name="deploykit-pipeline-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        h = RequestHandle(request, self._queue.check(request), rng=request_generator(request), listener=listener)
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
                        tok = sample_token(logits[i], h.request, h.rng)
                        h.push(tok)
                        last.append(tok)
                        if reason := stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer):
                            h.finish(reason)
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
        self.engine = PipelineEngine(pipeline, tokenizer, eos_ids,
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


@dataclass(frozen=True)
class PipelineOptions:
    """How the stages are started: CPUs (fractional allowed) and torch threads per stage, how long
    placing and building them may take, and whether they go in the placement group of the Ray Serve
    replica that starts them (one bundle per stage) rather than in a new STRICT_SPREAD group."""

    num_cpus: float = 1.0
    threads: int | None = None  # default: max(1, int(num_cpus))
    timeout: float = 600.0
    in_replica_group: bool = False


def build_pipeline_runtime(plan: Plan, path: Path, serving: ServingSpec, address: str | None,
                           options: PipelineOptions = PipelineOptions()) -> PipelineRuntime:
    """Start the stages of a multi-node ``plan`` (each reads its own tensors from ``path``) on the Ray
    cluster at ``address`` (None: the one this process is connected to) and return the runtime that
    serves requests through them (see docs/scale-out.md for the contract)."""
    if not plan.nodes:
        raise ClusterError(f"{serving.name}: the plan has one node: plan it with placement.nodes > 1")
    if serving.task != Task.CAUSAL_LM:
        raise ClusterError(f"{serving.name}: pipeline stages serve causal-lm models only")
    if address is not None:
        connect(address)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path, trust_remote_code=serving.load.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cpus = max(0.01, options.num_cpus)
    specs = stages_of(plan, path, dtype=serving.load.dtype, threads=options.threads or max(1, int(cpus)))
    num_gpus = 1.0 if any(s.device != "cpu" for s in specs) else 0.0
    pipeline = RayPipeline.start(specs, num_cpus=cpus, num_gpus=num_gpus, timeout=options.timeout,
                                 in_current_group=options.in_replica_group)
    own = getattr(config, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
    context = int(serving.limits.context_length or min(own, MAX_DEFAULT_CONTEXT))
    try:
        return PipelineRuntime(pipeline, tokenizer, serving.limits, context_length=context,
                               eos_ids=_eos_ids(path, config))
    except Exception:
        pipeline.close()
        raise
