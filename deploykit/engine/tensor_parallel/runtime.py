"""A tensor-parallel generation as a runtime the OpenAI routes serve: the shared static-batch engine
(``engine.stepped``) in the driver process, stepping the ranks of a ``RankGroup`` in lockstep. The
driver holds no weights: only the tokenizer, and rank 0's logits of each step to sample from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime import Limits, context_length, eos_ids_of
from ..stepped import SteppedRuntime
from .group import RankGroup, free_port
from .rank import RankSpec


@dataclass(frozen=True)
class RankOptions:
    """How to start the ranks of one generation."""

    ranks: int
    dtype: str = "float32"
    gpus: tuple[int, ...] = ()  # one per rank; empty: worker processes on the CPU
    threads: int | None = None  # torch threads per rank; None: the host's cores shared out
    trust_remote_code: bool = False
    timeout: float = 600.0


class TensorParallelRuntime(SteppedRuntime):
    """A causal LM split across rank processes; the OpenAI routes use it as a TextRuntime."""

    name = "tensor-parallel"
    pipeline: RankGroup

    def describe(self) -> str:
        return f"{len(self.pipeline.processes)} tensor-parallel ranks"

    @property
    def ranks(self) -> RankGroup:
        return self.pipeline


def rank_specs(shards: Path, options: RankOptions) -> list[RankSpec]:
    port = free_port()
    threads = options.threads or max(1, (os.cpu_count() or 1) // options.ranks)
    return [RankSpec(rank=r, ranks=options.ranks, port=port, shards=str(shards), dtype=options.dtype,
                     threads=threads, device="cuda" if options.gpus else "cpu",
                     gpu=options.gpus[r] if options.gpus else None, trust_remote_code=options.trust_remote_code,
                     timeout=options.timeout)
            for r in range(options.ranks)]


def build_tensor_parallel_runtime(shards: Path, options: RankOptions, limits: Limits, *,
                                  tokenizer_source: Path | None = None) -> TensorParallelRuntime:
    """Start the ranks on ``shards`` (rank files written by ``artifacts.rank_shards``) and return the
    runtime serving through them; the ranks are stopped if anything after their start fails."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(shards, trust_remote_code=options.trust_remote_code)
    tokenizer: Any
    try:
        tokenizer = AutoTokenizer.from_pretrained(shards)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source) if tokenizer_source else None
    group = RankGroup.start(rank_specs(shards, options), timeout=options.timeout)
    try:
        return TensorParallelRuntime(group, tokenizer, limits, context_length=context_length(config, limits),
                                     eos_ids=eos_ids_of(shards, config))
    except BaseException:
        group.close()
        raise
