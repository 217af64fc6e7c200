"""The layout of a resharded checkpoint: which tensors go in which shard file, at which dtype. Pure.

``plan_layout`` cuts a checkpoint's tensors into shards of a bounded size (device-aligned when given a
plan's device_map) and names the result with a digest of every decision; ``fits_layout`` says whether
the checkpoint on disk already has the wanted layout. The ``output_*`` functions say what a source
tensor becomes on disk (dtype, size, name; a quantized weight adds its scales).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..model.checkpoint import Checkpoint, Tensor
from ..names import DTYPE_SIZES, FLOAT_DTYPES, FROM_TORCH
from ..placement.planner import placement_key
from .quantize import Quantize


@dataclass(frozen=True)
class ShardSpec:
    file: str
    tensors: tuple[str, ...]
    nbytes: int  # tensor data, at the output dtype
    device: str | None = None  # the device or tier whose loader reads this file


@dataclass(frozen=True)
class Layout:
    shards: tuple[ShardSpec, ...]
    max_shard_size: int
    dtype: str | None  # output safetensors dtype for floating tensors; None keeps each tensor's own
    device_aligned: bool
    oversized: tuple[str, ...] = ()
    digest: str = ""
    quantize: Quantize | None = None  # linear weights written quantized (artifacts/quantize.py)

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.shards)


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def output_dtype(tensor: Tensor, dtype: str | None) -> str:
    return dtype if dtype is not None and tensor.dtype in FLOAT_DTYPES else tensor.dtype


def output_nbytes(tensor: Tensor, dtype: str | None) -> int:
    out = output_dtype(tensor, dtype)
    return tensor.nbytes // DTYPE_SIZES[tensor.dtype] * DTYPE_SIZES[out]


def output_entries(t: Tensor, dtype: str | None,
                   quantize: Quantize | None) -> list[tuple[str, str, tuple[int, ...], int]]:
    """What source tensor ``t`` is written as: (name, dtype, shape, nbytes) for each output tensor."""
    if quantize is not None and quantize.covers(t):
        return quantize.entries(t)
    return [(t.name, output_dtype(t, dtype), t.shape, output_nbytes(t, dtype))]


def _output_nbytes(t: Tensor, dtype: str | None, quantize: Quantize | None) -> int:
    return sum(e[3] for e in output_entries(t, dtype, quantize))


def output_names(names: Iterable[str], by_name: dict[str, Tensor], quantize: Quantize | None) -> list[str]:
    """The tensors a shard holds, for source tensors ``names`` (a quantized weight adds its scales)."""
    return [e[0] for n in names for e in output_entries(by_name[n], None, quantize)]


def _module_of(name: str, modules: dict[str, int]) -> int | None:
    """Index (in execution order) of the device_map module that owns tensor ``name``."""
    key = placement_key(name, modules)
    return None if key is None else modules[key]


def plan_layout(checkpoint: Checkpoint, *, max_shard_size: int, dtype: str | None = None,
                device_map: dict[str, Any] | None = None, quantize: Quantize | None = None) -> Layout:
    """Cut the checkpoint's tensors into shards of at most ``max_shard_size`` bytes, converting floating
    tensors to ``dtype`` ("float32" | "float16" | "bfloat16") if given.

    Without a device_map, tensors go in natural name order. With one (a Plan's), they follow its
    module order (execution order) and a shard never mixes tensors of two devices or tiers, so each
    device's loader reads only its own files. A tensor larger than ``max_shard_size`` gets a shard of
    its own and is listed in ``oversized``. ``quantize`` sizes (and later writes) the weights it covers
    quantized.
    """
    if max_shard_size <= 0:
        raise ValueError("max_shard_size must be positive")
    dtype = FROM_TORCH[dtype] if dtype else None  # from here on, the safetensors name
    tensors, device_of = _ordered(checkpoint, device_map)
    groups: list[tuple[str | None, list[Tensor], int]] = []
    oversized = []
    for t in tensors:
        size = _output_nbytes(t, dtype, quantize)
        device = device_of.get(t.name)
        if size > max_shard_size:
            oversized.append(t.name)
        if (not groups or groups[-1][0] != device
                or (groups[-1][1] and groups[-1][2] + size > max_shard_size)):
            groups.append((device, [], 0))
        dev, members, total = groups[-1]
        members.append(t)
        groups[-1] = (dev, members, total + size)
    n = len(groups)
    shards = tuple(ShardSpec(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(t.name for t in members),
                             total, device) for i, (device, members, total) in enumerate(groups))
    return Layout(shards, max_shard_size, dtype, bool(device_map), tuple(oversized),
                  _digest(shards, dtype, max_shard_size, quantize), quantize)


def _ordered(checkpoint: Checkpoint,
             device_map: dict[str, Any] | None) -> tuple[list[Tensor], dict[str, str | None]]:
    """The checkpoint's tensors in shard order, and the device or tier each belongs to (with a device_map)."""
    tensors = list(checkpoint.tensors)
    device_of: dict[str, str | None] = {}
    if not device_map:
        tensors.sort(key=lambda t: _natural_key(t.name))
        return tensors, device_of
    modules = {m: i for i, m in enumerate(device_map)}
    devices = list(device_map.values())
    owner = {t.name: _module_of(t.name, modules) for t in tensors}
    order = {t.name: i for i, t in enumerate(tensors)}
    big = len(modules)
    tensors.sort(key=lambda t: (big if owner[t.name] is None else owner[t.name], order[t.name]))
    for t in tensors:
        index = owner[t.name]
        device_of[t.name] = None if index is None else str(devices[index])
    return tensors, device_of


def _digest(shards: tuple[ShardSpec, ...], dtype: str | None, max_shard_size: int,
            quantize: Quantize | None) -> str:
    """Names every decision of a layout: two layouts with the same digest write the same bytes."""
    decided: dict[str, Any] = {"shards": [asdict(s) for s in shards], "dtype": dtype,
                               "max_shard_size": max_shard_size}
    if quantize is not None:  # unquantized layouts keep their digest
        decided["quantize"] = quantize.digest_part()
    payload = json.dumps(decided, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def fits_layout(checkpoint: Checkpoint, *, max_shard_size: int, dtype: str | None,
                device_map: dict[str, Any] | None, quantize: Quantize | None = None) -> bool:
    """Whether the checkpoint on disk already has the wanted layout, so no resharding is needed:
    safetensors files within the size limit (or holding one tensor), at the wanted dtype, each read by
    one device only, nothing to quantize."""
    if checkpoint.format != "safetensors" or (quantize is not None and any(map(quantize.covers,
                                                                               checkpoint.tensors))):
        return False
    target = FROM_TORCH[dtype] if dtype else None
    if target and any(t.dtype in FLOAT_DTYPES and t.dtype != target for t in checkpoint.tensors):
        return False
    modules = {m: i for i, m in enumerate(device_map or {})}
    devices = list((device_map or {}).values())
    for file in checkpoint.weight_files:
        tensors = [t for t in checkpoint.tensors if t.file == file]
        if len(tensors) > 1 and sum(t.nbytes for t in tensors) > max_shard_size:
            return False
        if device_map:
            owners = {_module_of(t.name, modules) for t in tensors}
            if len({None if o is None else str(devices[o]) for o in owners}) > 1:
                return False
    return True
