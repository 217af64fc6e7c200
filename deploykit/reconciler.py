"""Desired (a manifest) against actual (the state store) -> the steps to take, then taking them.

``reconcile_once`` is a plain function over two small values, tested table by table. ``apply`` runs its
steps in order, recording the revision as Progressing before any side effect and its outcome after:

    validate -> plan -> reshard (device-aligned, only if the layout on disk differs) -> load
             -> health check -> Ready

Any failure marks the revision Failed with its reason and leaves the previous revision current and its
shards untouched (each layout lives in its own directory; old ones are removed only after a new
revision is Ready). An unchanged manifest with an unchanged checkpoint is a no-op that reads no weights
and imports no torch.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import open_checkpoint
from .errors import ApplyError, DeploykitError, ManifestError
from .inventory import Inventory
from .manifest import LoadedManifest, check_on_host
from .planner import Plan
from .reshard import ProgressSink, ReshardResult, fits_layout, plan_layout, read_lock, reshard
from .state import Revision, StateStore

if TYPE_CHECKING:
    from .loader import LoadedModel

log = logging.getLogger(__name__)
STEPS = ("plan", "reshard", "load", "health-check", "record")


@dataclass(frozen=True)
class Desired:
    name: str
    manifest_digest: str
    checkpoint_fingerprint: str


@dataclass(frozen=True)
class Actual:
    revision: int | None  # the current (last Ready) revision
    manifest_digest: str | None = None
    checkpoint_fingerprint: str | None = None
    shards_present: bool = False


@dataclass(frozen=True)
class Action:
    step: str
    reason: str


def reconcile_once(desired: Desired, actual: Actual, *, force: bool = False) -> tuple[Action, ...]:
    """The steps that bring ``actual`` to ``desired``; empty when nothing is to be done."""
    if actual.revision is None:
        reason = "no revision is deployed yet"
    elif force:
        reason = "forced"
    elif actual.manifest_digest != desired.manifest_digest:
        reason = "the manifest changed"
    elif actual.checkpoint_fingerprint != desired.checkpoint_fingerprint:
        reason = "the checkpoint changed"
    elif not actual.shards_present:
        reason = f"the resharded checkpoint of revision {actual.revision} is missing or incomplete"
    else:
        return ()
    return tuple(Action(step, reason) for step in STEPS)


@dataclass
class ApplyOutcome:
    name: str
    status: str  # "unchanged" | "applied" | "dry-run"
    revision: int | None
    plan: Plan | None
    actions: tuple[Action, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    shards: Path | None = None
    reshard: ReshardResult | None = None
    loaded: LoadedModel | None = None  # when the caller keeps the model
    health: str | None = None


def git_commit(path: Path) -> str | None:
    """HEAD of the git work tree holding ``path``, if any."""
    try:
        out = subprocess.run(["git", "-C", str(path.parent), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def shards_root(loaded: LoadedManifest, store: StateStore) -> Path:
    configured = loaded.manifest.spec.sharding.path
    return (loaded.resolve(configured) if configured else store.directory / "shards" / loaded.name).resolve()


def shards_dir(loaded: LoadedManifest, store: StateStore, fingerprint: str, layout_digest: str) -> Path:
    """One directory per (source content, layout): a new revision never writes over the shards of
    another, so a failed apply leaves the current revision's files intact."""
    import hashlib

    key = hashlib.sha256(f"{fingerprint}\0{layout_digest}".encode()).hexdigest()[:16]
    return shards_root(loaded, store) / key


def _shards_present(revision: Revision | None) -> bool:
    if revision is None or not revision.shards_path:
        return False
    path = Path(revision.shards_path)
    lock = read_lock(path)
    if lock is None:
        return (path / "config.json").is_file()  # the source itself, used in place
    return all((path / s["file"]).is_file() and (path / s["file"]).stat().st_size == s["size"]
               for s in lock["shards"])


class _Timer:
    def __init__(self, on_step: Callable[[str], None] | None) -> None:
        self.timings: dict[str, float] = {}
        self.on_step = on_step

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        if self.on_step:
            self.on_step(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(time.perf_counter() - start, 4)


def apply(loaded: LoadedManifest, *, store: StateStore, devices: str | None = None, dry_run: bool = False,
          force: bool = False, keep_model: bool = False, progress: ProgressSink | None = None,
          on_step: Callable[[str], None] | None = None, inventory: Inventory | None = None,
          before_load: Callable[[], None] | None = None, load_if_unchanged: bool = False) -> ApplyOutcome:
    """Make ``loaded`` the deployed revision of its name. See the module docstring.

    ``inventory`` overrides ``devices`` (a runtime plans around the generation it still holds);
    ``before_load`` runs after planning and resharding, just before the new model is loaded (a
    recreate rollout unloads the old generation there). ``keep_model`` returns the loaded model;
    ``load_if_unchanged`` also loads the current revision when nothing changed (a process starting).
    """
    timer = _Timer(on_step)
    spec = loaded.manifest.spec
    with timer.step("validate"):
        issues = check_on_host(loaded)
        if issues:
            raise ManifestError(issues)
        checkpoint = open_checkpoint(loaded.model_path, allow_pickle=spec.model.allow_pickle)
    desired = Desired(loaded.name, loaded.digest, checkpoint.fingerprint)
    lock = store.deployment_lock(loaded.name) if not dry_run else _no_lock()
    with lock:
        current = store.current(loaded.name)
        actual = Actual(current.revision if current else None,
                        current.manifest_digest if current else None,
                        current.checkpoint_fingerprint if current else None, _shards_present(current))
        actions = reconcile_once(desired, actual, force=force)
        if not actions and current is not None:
            outcome = ApplyOutcome(loaded.name, "unchanged", current.revision,
                                   Plan.from_dict(current.plan or {}) if current.plan else None,
                                   timings=timer.timings, shards=Path(current.shards_path or ""))
            if load_if_unchanged and outcome.plan is not None:
                with timer.step("load"):
                    outcome.loaded = _load(loaded, outcome.plan, Path(current.shards_path or ""))
            return outcome
        if dry_run:
            from .planning import plan_manifest

            with timer.step("plan"):
                plan = plan_manifest(loaded, devices=devices, inventory=inventory)
            return ApplyOutcome(loaded.name, "dry-run", None, plan, actions, timer.timings)
        revision = store.begin_revision(
            name=loaded.name, manifest_path=str(Path(loaded.source).resolve()), manifest_text=loaded.text,
            manifest_digest=loaded.digest, plan_json=None, plan_digest=None,
            checkpoint_fingerprint=checkpoint.fingerprint, shards_path=None,
            git_commit=git_commit(Path(loaded.source).resolve()))
        try:
            outcome = _run(loaded, store, revision, checkpoint, devices, inventory, timer, progress,
                           keep_model, before_load)
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, DeploykitError) else f"{type(exc).__name__}: {exc}"
            store.finish_revision(loaded.name, revision, ready=False, reason=reason or type(exc).__name__,
                                  timings=timer.timings)
            raise
        outcome.actions = actions
        return outcome


