"""Streaming checkpoint resharding: bounded memory, near-``cp`` speed, atomic, resumable, verified.

Why not a library: ``save_pretrained(max_shard_size=...)`` and accelerate's ``save_model`` need the
whole model in memory (2.4 GiB of RAM for a 2.2 GB checkpoint, 5x the time of ``cp``), and safetensors
has no streaming writer. deploykit copies tensor bytes from file to file in the kernel
(``copy_file_range``) and decodes only when a dtype change is asked for, one chunk at a time, so
memory stays flat whatever the checkpoint size.

On disk (docs/resharding.md has the details):

1. The output is built in a staging directory beside DST (``.DST.deploykit-<key>``), where ``key``
   names the inputs (source fingerprint + layout). Each shard is written as ``*.partial``, fsynced and
   renamed; a journal records each finished shard with its hash.
2. Index, non-weight files and the lock file (``deploykit.lock.json``) are written and fsynced last.
3. The staging directory replaces DST in one atomic step (``renameat2(RENAME_EXCHANGE)``; where the
   file system lacks it, two renames with recovery at the next start), then the old tree is removed.

A ``kill -9`` at any moment leaves DST as it was or complete; the next run finds the journal and
resumes. Running again with unchanged inputs reads only headers and rewrites nothing.

This module owns the job (``reshard``): checks, resume, the shards written in order while the previous
one is finished, the commit. What goes in which shard is ``layout``; writing one shard's bytes is
``shardwrite`` (``convert`` for a dtype change); the staging directory, journal and swap are ``staging``.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError
from ..model.checkpoint import Checkpoint, open_checkpoint
from ..names import DType
from ..units import format_size
from .layout import Layout, ShardSpec, plan_layout
from .quantize import Quantize
from .shardwrite import Sources, finalize_shard, write_shard
from .staging import (check_replaceable, commit, failpoint, finish_staging, load_journal,
                      recover_interrupted_swap, remove_stale_staging, staging_dir, write_journal)
from .verify import read_lock, shard_problem

log = logging.getLogger(__name__)
DTYPES = tuple(d.value for d in DType)  # what --dtype and a manifest's model.dtype may ask for


class ProgressSink(Protocol):
    def start(self, total: int, done: int) -> None: ...
    def advance(self, n: int) -> None: ...


@dataclass
class ReshardResult:
    status: str  # "written" | "unchanged"
    dst: Path
    layout: Layout
    bytes_written: int = 0
    seconds: float = 0.0
    resumed_shards: int = 0
    warnings: list[str] = field(default_factory=list)


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if s == d:
        raise CheckpointError(f"DST {dst} is the source directory; choose another destination")
    if s in d.parents:
        raise CheckpointError(f"DST {dst} is inside SRC {src}; choose a destination outside it")
    if d in s.parents:
        raise CheckpointError(f"SRC {src} is inside DST {dst}; replacing DST would delete the source")


def _up_to_date(dst: Path, checkpoint: Checkpoint, layout: Layout) -> bool:
    lock = read_lock(dst)
    if not lock or lock["source"]["fingerprint"] != checkpoint.fingerprint:
        return False
    if lock["layout"]["digest"] != layout.digest:
        return False
    return shard_problem(dst, lock) is None


def _check_space(staging: Path, needed: int) -> None:
    free = shutil.disk_usage(staging).free
    if needed > free:
        raise CheckpointError(f"not enough disk space for the resharded checkpoint: it needs "
                              f"{format_size(needed)} more, {format_size(free)} free at {staging.parent}")


def reshard(src: str | Path | Checkpoint, dst: str | Path, *, max_shard_size: int, dtype: str | None = None,
            device_map: dict[str, Any] | None = None, allow_pickle: bool = False,
            progress: ProgressSink | None = None, quantize: Quantize | None = None) -> ReshardResult:
    """Reshard the checkpoint at ``src`` into ``dst``. See the module docstring for guarantees.

    ``src`` is a path, or a Checkpoint already opened (and fingerprinted) by the caller.
    ``dtype`` is "float32" | "float16" | "bfloat16" to convert floating tensors, or None to keep
    them. ``device_map`` (a Plan's) makes the layout device-aligned. ``quantize`` writes the linear
    weights it covers quantized, a few rows at a time (artifacts/quantize.py).
    """
    started = time.perf_counter()
    dst = Path(dst)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    _check_paths(src.path if isinstance(src, Checkpoint) else Path(src), dst)
    recover_interrupted_swap(dst)
    checkpoint = src if isinstance(src, Checkpoint) else open_checkpoint(src, allow_pickle=allow_pickle)
    layout = plan_layout(checkpoint, max_shard_size=max_shard_size, dtype=dtype, device_map=device_map,
                         quantize=quantize)
    warnings = [f"tensor {name!r} is larger than max_shard_size ({format_size(max_shard_size)}): it gets "
                "a shard of its own" for name in layout.oversized]
    for w in warnings:
        log.info(w)  # returned to the caller too; the CLI prints it
    if _up_to_date(dst, checkpoint, layout):
        remove_stale_staging(dst)
        return ReshardResult("unchanged", dst, layout, seconds=time.perf_counter() - started,
                             warnings=warnings)
    check_replaceable(dst)
    key = hashlib.sha256(f"{checkpoint.fingerprint}\0{layout.digest}".encode()).hexdigest()[:16]
    staging = staging_dir(dst, key)
    try:
        written, resumed = _write_all(checkpoint, layout, staging, key, progress)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"no space left on the device while writing {dst}: {exc.strerror}; "
                                  f"the destination was left as it was") from None
        raise CheckpointError(f"writing {dst} failed: {exc}; the destination was left as it was "
                              "and the next run resumes") from None
    commit(staging, dst)
    return ReshardResult("written", dst, layout, written, time.perf_counter() - started, resumed, warnings)


def _write_all(checkpoint: Checkpoint, layout: Layout, staging: Path, key: str,
               progress: ProgressSink | None) -> tuple[int, int]:
    """Write the shards the journal lacks, then the rest of the tree. Returns (bytes written, shards resumed)."""
    done = load_journal(staging, key, layout)
    todo = [s for s in layout.shards if s.file not in done]
    others = sum((checkpoint.path / rel).stat().st_size for rel in checkpoint.other_files)
    try:
        _check_space(staging, sum(s.nbytes for s in todo) + others + 2**20)
    except CheckpointError:
        if not done:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if progress is not None:
        progress.start(layout.total_size, layout.total_size - sum(s.nbytes for s in todo))
    advance = progress.advance if progress is not None else (lambda n: None)
    _write_shards(checkpoint, layout, staging, key, todo, done, advance)
    finish_staging(checkpoint, layout, staging, done)
    return sum(s.nbytes for s in todo), len(layout.shards) - len(todo)


def _write_shards(checkpoint: Checkpoint, layout: Layout, staging: Path, key: str, todo: list[ShardSpec],
                  done: dict[str, dict], advance: Callable[[int], None]) -> None:
    """Write the shards ``todo`` in order, recording each finished one in ``done`` and the journal."""
    resumed = len(done)
    by_name = {t.name: t for t in checkpoint.tensors}
    sources = Sources()
    pending: list[tuple[ShardSpec, Future[str]]] = []

    def record(finished: Iterable[tuple[ShardSpec, Future[str]]]) -> None:
        before = len(done) - resumed
        for spec, future in finished:
            digest = future.result()  # waits for the shard's hash, fsync and rename
            done[spec.file] = {"size": (staging / spec.file).stat().st_size, "hash": digest}
        write_journal(staging, key, done)
        for number in range(before + 1, len(done) - resumed + 1):
            failpoint(f"after-shard-{number}")  # the number-th shard of this run is in the journal

    # Finishing a shard (hash, fsync, rename) overlaps with copying the next one: the copy runs in the
    # kernel, so the finisher thread has the other core.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deploykit-finish") as finisher:
        try:
            for spec in todo:
                partial = write_shard(spec, by_name, layout, staging, sources, advance)
                pending.append((spec, finisher.submit(finalize_shard, partial)))
                ready = [p for p in pending if p[1].done()]
                if ready:
                    record(ready)
                    pending = [p for p in pending if p not in ready]
            if pending:
                record(pending)
        finally:
            sources.close()
