"""The staging directory of a reshard and its atomic swap into DST.

The output is built beside DST in ``.DST.deploykit-<key>``; its journal (``journal.json``) lists the
shards already finished, so an interrupted job resumes; the index, non-weight files and lock file are
written last; then the tree replaces DST in one step (``renameat2(RENAME_EXCHANGE)``, or two renames
that the next start completes or undoes). ``failpoint`` is the crash-test hook at each of these steps.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

from ..errors import CheckpointError
from ..model.checkpoint import INDEX, LOCK, Checkpoint
from .fsutil import copy_file_synced, exchange_dirs, fsync_dir, write_atomic
from .layout import Layout, output_names
from .verify import LOCK_VERSION, file_hash, read_lock

log = logging.getLogger(__name__)
_JOURNAL = "journal.json"


def failpoint(name: str) -> None:
    """Crash-test hook: ``DEPLOYKIT_FAILPOINT=name`` kills the process right here with SIGKILL."""
    if os.environ.get("DEPLOYKIT_FAILPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _old_tree(dst: Path) -> Path:
    """Where the two-rename swap sets the previous DST aside."""
    return dst.parent / f".{dst.name}.deploykit-old"


def recover_interrupted_swap(dst: Path) -> None:
    """Undo half of a two-rename swap (file systems without RENAME_EXCHANGE) cut by a crash."""
    old = _old_tree(dst)
    if old.exists() and not dst.exists():
        os.rename(old, dst)
        fsync_dir(dst.parent)
        log.warning("restored %s after an interrupted reshard", dst)
    elif old.exists():
        shutil.rmtree(old)


def remove_stale_staging(dst: Path, keep: Path | None = None) -> None:
    """Staging trees of interrupted jobs with other inputs, or an old tree a crash left after a swap."""
    for stale in dst.parent.glob(f".{dst.name}.deploykit-*"):
        if stale != keep and stale.is_dir() and not stale.name.endswith("-old"):
            shutil.rmtree(stale, ignore_errors=True)


def staging_dir(dst: Path, key: str) -> Path:
    """The staging directory for inputs ``key`` (created if absent; those of other inputs removed)."""
    staging = dst.parent / f".{dst.name}.deploykit-{key}"
    remove_stale_staging(dst, keep=staging)
    staging.mkdir(parents=True, exist_ok=True)
    return staging


def check_replaceable(dst: Path) -> None:
    """Refuse a DST that the swap would destroy although deploykit did not write it."""
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"DST {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and read_lock(dst) is None:
        raise CheckpointError(f"DST {dst} exists, is not empty and was not written by deploykit (no {LOCK}); "
                              "refusing to replace it: choose a new or empty directory")


def load_journal(staging: Path, key: str, layout: Layout) -> dict[str, dict]:
    """The shards a previous run with the same inputs finished: file -> {"size", "hash"}."""
    try:
        journal = json.loads((staging / _JOURNAL).read_text())
    except (OSError, ValueError):
        return {}
    if journal.get("key") != key:
        return {}
    sizes = {s.file: s for s in layout.shards}
    done = {}
    for file, entry in journal.get("done", {}).items():
        path = staging / file
        if file in sizes and path.is_file() and path.stat().st_size == entry.get("size"):
            done[file] = entry
    return done


def write_journal(staging: Path, key: str, done: dict[str, dict]) -> None:
    write_atomic(staging / _JOURNAL, json.dumps({"key": key, "done": done}).encode())


def _lock_document(checkpoint: Checkpoint, layout: Layout, done: dict[str, dict],
                   files: list[dict]) -> dict:
    by_name = {t.name: t for t in checkpoint.tensors}
    return {
        "version": LOCK_VERSION,
        "source": {"path": str(checkpoint.path.resolve()), "fingerprint": checkpoint.fingerprint},
        "layout": {"digest": layout.digest, "max_shard_size": layout.max_shard_size,
                   "dtype": layout.dtype, "device_aligned": layout.device_aligned,
                   **({"quantization": layout.quantize.scheme} if layout.quantize else {})},
        "total_size": layout.total_size,
        "shards": [{"file": s.file, "device": s.device, "size": done[s.file]["size"],
                    "hash": done[s.file]["hash"], "tensors": output_names(s.tensors, by_name, layout.quantize)}
                   for s in layout.shards],
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def finish_staging(checkpoint: Checkpoint, layout: Layout, staging: Path,
                   done: dict[str, dict]) -> None:
    """Once every shard is in: the index, the non-weight files and the lock file, all fsynced."""
    by_name = {t.name: t for t in checkpoint.tensors}
    weight_map = {name: s.file for s in layout.shards
                  for name in output_names(s.tensors, by_name, layout.quantize)}
    index = {"metadata": {"total_size": layout.total_size}, "weight_map": weight_map}
    write_atomic(staging / INDEX, json.dumps(index, indent=2).encode())
    files = []
    for rel in checkpoint.other_files:
        copy_file_synced(checkpoint.path / rel, staging / rel)
        files.append({"path": str(rel), "size": (staging / rel).stat().st_size,
                      "hash": file_hash(staging / rel)})
    for directory in {(staging / rel).parent for rel in checkpoint.other_files}:
        fsync_dir(directory)
    lock = _lock_document(checkpoint, layout, done, files)
    write_atomic(staging / LOCK, json.dumps(lock, indent=2).encode())
    (staging / _JOURNAL).unlink(missing_ok=True)
    fsync_dir(staging)


def commit(staging: Path, dst: Path) -> None:
    """Replace DST with the finished staging tree in one step, then remove the previous tree."""
    failpoint("before-commit")
    if not dst.exists():
        os.rename(staging, dst)
        fsync_dir(dst.parent)
        return
    if exchange_dirs(staging, dst):
        failpoint("after-exchange")
        shutil.rmtree(staging)  # now holds the previous tree
        return
    old = _old_tree(dst)
    os.rename(dst, old)
    failpoint("between-renames")
    os.rename(staging, dst)
    fsync_dir(dst.parent)
    shutil.rmtree(old)