@contextmanager
def _no_lock() -> Iterator[None]:
    yield


def _run(loaded: LoadedManifest, store: StateStore, revision: int, checkpoint: object,
         devices: str | None, inventory: Inventory | None, timer: _Timer, progress: ProgressSink | None,
         keep_model: bool, before_load: Callable[[], None] | None) -> ApplyOutcome:
    from .checkpoint import Checkpoint
    from .health import check
    from .loader import check_fits_host
    from .planning import plan_manifest

    assert isinstance(checkpoint, Checkpoint)
    spec = loaded.manifest.spec
    with timer.step("plan"):
        plan = plan_manifest(loaded, devices=devices, inventory=inventory)
        check_fits_host(plan)
    layout_kwargs: dict[str, Any] = {"max_shard_size": spec.sharding.max_shard_size, "dtype": spec.model.dtype,
                     "device_map": plan.device_map}
    result: ReshardResult | None = None
    with timer.step("reshard"):
        if fits_layout(checkpoint, **layout_kwargs):
            shards = checkpoint.path
        else:
            layout = plan_layout(checkpoint, **layout_kwargs)
            shards = shards_dir(loaded, store, checkpoint.fingerprint, layout.digest)
            shards.parent.mkdir(parents=True, exist_ok=True)
            result = reshard(checkpoint.path, shards, allow_pickle=spec.model.allow_pickle,
                             progress=progress, **layout_kwargs)
    store.set_plan(loaded.name, revision, plan_json=json.dumps(plan.to_dict()), plan_digest=plan.digest,
                   shards_path=str(shards))
    if before_load is not None:
        with timer.step("drain"):
            before_load()
    with timer.step("load"):
        model = _load(loaded, plan, shards, show_progress=progress is not None)
    with timer.step("health-check"):
        hc = spec.rollout.health_check
        health = check(model, task=spec.model.task, text=hc.input, timeout=hc.timeout)
    store.finish_revision(loaded.name, revision, ready=True, reason=health.detail, timings=timer.timings)
    _collect_old_shards(loaded, store)
    return ApplyOutcome(loaded.name, "applied", revision, plan, timings=timer.timings, shards=shards,
                        reshard=result, loaded=model if keep_model else None, health=health.detail)


def _load(loaded: LoadedManifest, plan: Plan, shards: Path, *, show_progress: bool = False) -> LoadedModel:
    from .loader import load

    spec = loaded.manifest.spec
    disk = spec.offload.disk
    return load(plan, shards, task=spec.model.task, dtype=spec.model.dtype,
                trust_remote_code=spec.model.trust_remote_code,
                offload_dir=loaded.resolve(disk.path) if disk else None, show_progress=show_progress)


def _collect_old_shards(loaded: LoadedManifest, store: StateStore) -> None:
    """Keep the shards of the current and the previous Ready revision (for rollback); remove the rest."""
    root = shards_root(loaded, store)
    keep = [Path(r.shards_path) for r in store.history(loaded.name)
            if r.phase == "Ready" and r.shards_path][-2:]
    if not root.is_dir():
        return
    for child in root.iterdir():
        if child.is_dir() and child not in keep and read_lock(child) is not None:
            shutil.rmtree(child, ignore_errors=True)
            log.info("removed old shards %s", child)


def apply_recorded(revision: Revision, *, store: StateStore, devices: str | None = None,
                   progress: ProgressSink | None = None,
                   on_step: Callable[[str], None] | None = None) -> ApplyOutcome:
    """Re-apply a recorded revision's manifest (rollback): a new revision with the old content."""
    return apply(recorded_manifest(revision), store=store, devices=devices, force=True, progress=progress,
                 on_step=on_step)


def recorded_manifest(revision: Revision) -> LoadedManifest:
    """The manifest a revision recorded (normalised, absolute paths), loaded again."""
    from .manifest import parse_manifests

    [loaded] = parse_manifests(revision.manifest_text.encode(), source=revision.manifest_path,
                               base_dir=Path(revision.manifest_path).parent)
    if loaded.name != revision.name:
        raise ApplyError(f"revision {revision.revision} of {revision.name!r} records another name")
    return loaded
