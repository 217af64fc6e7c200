"""Applying a manifest: observe actual (the state store and the files), decide, then act on the Decision.

The decision itself is ``decision`` (pure: ``decide(desired, actual)``); where a deployment's
files live and how they are made (the GGUF import, the shards, their collection) is ``layouts``.
``apply`` observes, decides, and then acts in this order:

    validate -> observe -> decide -> [import a GGUF source] -> plan (fits or PlanInfeasible: nothing
             recorded yet) -> record the revision as Progressing -> reshard (only if the layout on disk
             differs) -> load -> health check -> Ready

A process that serves the model (``ApplyOptions(gated=True)``) records Ready itself, at the one point after
which nothing can fail: once the generation's runtime is built and just before it becomes current
(``live.commit``, a canary's promotion); a CLI apply, which serves nothing, records it here.

A GGUF file as ``spec.model.path`` is identified by ``artifacts.gguf.source_fingerprint`` (metadata only)
for deciding, and converted into a checkpoint directory under ``<state>/imports/`` (``imports_root``)
only once a new revision needs its weights; from there on that directory is the checkpoint, exactly as
a Hugging Face directory would be. The revision records the manifest as written (the ``.gguf`` path).

Planning comes before recording: a plan that does not fit is an answer, not a failed revision (a
rollout that falls back from blue-green to recreate never leaves a false Failed entry). Any failure
after recording marks the revision Failed with its reason and leaves the previous revision current and
its shards untouched (each layout lives in its own directory; old ones are removed only after a new
revision is Ready). An unchanged manifest with an unchanged checkpoint is a no-op that reads no weights
and imports no torch; when the caller needs the model (a process starting), the current revision's
shards are verified against their checksums, loaded and health-checked: nothing unchecked serves.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...artifacts.reshard import ProgressSink, ReshardResult
from ...artifacts.verify import checksums
from ...errors import CheckpointError, DeploykitError, ManifestError
from ...model.checkpoint import Checkpoint
from ...placement.inventory import Inventory
from ...placement.plan import Plan
from ...spec.manifest import LoadedManifest
from .change import Change
from .decision import Action, Actual, Decision, Desired, decide
from .layouts import (
    collect_old_shards,
    import_source,
    in_place_checksums,
    lay_out,
    open_source,
)
from .loading import StepTimer, is_llama_cpp, load_checked, shards_problem
from .state import Revision, StateStore

if TYPE_CHECKING:
    from ...engine.loader import LoadedModel


@dataclass(frozen=True)
class ApplyOptions:
    """How to apply, beyond the manifest itself."""

    devices: str | None = None  # simulated inventory (``4x80GiB``); None: this host
    inventory: Inventory | None = None  # overrides ``devices`` (a rollout plans around a held generation)
    dry_run: bool = False
    force: bool = False
    keep_model: bool = False  # return the loaded model (a runtime serves it)
    load_if_unchanged: bool = False  # also load the current revision when nothing changed
    before_load: Callable[[], None] | None = None  # runs just before loading (recreate frees the old model)
    interrupted: Callable[[], None] | None = None  # raises to stop before the load (a gated rollout's abort)
    gated: bool = False  # loaded and checked, left Progressing: the caller records it Ready once it serves
    # (``live.commit.serve_applied``, a canary's promotion) or Failed (``finish_gated``)


@dataclass
class ApplyOutcome:
    name: str
    status: str  # "unchanged" | "applied" | "loaded" | "dry-run" | "deferred" (applied by the first request)
    revision: int | None
    plan: Plan | None
    actions: tuple[Action, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    shards: Path | None = None
    reshard: ReshardResult | None = None
    loaded: LoadedModel | None = None  # when the caller keeps the model
    health: str | None = None


COMMIT_MARKER = ".deploykit-commit"  # beside a git source's published manifests: the commit they came from


@dataclass(frozen=True)
class CommitMarker:
    """A git source's marker: ``applied``, the last commit published whole (its first line, "-" for none),
    and for each manifest digest the directory may hold, the commit that content came from ("DIGEST COMMIT"
    lines). While a commit is published the marker lists the old commit's contents and the new one's, so a
    reload in between records the commit of the content it read, never a commit it does not have."""

    applied: str | None
    by_digest: dict[str, str]

    def text(self) -> bytes:
        lines = [self.applied or "-", *(f"{d} {c}" for d, c in self.by_digest.items())]
        return "\n".join(lines).encode() + b"\n"

    @staticmethod
    def read(directory: Path) -> CommitMarker | None:
        try:
            first, *rest = (directory / COMMIT_MARKER).read_text().splitlines() or [""]
        except (OSError, UnicodeDecodeError):
            return None
        pairs = (line.split() for line in rest)
        return CommitMarker(None if first.strip() in ("", "-") else first.strip(),
                            {p[0]: p[1] for p in pairs if len(p) == 2})


def git_commit(path: Path, digest: str | None = None) -> str | None:
    """The commit ``path`` came from: a git source's commit for the content of digest ``digest`` (its
    marker beside the file), else HEAD of the git work tree holding ``path``, if any."""
    marker = CommitMarker.read(path.parent)
    if marker is not None:
        if digest is None or not marker.by_digest:
            return marker.applied
        return marker.by_digest.get(digest)
    try:
        out = subprocess.run(["git", "-C", str(path.parent), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def apply(loaded: LoadedManifest, *, store: StateStore, options: ApplyOptions = ApplyOptions(),
          progress: ProgressSink | None = None, on_step: Callable[[str], None] | None = None,
          change: Change | None = None) -> ApplyOutcome:
    """Make ``loaded`` the deployed revision of its name. See the module docstring. ``change``: the
    change this apply is a step of (its host checks and plans are made once, whoever asks first)."""
    timer = StepTimer(on_step)
    change = change if change is not None else Change(loaded, options.devices)
    with timer.step("validate"):
        issues = change.issues()
        if issues:
            _refuse_without_source(loaded, store, options)
            raise ManifestError(issues)
        checkpoint, fingerprint = open_source(loaded)
    lock = nullcontext() if options.dry_run else store.deployment_lock(loaded.name)
    with lock:
        current = store.current(loaded.name)
        desired = Desired(loaded.name, loaded.digest, fingerprint, load=options.load_if_unchanged)
        unchanged = (current is not None and current.manifest_digest == loaded.digest
                     and current.checkpoint_fingerprint == fingerprint and not options.force)
        actual = Actual(current.revision if current else None,
                        current.manifest_digest if current else None,
                        current.checkpoint_fingerprint if current else None,
                        shards_problem(current, hashes=desired.load and unchanged))
        if checkpoint is not None:  # a GGUF import is never refused: it is converted again instead
            _refuse_changed_in_place(current, checkpoint, actual, options)
        decision = decide(desired, actual, force=options.force)
        if not decision.new_revision and current is not None:
            if not options.dry_run and not options.load_if_unchanged:
                # a no-op confirms what serves: earlier errors are over. A start that loads the current revision
                # (a restart) confirms nothing: a change it interrupted stays Failed where status shows it
                store.settle(loaded.name)
            return _reuse(loaded, current, decision, timer, options)
        if options.dry_run:
            return ApplyOutcome(loaded.name, "dry-run", None, _plan(change, options, timer), decision.actions,
                                timer.timings)
        if checkpoint is None and not is_llama_cpp(loaded):  # llama.cpp serves the GGUF file as it is
            checkpoint = import_source(loaded, store, fingerprint, timer)
        return _act(change, store, checkpoint, fingerprint, decision, options, timer, progress)


def _refuse_without_source(loaded: LoadedManifest, store: StateStore, options: ApplyOptions) -> None:
    """The source is unusable: if the current shards are damaged too, say which one (they cannot be
    laid out again)."""
    current = store.current(loaded.name) if options.load_if_unchanged else None
    problem = shards_problem(current, hashes=True) if current is not None else None
    if problem is not None:
        raise CheckpointError(f"revision {current.revision} of {loaded.name!r} cannot be served: {problem}; "  # type: ignore[union-attr]
                              f"its source checkpoint {loaded.model_path} is gone, so the shards cannot be "
                              "laid out again")


def _refuse_changed_in_place(current: Revision | None, checkpoint: Checkpoint, actual: Actual,
                             options: ApplyOptions) -> None:
    """A checkpoint used in place whose files changed without a new fingerprint (same size and
    modification time) cannot be laid out again from itself: name the file instead of serving it."""
    if (current is None or actual.shards_problem is None or options.force or not current.checksums
            or Path(current.shards_path or "") != checkpoint.path.resolve()):
        return
    raise CheckpointError(f"{actual.shards_problem}; revision {current.revision} of {current.name!r} uses this "
                          "checkpoint in place, so it cannot be laid out again: restore the file, or apply "
                          "with --force to accept its new content")


def _reuse(loaded: LoadedManifest, current: Revision, decision: Decision, timer: StepTimer,
           options: ApplyOptions) -> ApplyOutcome:
    """Nothing to record: keep the current revision, loading it (health-checked) if asked."""
    plan = current.plan
    outcome = ApplyOutcome(loaded.name, "unchanged", current.revision, plan, decision.actions, timer.timings,
                           shards=Path(current.shards_path or ""))
    if "load" in decision.steps and plan is not None:
        model, health = load_checked(loaded, plan, Path(current.shards_path or ""), timer)
        outcome.status, outcome.loaded, outcome.health = "loaded", model, health
    return outcome


def plan_deployment(loaded: LoadedManifest, *, devices: str | None = None, inventory: Inventory | None = None) -> Plan:
    """The plan of ``loaded`` against ``inventory``, else ``change.deployment_inventory(loaded, devices)``."""
    return Change(loaded, devices).plan(inventory)


def _plan(change: Change, options: ApplyOptions, timer: StepTimer) -> Plan:
    with timer.step("plan"):
        return change.plan(options.inventory)


def _act(change: Change, store: StateStore, checkpoint: Checkpoint | None, fingerprint: str, decision: Decision,
         options: ApplyOptions, timer: StepTimer, progress: ProgressSink | None) -> ApplyOutcome:
    """Plan (nothing recorded if it does not fit), record, then do the side effects. ``checkpoint`` None:
    a GGUF file that llama.cpp reads in place (checksummed, never laid out again)."""
    from ...engine.loader import check_fits_host

    loaded = change.loaded
    plan = _plan(change, options, timer)
    check_fits_host(plan)
    source = Path(loaded.source).resolve()
    revision = store.begin_revision(
        name=loaded.name, manifest_path=str(source), manifest_text=loaded.text, manifest_digest=loaded.digest,
        checkpoint_fingerprint=fingerprint, git_commit=loaded.commit or git_commit(source, loaded.digest))
    if decision.actions:  # why this revision exists (a damaged shard is named here), for `deploykit history`
        store.record_event(loaded.name, "Decided", f"revision {revision}: {decision.actions[0].reason}")
    try:
        with timer.step("reshard"):
            shards, result, sums = _files(loaded, store, checkpoint, plan, progress)
        store.set_plan(loaded.name, revision, plan_json=json.dumps(plan.to_dict()), plan_digest=plan.digest,
                       shards_path=str(shards), checksums=sums)
        if options.interrupted is not None:
            options.interrupted()  # an abort while it laid out: no load for nothing
        if options.before_load is not None:
            with timer.step("drain"):
                options.before_load()
        model, health = load_checked(loaded, plan, shards, timer, show_progress=progress is not None,
                                     interrupted=options.interrupted)
    except BaseException as exc:
        reason = str(exc) if isinstance(exc, DeploykitError) else f"{type(exc).__name__}: {exc}"
        store.finish_revision(loaded.name, revision, ready=False, reason=reason or type(exc).__name__,
                              timings=timer.timings)
        raise
    if not options.gated:
        finish_gated(loaded, store, revision, ready=True, reason=health, timings=timer.timings)
    if not options.keep_model and model.runtime is not None:
        model.runtime.close()  # checked and recorded; nothing here serves it (a CLI apply)
    return ApplyOutcome(loaded.name, "applied", revision, plan, decision.actions, timer.timings, shards=shards,
                        reshard=result, loaded=model if options.keep_model else None, health=health)


def _files(loaded: LoadedManifest, store: StateStore, checkpoint: Checkpoint | None, plan: Plan,
           progress: ProgressSink | None) -> tuple[Path, ReshardResult | None, dict[str, dict] | None]:
    """Where the model loads from, the reshard (if one ran), and the checksums of files used in place."""
    if checkpoint is None:  # llama.cpp: the GGUF file in place, its checksum recorded
        gguf = loaded.model_path.resolve()
        return gguf.parent, None, checksums(gguf.parent, [gguf.name])
    shards, result = lay_out(loaded, store, checkpoint, plan, progress)
    in_place = result is None and shards == checkpoint.path
    return shards, result, in_place_checksums(checkpoint) if in_place else None


def finish_gated(loaded: LoadedManifest, store: StateStore, revision: int, *, ready: bool, reason: str | None,
                 timings: dict[str, float] | None = None, collect: bool = True) -> None:
    """Record a revision's outcome; a Ready one becomes current and (``collect``) the shards no revision
    needs go. Ready is recorded once the revision serves (``live.commit``), never before."""
    store.finish_revision(loaded.name, revision, ready=ready, reason=reason, timings=timings)
    if ready and collect:
        collect_old_shards(loaded, store)
