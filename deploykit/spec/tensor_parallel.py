"""What ``spec.placement.tensor_parallel`` may ask for, checked before anything is planned or loaded.

Tensor parallelism splits every attention layer by heads across the ranks, so the rank count must divide
the attention heads and the key-value heads (deploykit does not replicate KV heads); it is read from
config.json with ``json`` alone, as ``validate`` must stay fast. The combinations deploykit does not run
yet (several nodes, Ray replicas, a disk tier, models other than causal LMs) are refused here, never
ignored. No torch, no transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from ..errors import Issue
from ..files import MAX_CONFIG_BYTES, read_regular_file


class _Located(Protocol):
    """What ``heads_issues`` reads of a ``manifest.LoadedManifest`` (named here, not imported: the manifest
    module imports this one)."""

    @property
    def manifest(self) -> Any: ...

    @property
    def model_path(self) -> Path: ...

    def issue(self, field: str, message: str, hint: str | None = None) -> Issue: ...

FIELD = "spec.placement.tensor_parallel"


def placement_problem(ranks: int, *, gpus: Any, nodes: Any) -> str | None:
    """Why ``ranks`` does not fit the rest of ``placement`` (None: it does)."""
    if ranks == 1:
        return None
    if isinstance(nodes, int) and nodes > 1:
        return (f"tensor_parallel {ranks} with nodes {nodes} is not supported yet: tensor-parallel ranks run "
                "on one host; set nodes to 1 or tensor_parallel to 1")
    if isinstance(gpus, list) and gpus and len(gpus) != ranks:
        return (f"tensor_parallel {ranks} needs one GPU per rank, but gpus lists {len(gpus)}; list {ranks} GPUs, "
                "or use gpus: [] for worker processes on the CPU")
    return None


def spec_problem(ranks: int, *, cluster: bool, offload: bool, task: str | None,
                 batching: str = "padded") -> str | None:
    """Why the rest of the spec cannot run ``ranks`` tensor-parallel ranks (None: it can)."""
    if ranks == 1:
        return None
    if cluster:
        return ("tensor_parallel with spec.cluster (Ray replicas or pipeline stages) is not supported yet; "
                "remove spec.cluster or set tensor_parallel to 1")
    if offload:
        return ("tensor_parallel with spec.offload.disk is not supported: every rank holds its whole share in "
                "memory; remove spec.offload.disk or set tensor_parallel to 1")
    if task is not None and task != "causal-lm":
        return f"tensor_parallel serves causal-lm models only, not {task}; set tensor_parallel to 1"
    if batching != "padded":
        return (f"tensor_parallel runs deploykit's padded batch loop across the ranks, not {batching} batching; "
                "set spec.serving.batching to padded or tensor_parallel to 1")
    return None


def heads_of(config: dict[str, Any]) -> tuple[int | None, int | None]:
    """(attention heads, key-value heads) of a config.json, the text model's for a multimodal one."""
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    heads = next((text[k] for k in ("num_attention_heads", "n_head", "num_heads") if isinstance(text.get(k), int)),
                 None)
    kv = text.get("num_key_value_heads")
    return heads, kv if isinstance(kv, int) else heads


def heads_issues(loaded: _Located) -> list[Issue]:
    """A located issue when the rank count does not divide the model's heads (read from config.json)."""
    ranks = loaded.manifest.spec.placement.tensor_parallel
    if ranks == 1:
        return []
    config_file = loaded.model_path / "config.json"
    if not config_file.is_file():
        return [loaded.issue(FIELD, f"tensor_parallel {ranks} needs a checkpoint directory with config.json "
                                    f"(to read the heads); {str(loaded.model_path)!r} has none",
                             hint="import a GGUF file to a directory first, or set tensor_parallel to 1")]
    try:
        config = json.loads(read_regular_file(config_file, MAX_CONFIG_BYTES).decode("utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        return [loaded.issue("spec.model.path", f"{config_file}: not readable JSON: {exc}")]
    heads, kv = heads_of(config)
    if heads is None:
        return [loaded.issue(FIELD, f"{config_file} names no attention heads: tensor_parallel cannot split it")]
    bad = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv, "key-value heads"))
           if n is not None and n % ranks]
    if bad:
        return [loaded.issue(FIELD, f"tensor_parallel {ranks} must divide the model's heads, but it has "
                                    f"{' and '.join(bad)} ({config_file})",
                             hint=f"use a divisor of {_gcd(heads, kv or heads)}, or 1")]
    return []


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
