"""Where a deployment's files live and how they are made: its source (a checkpoint, or a GGUF file
imported into ``<state>/imports/``), its shards (one directory per source content and layout under
``shards_root``, laid out again when a shard there is damaged), and the collection of old shards.

A new revision never writes over the files of another: a failed apply leaves the current revision's
shards intact, and ``collect_old_shards`` removes old ones only after a new revision is Ready.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

from ...artifacts.fsutil import discard_dir, write_atomic
from ...artifacts.gguf import (
    import_dir,
    import_gguf,
    import_problem,
    source_fingerprint,
)
from ...artifacts.layout import fits_layout, plan_layout
from ...artifacts.quantize import quantize_for
from ...artifacts.reshard import ProgressSink, ReshardResult, reshard
from ...artifacts.verify import checksums, read_lock, shard_problem
from ...errors import CheckpointError
from ...files import read_regular_file
from ...model.checkpoint import LAID_OUT, Checkpoint, open_checkpoint
from ...model.gguf import is_gguf
from ...names import Phase
from ...placement.plan import Plan
from ...spec.manifest import LoadedManifest
from .decision import ADAPTERS
from .loading import StepTimer
from .state import StateStore

log = logging.getLogger(__name__)


def shards_root(loaded: LoadedManifest, store: StateStore) -> Path:
    """``<sharding.path or <state>/shards>/<name>``: each deployment owns its own directory, so
    collecting or deleting one deployment's shards never touches another's."""
    configured = loaded.manifest.spec.sharding.path
    return ((loaded.resolve(configured) if configured else store.directory / "shards") / loaded.name).resolve()


def shards_dir(loaded: LoadedManifest, store: StateStore, fingerprint: str, layout_digest: str) -> Path:
    """One directory per (source content, layout): a new revision never writes over the shards of
    another, so a failed apply leaves the current revision's files intact."""
    key = hashlib.sha256(f"{fingerprint}\0{layout_digest}".encode()).hexdigest()[:16]
    return shards_root(loaded, store) / key


def imports_root(store: StateStore) -> Path:
    """``<state>/imports``: GGUF files converted to checkpoint directories, one per (GGUF content, dtype,
    shard size), shared by every deployment of this state directory (docs/gguf.md)."""
    return store.directory / "imports"


def open_source(loaded: LoadedManifest) -> tuple[Checkpoint | None, str]:
    """The manifest's checkpoint and its fingerprint; for a GGUF file, no checkpoint yet (it is imported
    only when a new revision needs it) and the fingerprint of what its import holds."""
    spec = loaded.manifest.spec
    if is_gguf(loaded.model_path):
        return None, source_fingerprint(loaded.model_path, dtype=spec.model.dtype,
                                        max_shard_size=spec.sharding.max_shard_size,
                                        quantization=spec.model.quantization)
    checkpoint = open_checkpoint(loaded.model_path, allow_pickle=spec.model.allow_pickle)
    return checkpoint, with_adapters(loaded, checkpoint.fingerprint)


def with_adapters(loaded: LoadedManifest, fingerprint: str) -> str:
    """What a revision records as its source: the checkpoint's fingerprint, and its adapters' files' when it
    serves any, each by name (``spec.adapters.adapter_fingerprint``), so an adapter saved again in place is a
    change that ``decision.source_change`` names."""
    from ...spec.adapters import AdapterFileError, adapter_fingerprint

    adapters = loaded.manifest.spec.adapters
    if not adapters:
        return fingerprint
    try:
        return fingerprint + ADAPTERS + ";".join(f"{a.name}={adapter_fingerprint(loaded.resolve(a.path))}"
                                                 for a in adapters)
    except AdapterFileError as exc:
        raise CheckpointError(str(exc)) from None




def existing_import(loaded: LoadedManifest, store: StateStore) -> tuple[Path, Checkpoint | None]:
    """For a GGUF manifest: where its import lives, and the import as the checkpoint an apply would use
    if it is already there and intact by size (None: an apply converts it first). Converts nothing."""
    spec = loaded.manifest.spec
    fingerprint = source_fingerprint(loaded.model_path, dtype=spec.model.dtype,
                                     max_shard_size=spec.sharding.max_shard_size,
                                     quantization=spec.model.quantization)
    directory = import_dir(imports_root(store), fingerprint)
    if import_problem(directory, fingerprint, hashes=False) is not None:
        return directory, None
    return directory, replace(open_checkpoint(directory), fingerprint=fingerprint)


def import_source(loaded: LoadedManifest, store: StateStore, fingerprint: str, timer: StepTimer) -> Checkpoint:
    """The GGUF source as a checkpoint directory (converted now unless an intact import exists; its
    contents are verified, as every load of existing files is). The checkpoint carries the GGUF's
    fingerprint, so re-converting a damaged import is not a change of checkpoint."""
    spec = loaded.manifest.spec
    with timer.step("import"):
        directory = import_gguf(loaded.model_path, imports_root(store), dtype=spec.model.dtype,
                                max_shard_size=spec.sharding.max_shard_size,
                                quantization=spec.model.quantization)  # it logs each stage
        checkpoint = open_checkpoint(directory)
    if source_fingerprint(loaded.model_path, dtype=spec.model.dtype,
                          max_shard_size=spec.sharding.max_shard_size,
                          quantization=spec.model.quantization) != fingerprint:
        raise CheckpointError(f"{loaded.model_path}: changed during this apply; apply again")
    return replace(checkpoint, fingerprint=fingerprint)


