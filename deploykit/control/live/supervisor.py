"""The deployments of one manifest file or directory, kept in step with the files.

Each deployment changes on its own worker: a slow reload of one never delays another's. What serves and
what is still loading is the ``ServedSet`` (a request for a loading name waits there).

Deployments can also be handed over without a file (``apply_manifest``, ``rollback``, ``delete``: the
control API of ``deploykit serve``). Those are recorded in the state store like any apply, and a
supervisor without a path restores every recorded deployment at start (``restore``). One owner per
name, a watched file or the API (``ownership.Owners``): a file's name refuses changes through the API
naming the file, except an apply of that very file, which reconciles it now; a file that declares a
name the API deployed is an error on that name until ``delete`` hands the name to the file. Changes to
one name are serialised (``turns``); different names never wait for each other.

Readiness means every deployment can serve: a deployment whose newest manifest is broken but whose
last good generation serves is ready (the pending error shows in ``statuses()``, ``deploykit status``
and a metric); one still loading, or one that never loaded, is not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import DeploykitError
from ...spec.manifest import LoadedManifest, load_manifests, manifest_files
from ...threads import ThreadGroup
from ..revisions.change import Change
from ..revisions.loading import recorded_manifest
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from ..revisions.state import StateStore
from .deployment import Deployment
from .ownership import Owners
from .served import ServedSet
from .status import not_ready as not_serving
from .status import served_status
from .turns import Turns
from .watcher import ManifestWatcher

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ..budget.host import Host
    from ..revisions.state import Revision

log = logging.getLogger(__name__)
StepSink = Callable[[str], None]


class Supervisor:
    """Holds the deployments of ``path`` (None: no files; the recorded deployments, restored at
    start) and follows the files."""

    def __init__(self, path: Path | None, *, store: StateStore, devices: str | None = None, prune: bool = False,
                 debounce: float = 0.3, host: Host | None = None) -> None:
        self.path = Path(path).resolve() if path is not None else None
        self.store = store
        self.devices = devices
        self.prune = prune
        self.debounce = debounce
        self.served = ServedSet()  # what serves, what is loading, and why a declared name does not serve
        self.owners = Owners()
        self.close_timeout = 120.0  # how long close waits for loads under way
        self._starting = False
        self._started = threading.Event()  # start() returned
        self._adds = ThreadGroup()  # deployments added after start (new files, a deleted name's heir)
        self.tasks = ThreadGroup()  # changes asked through the control API, each on a thread of its own
        self._watcher: ManifestWatcher | None = None
        self._turns = Turns()  # one change of a name at a time
        self.host = host  # the memory budget every deployment loads under (None: each plans alone)

    def manifest_files(self) -> list[Path]:
        if self.path is None:
            return []
        return [f for f in manifest_files(self.path) if f.exists()]

    def start(self) -> None:
        """Load every file's deployments (in parallel, one worker each), then follow the files.
        Without a path: restore every recorded deployment instead."""
        self._starting = True
        try:
            self._start()
        finally:
            self._started.set()

    def _start(self) -> None:
        if self.host is not None:
            self.host.start()
        if self.path is None:
            self.restore()
            return
        files = self.manifest_files()
        declared = [(file, self._names(file)) for file in files]
        self.served.begin_loading(name for _, names in declared for name in names)
        if len(files) > 1:
            from ...model.hf import preload

            preload()  # before the loads run in parallel
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(files))), thread_name_prefix="deploykit-load") as pool:
            for file, names in declared:
                pool.submit(self._add, file, names)
        self._watcher = ManifestWatcher([self.path], self._on_change, debounce=self.debounce)
        self._watcher.start()

    @property
    def deployments(self) -> dict[str, Deployment]:
        """The deployments that serve now (a copy)."""
        return dict(self.served.items())

    def problems(self) -> dict[str, str]:
        """manifest file -> why it (or a deployment it declares) does not serve."""
        return self.served.errors()

    def _set_error(self, file: Path, error: str | None) -> None:
        self.served.set_error(str(file), error)

    def _names(self, file: Path) -> list[str]:
        try:
            names = [m.name for m in load_manifests(file)]
        except DeploykitError as exc:
            self._set_error(file, str(exc))
            log.error("%s", exc)
            return []
        self._set_error(file, None)
        for name in self.owners.drop_conflicts(file, keep=set(names)):
            self._show_conflict(name)
        return names

    def _add(self, file: Path, names: list[str]) -> None:
        for name in names:
            try:
                self._add_one(file, name)
            except DeploykitError as exc:
                self._set_error(file, f"{name}: {exc}")
                log.error("%s: %s could not be deployed: %s", file, name, exc)
            except Exception as exc:  # a bug, or a library failing oddly: report it, keep the others
                self._set_error(file, f"{name}: internal error: {type(exc).__name__}: {exc}")
                log.exception("%s: %s could not be deployed", file, name)

    def _add_one(self, file: Path, name: str) -> Deployment | None:
        """Deploy ``name`` from ``file`` if the file owns it (None when it does not, or it serves already)."""
        with self._turns.exclusive(name, "load"):
            return self._add_owned(file, name)

    def _add_owned(self, file: Path, name: str) -> Deployment | None:
        """``_add_one`` with the name's turn held."""
        def claim() -> bool:
            found = self.owners.claim_for_file(name, file)
            if found.conflict is not None:
                log.error("%s", found.conflict)
                self._show_conflict(name)
            return found.ok

        dep = self._create(name, claim, lambda: Deployment.from_manifest(
            file, name=name, devices=self.devices, store=self.store, host=self.host))
        if dep is not None:
            log.info("%s: serving %s (generation %d)", file, name, dep.generation)
        return dep

    def _create(self, name: str, claim: Callable[[], bool], build: Callable[[], Deployment]) -> Deployment | None:
        """The one way a deployment comes to exist. The caller holds ``name``'s turn (``Turns``): ownership
        is claimed before anything loads (``claim``: False when another owner has it), nothing is built
        for a name that serves already, and what ``build`` made is held at once, so two live
        ``Deployment``s of one name cannot both exist. None when nothing was built."""
        try:
            if self.served.closing or not claim() or self.get(name) is not None:
                return None
            self.served.begin_loading([name])
            return self._hold(name, build())
        finally:
            self.served.end_loading(name)

    def _hold(self, name: str, dep: Deployment) -> Deployment:
        """Serve ``dep`` as ``name`` (before it stops loading: a reader always finds it in one of the two
        lists); one that finished loading while the supervisor closes is closed instead."""
        if not self.served.hold(name, dep):
            dep.close()
            raise DeploykitError(f"{name!r} loaded while the server was stopping, or another deployment of it "
                                 "serves; not served")
        return dep

    def _show_conflict(self, name: str) -> None:
        dep = self.get(name)
        if dep is not None:
            dep.set_conflict(self.owners.conflict_of(name))

    def _on_change(self, changed: list[Path]) -> None:
        for file in changed:
            owned = self.owners.names_of(file)
            if not file.exists():
                self._file_removed(file, owned)
                continue
            for name in owned:
                dep = self.get(name)
                if dep is not None:
                    dep.request_reload()
            new = [n for n in self._names(file) if self.get(n) is None or self.owners.owned_by_api(n)]
            if new:
                unloaded = [n for n in new if self.get(n) is None]
                self.served.begin_loading(unloaded)
                self._adds.start(self._add, file, new, name="deploykit-add")

    def _file_removed(self, file: Path, owned: list[str]) -> None:
        self._set_error(file, None)
        for name in self.owners.drop_conflicts(file, keep=set()):
            self._show_conflict(name)
        for name in owned:
            if self.prune:
                self._remove(name)
            else:
                log.warning("%s was removed; %s keeps serving (use --prune to remove it)", file, name)

    def _remove(self, name: str) -> None:
        from ..revisions.lifecycle import delete

        dep = self.served.pop(name)
        self.owners.release(name)
        if dep is not None:
            dep.close()
        if self.host is not None:
            self.host.forget(name)
        delete(self.store, name, reason="manifest removed; deployment pruned")
        log.info("pruned %s", name)

    # ---- the control API: deployments handed over without a file ---------------------------------

    def restore(self) -> None:
        """Serve every deployment the state store records with a current revision: its recorded
        manifest, shards verified, loaded and health-checked (in parallel, one worker each)."""
        names = [n for n in self.store.names() if self.store.current(n) is not None]
        self.served.begin_loading(names)
        if len(names) > 1:
            from ...model.hf import preload

            preload()
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(names))), thread_name_prefix="deploykit-restore") as pool:
            for name in names:
                pool.submit(self._restore_one, name)

    def _restore_one(self, name: str) -> None:
        try:
            with self._turns.exclusive(name, "restore"):
                current = self.store.current(name)
                if current is None:
                    return
                dep = self._create(name, self._claim_for_api(name), lambda: Deployment.from_loaded(
                    recorded_manifest(current), devices=self.devices, store=self.store, host=self.host))
                if dep is not None:
                    log.info("restored %s (revision %s)", name, current.revision)
        except Exception as exc:
            self.served.set_error(f"revision of {name}", f"{name}: could not be restored: {exc}")
            log.exception("%s could not be restored", name)
        finally:
            self.served.end_loading(name)

    def _claim_for_api(self, name: str) -> Callable[[], bool]:
        """The claim ``_create`` makes for a deployment of the control API: refused when a watched file
        owns the name (it may have claimed it while this change waited for its turn)."""
        def claim() -> bool:
            if self.owners.file_of(name) is not None:
                raise DeploykitError(f"{name!r} is owned by the watched file {self.owners.file_of(name)}: change "
                                     "that file, not the control API")
            self.owners.claim_for_api(name)
            return True
        return claim

    def owner(self, name: str) -> Path | None:
        """The watched file that owns ``name``, if any (it alone may change the deployment)."""
        return self.owners.file_of(name)

    def apply_manifest(self, loaded: LoadedManifest, *, dry_run: bool = False, force: bool = False,
                       progress: ProgressSink | None = None, on_step: StepSink | None = None,
                       on_wait: StepSink | None = None, what: str = "apply",
                       devices: str | None = None) -> ApplyOutcome:
        """Make ``loaded`` what serves under its name: a new deployment, or a rollout of the one that
        serves (blue-green/recreate as its manifest says). Recorded in the state store, so a restart
        without a path restores it. Raises what the apply raised; what served keeps serving.
        ``dry_run`` says what it would do (planned against ``devices`` if given) and changes nothing."""
        from ...errors import ManifestError

        name = loaded.name
        if devices and not dry_run and devices != self.devices:
            raise DeploykitError("--devices applies only to --dry-run when a server holds the deployments; "
                                 "the server plans with its own inventory (deploykit serve --devices)")
        change = Change(loaded, devices or self.devices)  # checked once, planned once, whatever runs it
        if self.owners.check_api_change(name, what, Path(loaded.source) if what == "apply" else None):
            if dry_run:
                return self.dry_run(change, force=force)
            return self._reconcile_file(name, force=force, progress=progress, on_step=on_step, on_wait=on_wait)
        issues = change.issues()  # as a local apply validates first (a rollout would plan first)
        if issues:
            raise ManifestError(issues)
        if dry_run:
            return self.dry_run(change, force=force)
        with self._turns.exclusive(name, what, on_wait):
            dep = self.get(name)
            if dep is not None:
                result = dep.roll_to(loaded, force=force, progress=progress, on_step=on_step, change=change)
                assert result.outcome is not None
                return result.outcome
            try:
                dep = self._create(name, self._claim_for_api(name), lambda: Deployment.from_loaded(
                    loaded, devices=self.devices, store=self.store, force=force, progress=progress,
                    on_step=on_step, host=self.host, change=change))
            except BaseException:
                self._release_if_unserved(name)
                raise
            if dep is None:
                raise DeploykitError(f"{name!r} was not deployed: the server is stopping")
            self.served.set_error(f"revision of {name}", None)
            assert dep.last_outcome is not None
            return dep.last_outcome

    def _release_if_unserved(self, name: str) -> None:
        """An API deployment that never served gives its name up (a file in conflict on it takes it)."""
        if self.get(name) is not None or not self.owners.owned_by_api(name):
            return
        heir = self.owners.release(name)
        if heir is not None:
            self.served.begin_loading([name])
            self._adds.start(self._add, heir, [name], name="deploykit-add")

    def dry_run(self, change: Change, *, force: bool = False) -> ApplyOutcome:
        """What applying ``change`` would do here (planned against this server's inventory), changing nothing."""
        return apply(change.loaded, store=self.store, change=change,
                     options=ApplyOptions(devices=change.devices, dry_run=True, force=force))

    def _reconcile_file(self, name: str, *, force: bool, progress: ProgressSink | None, on_step: StepSink | None,
                        on_wait: StepSink | None) -> ApplyOutcome:
        """``deploykit apply`` of the watched file that owns ``name``: what a save of it would do, now,
        raising the real reason when it fails. A save seen meanwhile makes no second revision (the
        deployment's reloads are serialised and an unchanged manifest is a no-op)."""
        file = self.owners.file_of(name)
        assert file is not None
        with self._turns.exclusive(name, "apply", on_wait):
            dep = self.get(name)
            if dep is None:  # the file's deployment never loaded: try again now
                dep = self._add_owned(file, name)
                if dep is None:
                    raise DeploykitError(f"{name!r} could not be deployed from {file}")
                self._set_error(file, None)
                assert dep.last_outcome is not None
                return dep.last_outcome
            result = dep.reconcile(force=force, progress=progress, on_step=on_step)
        assert result.outcome is not None
        return result.outcome

    def rollback(self, name: str, *, to_revision: int | None = None, progress: ProgressSink | None = None,
                 on_step: StepSink | None = None, on_wait: StepSink | None = None) -> tuple[Revision, ApplyOutcome]:
        """Re-apply a recorded revision's manifest (``lifecycle.rollback_target`` chooses) and serve it."""
        from ..revisions.lifecycle import rollback_target

        aborted = self._abort_rollout(name, to_revision, on_step)
        if aborted is not None:
            return aborted
        self.owners.check_api_change(name, "roll back")
        target = rollback_target(self.store, name, to_revision=to_revision)
        outcome = self.apply_manifest(recorded_manifest(target), force=True, progress=progress, on_step=on_step,
                                      on_wait=on_wait, what="rollback")
        return target, outcome

    def _abort_rollout(self, name: str, to_revision: int | None,
                       on_step: StepSink | None) -> tuple[Revision, ApplyOutcome] | None:
        """A rollback during a gated rollout ends it: the serving revision stays (the new one is recorded
        Failed). Returns what serves once it ended, or None when no gated rollout is in progress."""
        dep = self.get(name)
        if dep is None or to_revision is not None or not dep.abort_rollout("rolled back by `deploykit rollback`"):
            return None
        if on_step is not None:
            on_step("abort the rollout")
        dep.wait_idle()  # the rollout ends on the deployment's worker, with its rollback
        current = self.store.current(name)
        if current is None:
            raise DeploykitError(f"{name!r} has no Ready revision after its rollout was aborted")
        return current, ApplyOutcome(name, "unchanged", current.revision, current.plan)

    def delete(self, name: str, *, keep_shards: bool = False, reason: str = "deleted",
               on_wait: StepSink | None = None) -> None:
        """Stop serving ``name`` (running requests drain), free its memory, forget it in the store and
        remove its shards unless ``keep_shards``."""
        from ..revisions.lifecycle import delete

        self.owners.check_api_change(name, "delete")
        with self._turns.exclusive(name, "delete", on_wait):
            dep = self.served.pop(name)
            heir = self.owners.release(name)
            if dep is None and name not in self.store.names():
                raise DeploykitError(f"no deployment named {name!r} (known: {', '.join(self.store.names()) or 'none'})")
            if dep is not None:
                dep.close()
            if self.host is not None:
                self.host.forget(name)
            if name in self.store.names():
                delete(self.store, name, keep_shards=keep_shards, reason=reason)
            log.info("deleted %s", name)
        if heir is not None:  # a watched file declares the name: it owns it now and serves it
            log.info("%s now owns %s", heir, name)
            self.served.begin_loading([name])
            self._adds.start(self._add, heir, [name], name="deploykit-add")

    def prune_directory(self, directory: Path, *, keep: set[str]) -> list[str]:
        """Delete the deployments whose manifests lived in ``directory`` and are not in ``keep`` (names
        a watched file owns are left to the watcher)."""
        pruned = []
        for name in self.store.names():
            manifest = self.store.deployment_manifest(name) or ""
            if name not in keep and Path(manifest).parent == Path(directory).resolve() and self.owner(name) is None:
                self.delete(name, reason="manifest removed; deployment pruned")
                pruned.append(name)
        return pruned

    def get(self, name: str) -> Deployment | None:
        return self.served.get(name)

    def loading_names(self) -> list[str]:
        """Names declared by a file or applied, still loading for the first time (never one that serves)."""
        return self.served.loading_names()

    def items(self) -> list[tuple[str, Deployment]]:
        return self.served.items()

    def when_served(self, name: str) -> Future[None]:
        return self.served.when_served(name)

    def why_not_served(self, name: str) -> str | None:
        return self.served.why_not_served(name)

    def statuses(self) -> list[dict[str, Any]]:
        out = [served_status(self.store, name, dep.state()) for name, dep in self.items()]
        out += [{"name": n, "phase": "Progressing", "serving_revision": None, "last_error": None}
                for n in self.loading_names()]
        out += [{"name": None, "manifest": f, "phase": "Failed", "last_error": e}
                for f, e in self._unserved_errors(self.items())]
        return out

    def _unserved_errors(self, items: list[tuple[str, Deployment]]) -> list[tuple[str, str]]:
        """Errors of files none of whose deployments serve (a served one shows its own error)."""
        served = {self.owners.file_of(n) for n, _ in items}
        return [(f, e) for f, e in self.problems().items() if Path(f) not in served]

    def ready(self) -> tuple[bool, list[str]]:
        """(every deployment can serve, what cannot)."""
        items = self.items()
        not_ready = not_serving([d.state() for _, d in items])
        not_ready += [f"{n}: loading" for n in self.loading_names()]
        not_ready += [f"{f}: {e}" for f, e in self._unserved_errors(items)]
        return (not not_ready and bool(items)), not_ready

    def interrupt(self, reason: str = "the server is stopping") -> None:
        """The server is stopping (SIGTERM): every gated rollout in progress ends now, and none starts, so
        that nothing waits behind a canary's step (any thread; ``close`` follows)."""
        for _, dep in self.items():
            dep.interrupt(reason)

    def close(self) -> None:
        self.served.close()  # requests waiting for a load are answered: the server is stopping
        self.interrupt()  # first: an apply waiting on a canary's step ends, so its task can be joined
        if self._watcher is not None:
            self._watcher.stop()
        if self._starting:
            self._started.wait(self.close_timeout)  # the first loads end first (each loaded late is closed)
        left = self._adds.join(self.close_timeout) + self.tasks.join(self.close_timeout)  # loads under way end first (one loaded late is closed)
        if left:
            log.warning("still loading after %gs: %s", self.close_timeout, ", ".join(left))
        for _, dep in self.items():
            dep.interrupt("the server is stopping")  # loaded meanwhile: the same reason
            dep.close()
        if self.host is not None:
            self.host.stop()
