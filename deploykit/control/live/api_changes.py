"""The control API's changes of a supervisor's deployments: apply, rollback, delete and prune of
deployments handed over without a file, and the restore of every recorded one at start. Runs on the
control API's task threads (``Supervisor.tasks``) and on the restore's threads; each change of a name
takes that name's turn (``Turns``), so changes of one name never interleave and different names never
wait for each other.

Such deployments are recorded in the state store like any apply, so a supervisor without a path restores
them after a restart. A name a watched file owns refuses these changes naming the file, except an apply
of that very file, which reconciles it now; ``delete`` hands an API-owned name to a file that declares it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import DeploykitError
from ...spec.manifest import LoadedManifest
from ..admission import admit
from ..revisions.change import Change
from ..revisions.loading import recorded_manifest
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from .deployment import Deployment
from .roster import Roster

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ..revisions.state import Revision
    from .files import FollowedFiles

log = logging.getLogger(__name__)
StepSink = Callable[[str], None]


class ApiChanges:
    """The changes the control API asks of ``roster`` (``files``: the followed files, if any, which own
    some names and inherit deleted ones)."""

    def __init__(self, roster: Roster, files: FollowedFiles | None, *, rollback_owned: bool = False) -> None:
        self.roster = roster
        self.files = files
        self.rollback_owned = rollback_owned  # a git source's files: `deploykit rollback` is an emergency brake

    def restore(self) -> None:
        """Serve every deployment the state store records with a current revision: its recorded
        manifest, shards verified, loaded and health-checked (in parallel, one worker each)."""
        store = self.roster.store
        names = [n for n in store.names() if store.current(n) is not None]
        self.roster.served.begin_loading(names)
        if len(names) > 1:
            from ...model.hf import preload

            preload()
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(names))), thread_name_prefix="deploykit-restore") as pool:
            for name in names:
                pool.submit(self._restore_one, name)

    def _restore_one(self, name: str) -> None:
        roster = self.roster
        try:
            with roster.turns.exclusive(name, "restore"):
                current = roster.store.current(name)
                if current is None:
                    return
                dep = roster.create(name, self._claim_for_api(name), lambda: Deployment.from_loaded(
                    recorded_manifest(current), devices=roster.devices, store=roster.store, host=roster.host,
                    policy=roster.policy))
                if dep is not None:
                    log.info("restored %s (revision %s)", name, current.revision)
        except Exception as exc:
            roster.served.set_error(f"revision of {name}", f"{name}: could not be restored: {exc}")
            log.error("%s could not be restored: %s", name, exc, exc_info=not isinstance(exc, DeploykitError))
        finally:
            roster.served.end_loading(name)

    def _claim_for_api(self, name: str) -> Callable[[], bool]:
        """The claim ``create`` makes for a deployment of the control API: refused when a watched file
        owns the name (it may have claimed it while this change waited for its turn)."""
        owners = self.roster.owners

        def claim() -> bool:
            if owners.file_of(name) is not None:
                raise DeploykitError(f"{name!r} is owned by the watched file {owners.file_of(name)}: change "
                                     "that file, not the control API")
            owners.claim_for_api(name)
            return True
        return claim

    def apply_manifest(self, loaded: LoadedManifest, *, dry_run: bool = False, force: bool = False,
                       progress: ProgressSink | None = None, on_step: StepSink | None = None,
                       on_wait: StepSink | None = None, what: str = "apply",
                       devices: str | None = None) -> ApplyOutcome:
        """``Supervisor.apply_manifest``."""
        from ...errors import ManifestError

        roster, name = self.roster, loaded.name
        admit(loaded, roster.policy)  # first: an apply, a dry run, a rollback's recorded manifest alike
        if devices and not dry_run and devices != roster.devices:
            raise DeploykitError("--devices applies only to --dry-run when a server holds the deployments; "
                                 "the server plans with its own inventory (deploykit serve --devices)")
        change = Change(loaded, devices or roster.devices,  # checked once, planned once, whatever runs it
                        budget_cpu=roster.host.cpu_bytes if not devices else None)
        if what == "apply" and self._source_owned(name, loaded):  # drift from the source: OutOfSync, healable
            if dry_run:
                return self.dry_run(change, force=force)
            return self._roll_owned(name, loaded, change, force=force, progress=progress, on_step=on_step,
                                    on_wait=on_wait, what="apply")
        if roster.owners.check_api_change(name, what, Path(loaded.source) if what == "apply" else None):
            if dry_run:
                return self.dry_run(change, force=force)
            return self._reconcile_file(name, force=force, progress=progress, on_step=on_step, on_wait=on_wait)
        issues = change.issues()  # as a local apply validates first (a rollout would plan first)
        if issues:
            raise ManifestError(issues)
        if dry_run:
            return self.dry_run(change, force=force)
        self._supersede(name, loaded)  # a gated rollout of another manifest holds the turn: end it first
        with roster.turns.exclusive(name, what, on_wait):
            dep = roster.get(name)
            if dep is not None:
                result = dep.roll_to(loaded, force=force, progress=progress, on_step=on_step, change=change)
                assert result.outcome is not None
                return result.outcome
            try:
                dep = roster.create(name, self._claim_for_api(name), lambda: Deployment.from_loaded(
                    loaded, devices=roster.devices, store=roster.store, force=force, progress=progress,
                    on_step=on_step, host=roster.host, change=change, policy=roster.policy))
            except BaseException:
                self._release_if_unserved(name)
                raise
            if dep is None:
                raise DeploykitError(f"{name!r} was not deployed: the server is stopping")
            roster.served.set_error(f"revision of {name}", None)
            assert dep.last_outcome is not None
            return dep.last_outcome

    def _supersede(self, name: str, loaded: LoadedManifest) -> None:
        """End a gated rollout of ``name`` that rolls out another manifest, before waiting for its turn
        (the rollout holds it until its last step)."""
        dep = self.roster.get(name)
        if dep is not None:
            dep.supersede(loaded)

    def _release_if_unserved(self, name: str) -> None:
        """An API deployment that never served gives its name up (a file in conflict on it takes it)."""
        roster = self.roster
        if roster.get(name) is not None or not roster.owners.owned_by_api(name):
            return
        heir = roster.owners.release(name)
        if heir is not None and self.files is not None:
            self.files.add_later(heir, [name])

    def dry_run(self, change: Change, *, force: bool = False) -> ApplyOutcome:
        """What applying ``change`` would do here (planned against this server's inventory), changing nothing."""
        return apply(change.loaded, store=self.roster.store, change=change,
                     options=ApplyOptions(devices=change.devices, dry_run=True, force=force))

    def _reconcile_file(self, name: str, *, force: bool, progress: ProgressSink | None, on_step: StepSink | None,
                        on_wait: StepSink | None) -> ApplyOutcome:
        """``deploykit apply`` of the watched file that owns ``name``: what a save of it would do, now,
        raising the real reason when it fails. A save seen meanwhile makes no second revision (the
        deployment's reloads are serialised and an unchanged manifest is a no-op)."""
        file = self.roster.owners.file_of(name)
        assert file is not None and self.files is not None
        dep = self.roster.get(name)
        if dep is not None:  # a gated rollout of another manifest holds the turn: end it first
            dep.supersede_by_file()
        with self.roster.turns.exclusive(name, "apply", on_wait):
            dep = self.roster.get(name)
            if dep is None:  # the file's deployment never loaded: try again now
                dep = self.files.add_owned(file, name)
                if dep is None:
                    raise DeploykitError(f"{name!r} could not be deployed from {file}")
                self.files.set_error(file, None)
                assert dep.last_outcome is not None
                return dep.last_outcome
            result = dep.reconcile(force=force, progress=progress, on_step=on_step)
        assert result.outcome is not None
        return result.outcome

    def rollback(self, name: str, *, to_revision: int | None = None, progress: ProgressSink | None = None,
                 on_step: StepSink | None = None, on_wait: StepSink | None = None) -> tuple[Revision, ApplyOutcome]:
        """``Supervisor.rollback``."""
        from ..revisions.lifecycle import rollback_target

        aborted = self._abort_rollout(name, to_revision, on_step)
        if aborted is not None:
            return aborted
        if self.rollback_owned and self.roster.owners.file_of(name) is not None:
            return self._rollback_owned(name, to_revision, progress=progress, on_step=on_step, on_wait=on_wait)
        self.roster.owners.check_api_change(name, "roll back")
        target = rollback_target(self.roster.store, name, to_revision=to_revision)
        outcome = self.apply_manifest(recorded_manifest(target), force=True, progress=progress, on_step=on_step,
                                      on_wait=on_wait, what="rollback")
        return target, outcome

    def _source_owned(self, name: str, loaded: LoadedManifest) -> bool:
        """``name`` is owned by a git source's file (``rollback_owned``) and ``loaded`` is not that file."""
        owner = self.roster.owners.file_of(name) if self.rollback_owned else None
        return owner is not None and Path(loaded.source).resolve() != owner

    def _rollback_owned(self, name: str, to_revision: int | None, *, progress: ProgressSink | None,
                        on_step: StepSink | None, on_wait: StepSink | None) -> tuple[Revision, ApplyOutcome]:
        """Roll back a deployment a git source's file owns (``_roll_owned`` of the recorded revision)."""
        from ..revisions.lifecycle import rollback_target

        target = rollback_target(self.roster.store, name, to_revision=to_revision)
        loaded = recorded_manifest(target)
        admit(loaded, self.roster.policy)
        outcome = self._roll_owned(name, loaded, None, force=True, progress=progress, on_step=on_step,
                                   on_wait=on_wait, what="rollback")
        return target, outcome

    def _roll_owned(self, name: str, loaded: LoadedManifest, change: Change | None, *, force: bool,
                    progress: ProgressSink | None, on_step: StepSink | None, on_wait: StepSink | None,
                    what: str) -> ApplyOutcome:
        """An API apply or a rollback of a deployment a git source's file owns (an emergency brake, as
        ``kubectl apply`` on an Argo CD application): ``loaded`` serves while the file stays its owner, so
        the source shows OutOfSync with what differs, and its next change of the file, or its self-heal,
        applies the file again."""
        from ...errors import ManifestError

        if change is not None:
            issues = change.issues()
            if issues:
                raise ManifestError(issues)
        self._supersede(name, loaded)
        with self.roster.turns.exclusive(name, what, on_wait):
            dep = self.roster.get(name)
            if dep is None:
                raise DeploykitError(f"{name!r} does not serve here: nothing to {what}")
            result = dep.roll_to(loaded, force=force, progress=progress, on_step=on_step, change=change,
                                 adopt=False)
        log.warning("%s: a %s through the control API serves; %s still owns it: its next change (or the "
                    "source's self-heal) applies it again", name, what, self.roster.owners.file_of(name))
        assert result.outcome is not None
        return result.outcome

    def _abort_rollout(self, name: str, to_revision: int | None,
                       on_step: StepSink | None) -> tuple[Revision, ApplyOutcome] | None:
        """A rollback during a gated rollout ends it: the serving revision stays (the new one is recorded
        Failed). Returns what serves once it ended, or None when no gated rollout is in progress."""
        dep = self.roster.get(name)
        if dep is None or to_revision is not None or not dep.abort_rollout("rolled back by `deploykit rollback`"):
            return None
        if on_step is not None:
            on_step("abort the rollout")
        dep.wait_idle()  # the rollout ends on the deployment's worker, with its rollback
        current = self.roster.store.current(name)
        if current is None:
            raise DeploykitError(f"{name!r} has no Ready revision after its rollout was aborted")
        return current, ApplyOutcome(name, "unchanged", current.revision, current.plan)

    def delete(self, name: str, *, keep_shards: bool = False, reason: str = "deleted",
               on_wait: StepSink | None = None) -> None:
        """``Supervisor.delete``."""
        from ..revisions.lifecycle import delete

        roster = self.roster
        roster.owners.check_api_change(name, "delete")
        dep = roster.get(name)
        if dep is not None:  # a gated rollout holds the turn until its last step: end it first
            dep.abort_rollout("the deployment is being deleted")
        with roster.turns.exclusive(name, "delete", on_wait):
            dep = roster.served.pop(name)
            heir = roster.owners.release(name)
            if dep is None and name not in roster.store.names():
                known = ", ".join(roster.store.names()) or "none"
                raise DeploykitError(f"no deployment named {name!r} (known: {known})")
            if dep is not None:
                dep.close()
            roster.forget(name)
            if name in roster.store.names():
                delete(roster.store, name, keep_shards=keep_shards, reason=reason)
            log.info("deleted %s", name)
        if heir is not None and self.files is not None:  # a watched file declares the name: it owns it now
            log.info("%s now owns %s", heir, name)
            self.files.add_later(heir, [name])

    def prune_directory(self, directory: Path, *, keep: set[str]) -> list[str]:
        """``Supervisor.prune_directory``."""
        pruned = []
        store = self.roster.store
        for name in store.names():
            manifest = store.deployment_manifest(name) or ""
            if (name not in keep and Path(manifest).parent == Path(directory).resolve()
                    and self.roster.owners.file_of(name) is None):
                self.delete(name, reason="manifest removed; deployment pruned")
                pruned.append(name)
        return pruned
