"""Which weights a model's tensor-parallel plan splits, along which dimension, and each rank's slice.

transformers declares the plan (``base_model_tp_plan`` and the head's ``_tp_plan``: column-wise,
row-wise, vocabulary-parallel embeddings) and applies it at load time; deploykit needs the same answer
*before* loading, to size each rank's share in the plan and to write each rank's own slices to disk, so
this module asks the model for its resolved plan (one entry per parameter, layer numbers expanded) on a
meta model and turns each style into the dimension ``DTensor``'s ``Shard`` uses. A style whose layout is
not a plain ``Shard(dim)`` (packed, expert-parallel) is refused rather than guessed.

Slices follow ``torch.chunk`` (what ``DTensor`` ``Shard`` placements use): ``ceil(size / ranks)`` per
rank, the last ones shorter when the size does not divide.
"""

from __future__ import annotations

from typing import Any

from ..errors import CheckpointError

# Styles whose parameters stay whole on every rank (only their forward is hooked).
_WHOLE = {"replicate", "local_params", "all_reduce", "sequence_parallel", "replicated_with_grad_allreduce"}


def shard_dim(style: str, param: str, ndim: int) -> int | None:
    """The dimension ``style`` splits a parameter named ``param`` (its last name part) of ``ndim`` dims
    along, as transformers' ``shard_param`` does; None: the parameter is replicated."""
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return 0 if ndim == 1 else ndim - 2
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        return None if param == "bias" or ndim == 1 else ndim - 1
    if style == "embedding_rowwise":
        return 0
    if style == "embedding_colwise":
        return 1
    if style in _WHOLE:
        return None
    raise CheckpointError(f"tensor-parallel style {style!r} is not supported by deploykit's per-rank shards "
                          f"(supported: colwise, rowwise and embedding styles); set tensor_parallel to 1")


def resolved_plan(model: Any) -> dict[str, str]:
    """The model's tensor-parallel plan, one entry per module and parameter ({} when it has none)."""
    resolve = getattr(model, "_resolve_parallel_plans", None)  # a private method of the mixin
    if resolve is None:  # a transformers without it (5.17, say): nothing is known split, so planning works
        return {}  # for one rank, and tensor_parallel > 1 is refused naming the model (placement.tensor_parallel)
    from transformers.distributed import DistributedConfig

    try:  # the one place deploykit asks transformers to expand a plan
        tp_plan, _, _ = resolve(DistributedConfig(tp_size=2))
    except ValueError:  # "has no tp_plan"
        return {}
    return dict(tp_plan)


def split_parameters(model: Any) -> dict[str, int]:
    """Every parameter name the plan splits, with the dimension it is split along (tied names included)."""
    plan = resolved_plan(model)
    if not plan:
        return {}
    out: dict[str, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        style = plan.get(name)
        if style is None:
            continue
        dim = shard_dim(style, name.rpartition(".")[2], p.dim())
        if dim is not None:
            out[name] = dim
    return out


def chunk_range(size: int, rank: int, ranks: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s slice of a dimension of ``size``, as ``torch.chunk`` cuts it."""
    step = -(-size // ranks)
    return min(size, rank * step), min(size, (rank + 1) * step)


def tied_sources(model: Any, available: set[str]) -> dict[str, str]:
    """For each parameter name missing from ``available`` (a tied head, say), the name of the same tensor
    that is there."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    out: dict[str, str] = {}
    for names in by_id.values():
        present = [n for n in names if n in available]
        for n in names:
            if n not in available and present:
                out[n] = present[0]
    return out


def rank_split(model_dir: Any, *, task: str, trust_remote_code: bool = False,
               available: set[str]) -> tuple[dict[str, int], dict[str, str]]:
    """For the checkpoint at ``model_dir`` (its config.json only): the split parameters with their
    dimension, and the tied names missing from ``available`` with the name that holds their tensor."""
    from .meta import build_meta_model, load_config

    config = load_config(model_dir, trust_remote_code=trust_remote_code)
    model = build_meta_model(config, task=task, trust_remote_code=trust_remote_code)
    return split_parameters(model), tied_sources(model, available)
