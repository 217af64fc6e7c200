"""Whole-deployment operations beyond one apply: roll back, delete, prune a directory's leftovers.

The CLI and the server call these; they hold the rules (which revision a rollback targets, what a
delete removes) so that no front end re-implements them.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import DeploykitError
from ...names import Phase
from .loading import recorded_manifest
from .reconciler import ApplyOptions, ApplyOutcome, apply
from .state import Revision, StateStore

log = logging.getLogger(__name__)


def rollback_target(store: StateStore, name: str, *, to_revision: int | None = None) -> Revision:
    """The revision a rollback re-applies: ``to_revision``, else the Ready one before the current. Only a
    revision that served can be brought back: a Failed one never did (Ready is final in the store: a revision
    is recorded Ready once, and only a Progressing one is ever marked Failed), a Progressing one is still
    being applied. Its manifest then passes the admission gate like any apply (``control.admission``)."""
    if to_revision is not None:
        found = store.get(name, to_revision)
        if found is None:
            raise DeploykitError(f"{name!r} has no revision {to_revision}")
        if found.phase != Phase.READY:
            raise DeploykitError(_not_servable(found))
        return found
    current = store.current(name)
    ready = [r for r in store.history(name)
             if r.phase == Phase.READY and (current is None or r.revision < current.revision)]
    if not ready:
        raise DeploykitError(f"{name!r} has no Ready revision before the current one to roll back to")
    return ready[-1]


def _not_servable(revision: Revision) -> str:
    what = (f"is {revision.phase}" + (f" ({revision.reason})" if revision.reason else "")
            if revision.phase == Phase.FAILED else "is still being applied")
    return (f"revision {revision.revision} of {revision.name!r} {what}: it never served, so it cannot be rolled "
            "back to; choose a Ready revision (deploykit history " + revision.name + ")")


def rollback(store: StateStore, name: str, *, to_revision: int | None = None,
             on_step: Callable[[str], None] | None = None) -> tuple[Revision, ApplyOutcome]:
    """Re-apply a recorded revision's manifest: a new revision with the old content."""
    target = rollback_target(store, name, to_revision=to_revision)
    outcome = apply(recorded_manifest(target), store=store, options=ApplyOptions(force=True), on_step=on_step)
    return target, outcome


def remove_shards(store: StateStore, name: str) -> list[Path]:
    """Remove every shard directory deploykit laid out for ``name`` inside its own shards root (never a
    checkpoint used in place, nor a directory `deploykit reshard` wrote for the user)."""
    removed = []
    for revision in store.history(name):
        path = _laid_out(store, revision)
        if path is not None and path not in removed:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _laid_out(store: StateStore, revision: Revision) -> Path | None:
    """The revision's shards directory when deploykit laid it out: a directory of its own directly under
    the shards root its manifest names (``layouts.shards_root``), holding a lock file, and not the model
    it was laid out from. A lock file alone proves nothing: `deploykit reshard` leaves one in its
    destination, and a checkpoint whose layout fits is recorded as the revision's shards path."""
    from ...artifacts.verify import read_lock
    from .layouts import shards_root

    if not revision.shards_path:
        return None
    path = Path(revision.shards_path).resolve()
    try:
        loaded = recorded_manifest(revision)
    except DeploykitError:
        return None  # cannot say where its own root was: keep the files
    model = loaded.model_path.resolve()
    if (path.parent != shards_root(loaded, store) or path == model or path in model.parents
            or not path.is_dir() or read_lock(path) is None):
        return None
    return path


def delete(store: StateStore, name: str, *, keep_shards: bool = False, reason: str = "deleted") -> None:
    """Forget ``name`` (its history stays in the store) and remove its shards unless ``keep_shards``."""
    if store.latest(name) is None:
        raise DeploykitError(f"no deployment named {name!r}")
    with store.deployment_lock(name):
        if not keep_shards:
            for path in remove_shards(store, name):
                log.info("%s: removed shards %s", name, path)
        store.forget(name, reason=reason)


def prune_directory(store: StateStore, directory: Path, *, keep: set[str]) -> list[str]:
    """Delete the deployments whose manifests lived in ``directory`` and are no longer among ``keep``."""
    pruned = []
    for name in store.names():
        manifest = store.deployment_manifest(name) or ""
        if name not in keep and Path(manifest).parent == directory.resolve():
            delete(store, name, reason="manifest removed; deployment pruned")
            pruned.append(name)
    return pruned


def outcome_summary(outcome: ApplyOutcome) -> dict[str, Any]:
    """An apply's outcome as JSON: ``deploykit apply -o json`` and the control API's result event."""
    reshard = outcome.reshard
    return {"name": outcome.name, "status": outcome.status, "revision": outcome.revision,
            "actions": [{"step": a.step, "reason": a.reason} for a in outcome.actions],
            "timings": outcome.timings, "shards": str(outcome.shards) if outcome.shards else None,
            "health": outcome.health, "plan": outcome.plan.to_dict() if outcome.plan else None,
            "reshard": {"files": len(reshard.layout.shards), "status": reshard.status} if reshard else None}
