"""Serving a generation through a pipeline: ``PipelineRuntime`` is ``engine.stepped.SteppedRuntime`` (the
static-batch engine shared with tensor-parallel ranks) backed by stage actors on a Ray cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..engine.runtime import MAX_DEFAULT_CONTEXT, Limits
from ..engine.stepped import SteppedEngine, SteppedRuntime, eos_ids_of
from ..placement.planner import Plan
from ..spec.manifest import LoadedManifest
from .pipeline import RayPipeline, stages_of
from .ray_env import ClusterError, connect

log = logging.getLogger(__name__)


class PipelineRuntime(SteppedRuntime):
    """A causal LM served through pipeline stages; the OpenAI routes use it as a TextRuntime."""

    name = "pipeline"

    def describe(self) -> str:
        return f"{len(getattr(self.pipeline, 'specs', []))} stages"


PipelineEngine = SteppedEngine


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
                               eos_ids=eos_ids_of(source, config))
    except Exception:
        pipeline.close()
        raise