def lay_out(loaded: LoadedManifest, store: StateStore, checkpoint: Checkpoint, plan: Plan,
            progress: ProgressSink | None) -> tuple[Path, ReshardResult | None]:
    """The directory the plan loads from: the checkpoint itself when its layout fits, else shards
    written for this (content, layout), laid out again if a previous copy is damaged."""
    spec = loaded.manifest.spec
    if spec.placement.tensor_parallel > 1:
        return _lay_out_ranks(loaded, store, checkpoint), None
    layout_args = {"max_shard_size": spec.sharding.max_shard_size, "dtype": spec.model.dtype,
                   "device_map": plan.device_map,
                   "quantize": quantize_for(checkpoint.path, scheme=spec.model.quantization, dtype=spec.model.dtype,
                                            task=spec.model.task, trust_remote_code=spec.model.trust_remote_code)}
    if fits_layout(checkpoint, **layout_args):  # type: ignore[arg-type]
        return checkpoint.path, None
    layout = plan_layout(checkpoint, **layout_args)  # type: ignore[arg-type]
    shards = _layout_dir(loaded, store, checkpoint, layout.digest, what="shards")
    fresh = read_lock(shards) is None
    result = reshard(checkpoint, shards, progress=progress, **layout_args)  # type: ignore[arg-type]
    if fresh:
        mark_laid_out(shards, store)
    return shards, result


def _layout_dir(loaded: LoadedManifest, store: StateStore, checkpoint: Checkpoint, digest: str, *, what: str) -> Path:
    """The directory of this layout of the checkpoint, emptied first when a shard there is damaged (its
    writer then lays it out again), its parent created."""
    shards = shards_dir(loaded, store, checkpoint.fingerprint, digest)
    lock = read_lock(shards)
    if lock is not None and (problem := shard_problem(shards, lock, hashes=True)) is not None:
        log.warning("%s: %s; laying the %s out again from %s", loaded.name, problem, what, checkpoint.path)
        discard_dir(shards)
    shards.parent.mkdir(parents=True, exist_ok=True)
    return shards


def _lay_out_ranks(loaded: LoadedManifest, store: StateStore, checkpoint: Checkpoint) -> Path:
    """Tensor parallel: one file per rank (its slices and what it replicates), with checksums."""
    from ...artifacts.rank_shards import rank_layout, write_rank_shards

    model = loaded.manifest.spec.model
    layout = rank_layout(checkpoint, ranks=loaded.manifest.spec.placement.tensor_parallel, dtype=model.dtype,
                         task=model.task, trust_remote_code=model.trust_remote_code)
    directory = _layout_dir(loaded, store, checkpoint, layout.digest, what="rank shards")
    fresh = read_lock(directory) is None
    written = write_rank_shards(checkpoint, directory, layout)
    if fresh:
        mark_laid_out(written, store)
    return written


def in_place_checksums(checkpoint: Checkpoint) -> dict[str, dict]:
    """Checksums of the checkpoint's own tensor files, for a revision that loads it in place."""
    return checksums(checkpoint.path, sorted({str(t.file.relative_to(checkpoint.path)) for t in checkpoint.tensors}))


def _identity(store: StateStore) -> str:
    return str(store.directory.resolve())


def mark_laid_out(directory: Path, store: StateStore) -> None:
    """Record in ``directory`` that this state directory laid it out (``LAID_OUT``): only this state
    directory's collection may then remove it."""
    write_atomic(directory / LAID_OUT, json.dumps({"state_dir": _identity(store)}).encode())


def laid_out_by(directory: Path, store: StateStore) -> bool:
    """Whether this state directory laid ``directory`` out (its ``LAID_OUT`` record names it). A shards
    directory of another state directory, a `deploykit reshard` output or a checkpoint has no such record
    naming this one, whatever lock file it holds."""
    try:
        record = json.loads(read_regular_file(directory / LAID_OUT, 4096))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("state_dir") == _identity(store)


def collect_old_shards(loaded: LoadedManifest, store: StateStore) -> None:
    """Keep the shards of the current and the previous Ready revision (for rollback); remove the rest of
    what this state directory laid out under the deployment's shards root, and nothing else there."""
    root = shards_root(loaded, store)
    keep = [Path(r.shards_path).resolve() for r in store.history(loaded.name)
            if r.phase == Phase.READY and r.shards_path][-2:]
    if not root.is_dir():
        return
    for child in root.iterdir():
        if (child.is_dir() and not child.is_symlink() and child.resolve() not in keep
                and read_lock(child) is not None and laid_out_by(child, store)):
            shutil.rmtree(child, ignore_errors=True)
            log.info("removed old shards %s", child)
