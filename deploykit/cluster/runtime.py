"""Serving a generation through a pipeline: ``PipelineRuntime`` is ``engine.stepped.SteppedRuntime`` (the
static-batch engine shared with tensor-parallel ranks) backed by stage actors on a Ray cluster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..engine.runtime import context_length, eos_ids_of
from ..engine.serving import ServingSpec
from ..engine.stepped import SteppedEngine, SteppedRuntime
from ..names import Task
from ..placement.plan import Plan
from .pipeline import RayPipeline, stages_of
from .ray_env import ClusterError, connect

log = logging.getLogger(__name__)


class PipelineRuntime(SteppedRuntime):
    """A causal LM served through pipeline stages; the OpenAI routes use it as a TextRuntime."""

    name = "pipeline"

    def describe(self) -> str:
        return f"{len(getattr(self.pipeline, 'specs', []))} stages"


PipelineEngine = SteppedEngine


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
    try:
        return PipelineRuntime(pipeline, tokenizer, serving.limits, context_length=context_length(config, serving.limits),
                               eos_ids=eos_ids_of(path, config))
    except Exception:
        pipeline.close()
        raise
