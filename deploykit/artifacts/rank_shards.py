"""Per-rank shard files for tensor parallelism: each rank's slices of the split weights plus what it
replicates, one safetensors file per rank, with checksums, so a rank reads only its own file.

transformers' ``from_pretrained(tp_plan="auto")`` maps the whole checkpoint in every rank and slices it
there (measured: 1153-1236 MiB per rank for a 1044 MiB float32 model); writing the slices once, here,
lets a rank's peak memory be its share. The slices follow ``model.tensor_parallel`` (the model's own plan,
``torch.chunk`` cuts). Reading goes through safetensors' lazy ``get_slice``, so only the bytes of one
rank's slices are in memory at a time.

On disk: ``rank-R-of-N.safetensors`` for each rank, the checkpoint's other files (config, tokenizer)
copied beside them, and ``deploykit.lock.json`` (the lock format of ``verify``: size and XXH3-128 per
file), written into a staging directory that is renamed into place last: a crash leaves no half layout.
It must never load a model: only tensors are read and written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..model.checkpoint import LOCK, Checkpoint
from ..model.tensor_parallel import chunk_range, rank_split
from .fsutil import copy_file_synced, fsync_dir, write_atomic
from .verify import LOCK_VERSION, file_hash, read_lock, shard_problem


def rank_file(rank: int, ranks: int) -> str:
    return f"rank-{rank}-of-{ranks}.safetensors"


@dataclass(frozen=True)
class RankLayout:
    """What each rank's file holds: every tensor's source name and split dimension (None: whole)."""

    ranks: int
    dtype: str  # floating tensors are written at this dtype (a manifest's model.dtype: float32, ...)
    tensors: dict[str, tuple[str, int | None]]  # name in the model -> (name in the checkpoint, dim)

    @property
    def digest(self) -> str:
        payload = json.dumps({"tensor_parallel": self.ranks, "dtype": self.dtype,
                              "tensors": sorted((k, *v) for k, v in self.tensors.items())}, default=str)
        return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def rank_layout(checkpoint: Checkpoint, *, ranks: int, dtype: str, task: str = "causal-lm",
                trust_remote_code: bool = False) -> RankLayout:
    """The per-rank layout of ``checkpoint``, from its config.json and tensor names (no data read)."""
    if checkpoint.format != "safetensors":
        raise CheckpointError(f"{checkpoint.path}: tensor-parallel shards are cut from safetensors files; this "
                              "checkpoint holds pickle weights (convert it with deploykit reshard first)")
    names = {t.name for t in checkpoint.tensors}
    split, tied = rank_split(checkpoint.path, task=task, trust_remote_code=trust_remote_code, available=names)
    tensors: dict[str, tuple[str, int | None]] = {n: (n, split.get(n)) for n in sorted(names)}
    tensors.update({n: (src, split.get(n)) for n, src in tied.items()})
    return RankLayout(ranks, dtype, tensors)


def _slice(handle: Any, name: str, dim: int | None, rank: int, ranks: int) -> Any:
    if dim is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    start, stop = chunk_range(view.get_shape()[dim], rank, ranks)
    return view[(slice(None),) * dim + (slice(start, stop),)]


def _rank_tensors(checkpoint: Checkpoint, layout: RankLayout, rank: int) -> dict[str, Any]:
    """This rank's tensors, read slice by slice from the source files."""
    import torch
    from safetensors import safe_open

    where = {t.name: t.file for t in checkpoint.tensors}
    dtype = getattr(torch, layout.dtype)
    out: dict[str, Any] = {}
    handles: dict[Path, Any] = {}
    with ExitStack() as stack:
        for name, (source, dim) in layout.tensors.items():
            file = where[source]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            t = _slice(handles[file], source, dim, rank, layout.ranks)
            t = t.to(dtype) if t.is_floating_point() else t
            # an own copy: slices of one mapped file (a tied head's and its embeddings') may share storage
            out[name] = t.clone(memory_format=torch.contiguous_format)
    return out


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def up_to_date(dst: Path, layout: RankLayout) -> bool:
    lock = read_lock(dst)
    return (lock is not None and lock.get("layout", {}).get("digest") == layout.digest
            and shard_problem(dst, lock) is None)


def write_rank_shards(checkpoint: Checkpoint, dst: Path, layout: RankLayout) -> Path:
    """Write each rank's file (see the module docstring) to ``dst``; nothing is rewritten when ``dst``
    already holds this layout intact."""
    from safetensors.torch import save_file

    if up_to_date(dst, layout):
        return dst
    staging = dst.parent / f".{dst.name}.deploykit-ranks"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    total = 0  # tensor bytes, as verify() sums them from the headers
    for rank in range(layout.ranks):
        tensors = _rank_tensors(checkpoint, layout, rank)
        file = staging / rank_file(rank, layout.ranks)
        save_file(tensors, str(file), metadata={"format": "pt", "rank": str(rank), "ranks": str(layout.ranks)})
        _fsync(file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        shards.append({"file": file.name, "device": f"rank{rank}", "size": file.stat().st_size,
                       "hash": file_hash(file), "tensors": sorted(tensors)})
        del tensors
    files = []
    for rel in checkpoint.other_files:
        copy_file_synced(checkpoint.path / rel, staging / rel)
        files.append({"path": str(rel), "size": (staging / rel).stat().st_size, "hash": file_hash(staging / rel)})
    lock = {"version": LOCK_VERSION,
            "source": {"path": str(checkpoint.path.resolve()), "fingerprint": checkpoint.fingerprint},
            "layout": {"digest": layout.digest, "tensor_parallel": layout.ranks, "dtype": layout.dtype},
            "total_size": total, "shards": shards, "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_atomic(staging / LOCK, json.dumps(lock, indent=2).encode())
    fsync_dir(staging)
    if dst.exists():
        shutil.rmtree(dst)
    os.rename(staging, dst)
    fsync_dir(dst.parent)
    return dst
