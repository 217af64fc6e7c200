"""The deployments of one manifest file or directory, kept in step with the files.

Each deployment reloads on its own worker (``Deployment.request_reload``): a slow reload of one (a
70B reshard) never delays another's. At start, every deployment a file declares is known before any
loads, so readiness can say which are still loading.

Deployments can also be handed over without a file (``apply_manifest``, ``rollback``, ``delete``: the
control API of ``deploykit serve``). Those are recorded in the state store like any apply, and a
supervisor without a path restores every recorded deployment at start (``restore``). One owner per
name, a watched file or the API (``ownership.Owners``): a file's name refuses changes through the API
naming the file, except an apply of that very file, which reconciles it now; a file that declares a
name the API deployed is an error on that name until ``delete`` hands the name to the file. Changes to
one name are serialised (``on_wait`` says what a change waits for); different names never wait for
each other.

Readiness means every deployment can serve: a deployment whose newest manifest is broken but whose
last good generation serves is ready (the pending error shows in ``statuses()``, ``deploykit status``
and a metric); one still loading, or one that never loaded, is not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import DeploykitError
from ...spec.manifest import LoadedManifest, load_manifests, manifest_files
from ..revisions.change import Change
from .deployment import Deployment
from ..revisions.loading import recorded_manifest
from .ownership import Owners
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from .status import served_status
from ..revisions.state import StateStore
from ...threads import ThreadGroup
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
        self.deployments: dict[str, Deployment] = {}
        self.owners = Owners()
        self._errors: dict[str, str] = {}  # manifest file -> why it (or a deployment in it) is not serving
        self.loading: set[str] = set()  # names declared by a file, not yet serving
        self._lock = threading.Lock()  # guards deployments, _errors and loading
        self._changed = threading.Condition(self._lock)  # a deployment began serving or stopped loading
        self._closing = False
        self.close_timeout = 120.0  # how long close waits for loads under way
        self._starting = False
        self._started = threading.Event()  # start() returned
        self._adds = ThreadGroup()  # deployments added after start (new files, a deleted name's heir)
        self.tasks = ThreadGroup()  # changes asked through the control API, each on a thread of its own
        self._watcher: ManifestWatcher | None = None
        self._name_locks: dict[str, threading.Lock] = {}
        self._busy: dict[str, str] = {}  # name -> the change running for it now
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
        with self._lock:
            self.loading.update(name for _, names in declared for name in names)
        if len(files) > 1:
            from ...model.hf import preload

            preload()  # before the loads run in parallel
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(files))), thread_name_prefix="deploykit-load") as pool:
            for file, names in declared:
                pool.submit(self._add, file, names)
        self._watcher = ManifestWatcher([self.path], self._on_change, debounce=self.debounce)
        self._watcher.start()

    def problems(self) -> dict[str, str]:
        """manifest file -> why it (or a deployment it declares) does not serve."""
        with self._lock:
            return dict(self._errors)

    def _set_error(self, file: Path, error: str | None) -> None:
        with self._lock:
            if error is None:
                self._errors.pop(str(file), None)
            else:
                self._errors[str(file)] = error

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
        try:
            claim = self.owners.claim_for_file(name, file)
            if claim.conflict is not None:
                log.error("%s", claim.conflict)
                self._show_conflict(name)
            if not claim.ok or self.get(name) is not None:
                return None
            if self._closing:
                return None
            dep = self._hold(name, Deployment.from_manifest(file, name=name, devices=self.devices, store=self.store,
                                                            host=self.host))
        finally:
            with self._lock:
                self.loading.discard(name)
                self._changed.notify_all()
        log.info("%s: serving %s (generation %d)", file, name, dep.generation)
        return dep

    def _hold(self, name: str, dep: Deployment) -> Deployment:
        """Serve ``dep`` as ``name`` (before it stops loading: a reader always finds it in one of the two
        lists); one that finished loading while the supervisor closes is closed instead."""
        with self._changed:
            closing = self._closing
            if not closing:
                self.deployments[name] = dep
                self._changed.notify_all()
        if closing:
            dep.close()
            raise DeploykitError(f"{name!r} loaded while the server was stopping; not served")
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
                with self._lock:
                    self.loading.update(unloaded)
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

        with self._lock:
            dep = self.deployments.pop(name, None)
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
        with self._lock:
            self.loading.update(names)
        if len(names) > 1:
            from ...model.hf import preload

            preload()
        with ThreadPoolExecutor(max_workers=max(1, min(4, len(names))), thread_name_prefix="deploykit-restore") as pool:
            for name in names:
                pool.submit(self._restore_one, name)

    def _restore_one(self, name: str) -> None:
        try:
            with self._exclusive(name, "restore"):
                current = self.store.current(name)
                if current is None or self.get(name) is not None or self._closing:
                    return
                dep = Deployment.from_loaded(recorded_manifest(current), devices=self.devices, store=self.store,
                                             host=self.host)
                self.owners.claim_for_api(name)
                self._hold(name, dep)
                log.info("restored %s (revision %s)", name, current.revision)
        except Exception as exc:
            with self._lock:
                self._errors[f"revision of {name}"] = f"{name}: could not be restored: {exc}"
            log.exception("%s could not be restored", name)
        finally:
            with self._lock:
                self.loading.discard(name)
                self._changed.notify_all()

    def owner(self, name: str) -> Path | None:
        """The watched file that owns ``name``, if any (it alone may change the deployment)."""
        return self.owners.file_of(name)

    @contextmanager
    def _exclusive(self, name: str, what: str, on_wait: StepSink | None = None) -> Iterator[None]:
        """One change of ``name`` at a time; ``on_wait`` hears what a change waits for, and for how long."""
        with self._lock:
            lock = self._name_locks.setdefault(name, threading.Lock())
        if not lock.acquire(blocking=False):
            busy = self._busy.get(name, "another change")
            started = time.monotonic()
            if on_wait is not None:
                on_wait(f"waiting for the {busy} to finish")
            lock.acquire()
            if on_wait is not None:
                on_wait(f"waited {time.monotonic() - started:.1f}s for the {busy}")
        self._busy[name] = f"{what} of {name!r} (started {time.strftime('%H:%M:%S')})"
        try:
            yield
        finally:
            self._busy.pop(name, None)
            lock.release()

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
        with self._exclusive(name, what, on_wait):
            dep = self.get(name)
            if dep is not None:
                result = dep.roll_to(loaded, force=force, progress=progress, on_step=on_step, change=change)
                assert result.outcome is not None
                return result.outcome
            with self._lock:
                self.loading.add(name)
            try:
                dep = Deployment.from_loaded(loaded, devices=self.devices, store=self.store, force=force,
                                             progress=progress, on_step=on_step, host=self.host, change=change)
                self.owners.claim_for_api(name)
                self._hold(name, dep)
                with self._lock:
                    self._errors.pop(f"revision of {name}", None)
            finally:
                with self._lock:
                    self.loading.discard(name)
                    self._changed.notify_all()
            assert dep.last_outcome is not None
            return dep.last_outcome

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
        with self._exclusive(name, "apply", on_wait):
            dep = self.get(name)
            if dep is None:  # the file's deployment never loaded: try again now
                with self._lock:
                    self.loading.add(name)
                dep = self._add_one(file, name)
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

        self.owners.check_api_change(name, "roll back")
        target = rollback_target(self.store, name, to_revision=to_revision)
        outcome = self.apply_manifest(recorded_manifest(target), force=True, progress=progress, on_step=on_step,
                                      on_wait=on_wait, what="rollback")
        return target, outcome

    def delete(self, name: str, *, keep_shards: bool = False, reason: str = "deleted",
               on_wait: StepSink | None = None) -> None:
        """Stop serving ``name`` (running requests drain), free its memory, forget it in the store and
        remove its shards unless ``keep_shards``."""
        from ..revisions.lifecycle import delete

        self.owners.check_api_change(name, "delete")
        with self._exclusive(name, "delete", on_wait):
            with self._lock:
                dep = self.deployments.pop(name, None)
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
            with self._lock:
                self.loading.add(name)
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
        with self._lock:
            return self.deployments.get(name)

    def loading_names(self) -> list[str]:
        """Names declared by a file or applied, still loading for the first time (never one that serves)."""
        with self._lock:
            return sorted(self.loading - self.deployments.keys())

    def items(self) -> list[tuple[str, Deployment]]:
        with self._lock:
            return list(self.deployments.items())

    def wait_served(self, name: str, timeout: float) -> Deployment | None:
        """The deployment ``name`` once it serves: at once if it does, after its first load (or restore)
        if it is loading, None if that load failed, the server is closing, or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while name not in self.deployments and name in self.loading and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            return self.deployments.get(name)

    def why_not_served(self, name: str) -> str | None:
        """Why a declared ``name`` does not serve (its load failed), if the supervisor knows."""
        with self._lock:
            if self._closing:
                return "the server is stopping"
            return next((e for e in self._errors.values() if e.startswith(f"{name}: ")), None)

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
        not_ready = [n for n, d in items if not d.state().serving]
        not_ready += [f"{n}: loading" for n in self.loading_names()]
        not_ready += [f"{f}: {e}" for f, e in self._unserved_errors(items)]
        return (not not_ready and bool(items)), not_ready

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()  # requests waiting for a load are answered: the server is stopping
        if self._watcher is not None:
            self._watcher.stop()
        if self._starting:
            self._started.wait(self.close_timeout)  # the first loads end first (each loaded late is closed)
        left = self._adds.join(self.close_timeout) + self.tasks.join(self.close_timeout)  # loads under way end first (one loaded late is closed)
        if left:
            log.warning("still loading after %gs: %s", self.close_timeout, ", ".join(left))
        for _, dep in self.items():
            dep.close()
        if self.host is not None:
            self.host.stop()
