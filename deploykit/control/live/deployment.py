"""``Deployment``: a live model inside a long-running Python process, swapped atomically on reload.

    dep = Deployment.from_manifest("manifests/minilm.yaml", watch=True)
    with dep.acquire() as model:        # pins the current generation for the duration
        model(**inputs)
    dep.generation, dep.status()
    dep.close()

A thin facade over a ``GenerationPool`` (pin, swap, drain, free, leak guard), its change runner
(``changes.ChangeRunner``: starts, reloads, rollouts incl. canary, loads on demand, close) and a
``ManifestWatcher``. Each successful (re)load makes a new generation; a caller that acquired generation N
keeps it until its ``with`` block ends.

Which thread runs a line: the methods here run on the caller's thread (a request, the control API, the
watcher, the library's caller) and only ask; every start, reload, apply, rollback, load on demand, unload
and close runs on the deployment's ``ChangeWorker`` thread, in ``changes``, which alone moves its typed
``State`` (``machine``) and what the pool has loaded. ``state()`` reads the pool and that state as one
snapshot (``status.LiveStatus``). The in-process calls (``acquire``, ``generate``, ``chat``, ``embed``)
live in ``embedded``; the reload records and timing in ``reloads``.

A reload that fails at any step (bad manifest, missing file, plan infeasible, load error, failed
health check) leaves the serving generation untouched; the error appears in ``status()`` (with the
manifest's file:line where it applies), in the state store (so ``deploykit status`` shows it too) and
in its events. A later reload that succeeds, or finds nothing to change, clears it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ApplyError, DeploykitError
from ...spec.manifest import LoadedManifest, manifest_named
from ..admission import Policy
from ..budget.host import Host
from ..revisions.change import Change
from ..revisions.reconciler import ApplyOutcome
from ..revisions.state import StateStore, open_store
from .canary import CanaryProgress
from .changes import ChangeRunner
from .embedded import EmbeddedApi
from .machine import Event, State, Trigger
from .on_demand import Loads
from .pool import Generation, GenerationPool, NotLoaded
from .reloads import ReloadLog, ReloadRecord
from .rollout import RolloutResult
from .status import LiveStatus, live_status
from .worker import ChangeWorker

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from .watcher import ManifestWatcher

log = logging.getLogger(__name__)
DEFAULT_ACQUIRE_TIMEOUT = 300.0  # seconds acquire() waits while a recreate rollout reloads
StepSink = Callable[[str], None] | None


class Deployment(EmbeddedApi):
    """A deployed model held by this process. Thread-safe. See the module docstring."""

    def __init__(self, manifest_path: Path, *, name: str | None = None, devices: str | None = None,
                 store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                 host: Host | None = None, policy: Policy | None = None) -> None:
        self._wanted_name = name
        self.devices = devices
        self.store = store or open_store()
        self.acquire_timeout = acquire_timeout
        self._own_host = host is None  # without one, this deployment's own unlimited host (``close`` stops it)
        self.host = host or Host.unlimited()  # what it loads and unloads under (deploykit serve: the budget)
        self.name: str = name or ""
        self.pool = GenerationPool(self.name)
        self.loads = Loads(self.name, self.pool, self.store, devices, self.host, acquire_timeout,
                           policy=policy or Policy.unrestricted())  # a library's caller is the operator
        self._changes = ChangeRunner(self, self.loads, manifest_path=Path(manifest_path), wanted_name=name,
                                     named=self._named)  # what only the change thread runs and moves
        self._worker = ChangeWorker(name or self.manifest_path.stem)
        self.pool.owner = self._worker.submit  # what is loaded changes on this deployment's change thread
        self._watcher: ManifestWatcher | None = None
        self._loading_lock = threading.Lock()
        self._loading: Future[None] | None = None  # the load on demand asked of the worker (``servable``)

    def _named(self, name: str) -> None:
        self.name = name

    @classmethod
    def from_manifest(cls, path: str | Path, *, watch: bool = False, name: str | None = None,
                      devices: str | None = None, state_dir: str | Path | None = None,
                      store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                      debounce: float = 0.3, host: Host | None = None, policy: Policy | None = None) -> Deployment:
        """Apply the manifest at ``path`` and hold its model. ``watch=True`` reloads on changes. ``policy``: what
        each of its manifests is admitted under (``admission.admit``; default: anything). ``host``: the budget
        it loads under (default: its own ``Host.unlimited()``, which ``close`` stops; ``lifecycle.load`` and
        ``keep_alive`` work under either)."""
        store = store or open_store(Path(state_dir) if state_dir is not None else None)
        dep = cls(Path(path), name=name, devices=devices, store=store, acquire_timeout=acquire_timeout, host=host,
                  policy=policy)
        dep._start_or_close()
        if watch:
            try:
                dep.watch(debounce=debounce)
            except BaseException:  # nobody else holds it: its model and worker go with the error
                dep.close()
                raise
        return dep

    @classmethod
    def from_loaded(cls, loaded: LoadedManifest, *, devices: str | None = None, store: StateStore | None = None,
                    acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT, force: bool = False,
                    progress: ProgressSink | None = None, on_step: StepSink = None,
                    host: Host | None = None, change: Change | None = None,
                    policy: Policy | None = None) -> Deployment:
        """Apply an already loaded manifest (one sent over the control API, or a revision's recorded
        manifest after a restart) and hold its model. It has no file to watch: ``roll_to`` changes it."""
        dep = cls(Path(loaded.source), name=loaded.name, devices=devices, store=store,
                  acquire_timeout=acquire_timeout, host=host, policy=policy)
        dep._changes.given = loaded
        dep._start_or_close(force=force, progress=progress, on_step=on_step, change=change)
        return dep

    def _start_or_close(self, **options: Any) -> None:
        """``start``; a deployment that never started stops its worker (nobody else holds it)."""
        try:
            self.start(**options)
        except BaseException:
            self._worker.stop()
            self._stop_own_host()
            raise

    def start(self, *, force: bool = False, progress: ProgressSink | None = None, on_step: StepSink = None,
              change: Change | None = None) -> None:
        """Apply the manifest (or load the current revision, verified and health-checked). ``change``: the
        manifest already checked and planned by the caller (it is not planned again)."""
        self._worker.call(lambda: self._start(force=force, progress=progress, on_step=on_step, change=change))

    def _start(self, *, force: bool, progress: ProgressSink | None, on_step: StepSink,
               change: Change | None) -> None:
        if self._changes.start(force=force, progress=progress, on_step=on_step, change=change):
            self._worker.request(self.reload)  # the last promoted revision serves: the manifest rolls out
                                               # from it, through its gates

    @property
    def manifest_path(self) -> Path:
        """The file this deployment follows (the change thread reads it at each reload)."""
        return self._changes.manifest_path

    @manifest_path.setter
    def manifest_path(self, path: Path) -> None:
        self._changes.manifest_path = Path(path)

    # ---- serving --------------------------------------------------------------------------------

    @property
    def reload_log(self) -> ReloadLog:
        return self._changes.reload_log

    @property
    def rollout_progress(self) -> CanaryProgress | None:
        """The latest gated rollout (in progress, promoted or rolled back)."""
        return self._changes.rollout_progress

    def _publish(self, progress: CanaryProgress | None) -> None:
        """On the change thread: a gated rollout's progress (``Rollout``'s ``publish``), for readers."""
        self._changes.rollout_progress = progress  # one reference swapped: a reader sees a whole progress

    @property
    def generation(self) -> int:
        return self.pool.number

    @property
    def memory(self) -> list[tuple[int, int]]:
        return list(self.pool.memory)

    @property
    def pending(self) -> LoadedManifest | None:
        """A new revision of an on-demand deployment, applied by its next request."""
        return self.loads.pending

    @property
    def last_outcome(self) -> ApplyOutcome | None:
        return self.loads.last_outcome

    @property
    def reloads(self) -> tuple[ReloadRecord, ...]:
        """The latest reloads, oldest first (a copy: ``ReloadLog.records``)."""
        return self.reload_log.records

    @property
    def reload_count(self) -> int:
        return self.reload_log.count

    @property
    def reload_failures(self) -> int:
        return self.reload_log.failures

    def pin(self, timeout: float | None = None) -> Generation:
        """The current generation, pinned (``unpin`` it), waiting on this thread (the library's calls).
        An unloaded deployment (on demand, keep-alive) is loaded first, once the host has made room (a
        ``BudgetError`` naming the budget if it cannot in time; at once without a budget). The event loop
        waits without a thread: ``pool.try_pin`` and ``servable``."""
        import time

        gen = self.pool.try_pin()
        if gen is not None:
            return gen
        timeout = self.acquire_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self.wanted():
            while True:
                gen = self.pool.try_pin()
                if gen is not None:
                    return gen
                try:
                    self.servable().result(max(0.0, deadline - time.monotonic()))
                except NotLoaded:  # unloaded (keep-alive, pressure) since it looked: load it
                    continue
                except FutureTimeout:
                    raise ApplyError(self._not_ready(timeout)) from None

    def _not_ready(self, timeout: float) -> str:
        """Why ``pin`` found no generation in ``timeout``: a load (on demand) still runs, or a recreate
        holds none while its new generation loads."""
        if self.pool.unloaded:
            return f"deployment {self.name!r} is still loading after {timeout:g}s"
        return (f"deployment {self.name!r} has no model ready after {timeout:g}s "
                "(a recreate rollout is reloading it)")

    def wanted(self) -> AbstractContextManager[None]:
        """A request waits for this deployment (to load, then to pin it): it is busy meanwhile, so what
        loads for the request stays loaded until it is pinned."""
        return self.host.wanted(self.name)

    def servable(self) -> Future[None]:
        """A future that ends once a pin may succeed (then pin again: ``pool.try_pin``): a generation is
        current, or the load on demand this asks the change thread for (the deployment is unloaded) has
        ended, raising what it raised. A caller waits on it without holding the change thread or a thread
        of its own."""
        if not self.pool.unloaded:
            return self.pool.changed()
        with self._loading_lock:  # a burst of requests asks for one load
            if self._loading is None or self._loading.done():
                self._loading = self._worker.submit(self._load_for_request)
            return self._loading

    def _load_for_request(self) -> None:
        if self._changes.load_for_request():
            self._worker.post(self._changes.roll_pending)  # on the change thread, after this load

    def unpin(self, gen: Generation) -> None:
        self.pool.unpin(gen)

    # ---- reloading ------------------------------------------------------------------------------

    def on_reload(self, callback: Callable[[Deployment], None]) -> None:
        """Call ``callback(deployment)`` after every successful swap."""
        self._changes.callbacks.append(callback)

    def reload(self) -> bool:
        """Re-read the manifest and roll out what changed. True when a new generation serves.

        Never raises for a bad manifest or a failed rollout: the error goes to ``status()``.
        """
        try:
            return self._worker.call(self._changes.reload_now)
        except ApplyError:
            if self._changes.closed:
                return False
            raise

    def roll_to(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
                on_step: StepSink = None, change: Change | None = None, adopt: bool = True) -> RolloutResult:
        """Roll out ``loaded`` (a manifest handed over, e.g. by the control API) instead of re-reading
        the file; it becomes this deployment's manifest (unless ``adopt`` is False: the file stays it, and
        its next reload reads the file). Unlike ``reload`` it raises on failure (after recording it as a
        reload failure: the serving generation stays). ``change``: ``loaded`` already checked and planned
        by the caller."""
        self.supersede(loaded)
        return self._worker.call(lambda: self._changes.roll(loaded, force=force, progress=progress, on_step=on_step,
                                                    change=change, adopt=adopt))

    def reconcile(self, *, force: bool = False, progress: ProgressSink | None = None,
                  on_step: StepSink = None) -> RolloutResult:
        """Roll out the manifest file as it is now (what a save of it does) and raise the real reason
        when that fails; the serving generation stays. ``deploykit apply`` of a watched file."""
        self.supersede(self._file_manifest())
        return self._worker.call(lambda: self._changes.roll(None, force=force, progress=progress, on_step=on_step,
                                                    change=None))

    def set_conflict(self, message: str | None) -> None:
        """Show (or clear) an ownership conflict as this deployment's error (the supervisor's)."""
        self._worker.post(lambda: self._changes.cell.move(Event(Trigger.CONFLICT, error=message)))

    @property
    def rolling(self) -> bool:
        """A gated rollout (canary, or blue-green with gates) is in progress and may still be aborted."""
        return self._changes.abort.armed

    def wait_idle(self) -> None:
        """Return once the change in progress on the worker (if any) has ended."""
        self._worker.call(lambda: None)

    def abort_rollout(self, reason: str) -> bool:
        """End the gated rollout in progress at once (any thread; the worker does the rollback). True: it
        will not be promoted; False when none is in progress (or it is already being promoted)."""
        return self._changes.abort.abort(reason)

    def interrupt(self, reason: str) -> None:
        """The deployment is about to close (the server is stopping): end a gated rollout in progress, and
        any that would start, now, so that ``close`` does not wait behind a canary's step."""
        self._changes.abort.close(reason)

    def request_reload(self) -> None:
        """Reload on this deployment's worker (returns at once; bursts coalesce), so one deployment's
        slow reload never delays another's. A gated rollout of another manifest in progress ends first."""
        self.supersede(self._file_manifest())
        self._worker.request(self.reload)

    def _file_manifest(self) -> LoadedManifest | None:
        """The manifest file as it is now (None when it cannot be read: that change fails on the worker)."""
        if self._changes.given is not None:
            return None
        try:
            return manifest_named(self.manifest_path, self._wanted_name)
        except DeploykitError:
            return None

    def supersede(self, loaded: LoadedManifest | None) -> bool:
        """A change of ``loaded`` is asked for while a gated rollout of another manifest runs (loading its
        candidate, scoring, or in a step): end that rollout now (it would otherwise run out before the change
        could start). True when one was ended."""
        if loaded is None:
            return False
        return self._changes.abort.supersede(loaded.digest, "superseded by a newer change of the manifest")

    def supersede_by_file(self) -> bool:
        """``supersede`` with the manifest file as it is now (what ``reconcile`` will roll out)."""
        return self.supersede(self._file_manifest())

    def watch(self, *, debounce: float = 0.3) -> None:
        """Reload on the worker whenever the manifest's content changes."""
        from .watcher import ManifestWatcher

        if self._watcher is None:
            watcher = ManifestWatcher([self.manifest_path], lambda paths: self.request_reload(), debounce=debounce)
            watcher.start()
            self._watcher = watcher  # only a watcher that started is stopped by ``close``

    # ---- status and shutdown --------------------------------------------------------------------

    def state(self) -> LiveStatus:
        """The one snapshot of this deployment (phase, generation and revision read together, load state,
        budget, last error, reloads, memory, plan, canary progress) that every view formats: read it once
        per answer."""
        view = self.pool.view()  # first: a state read after it can only be newer
        return live_status(view, self._changes.cell.get(), name=self.name, host=self.host, manifest=self.manifest_path,
                           reloads=self.reload_log, rollout=self.rollout_progress)

    def status(self) -> dict[str, Any]:
        """``state()`` as a JSON object."""
        return self.state().to_dict()

    @property
    def phase_state(self) -> State:
        """The typed state the worker holds (``machine.State``)."""
        return self._changes.cell.get()

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching, let in-flight calls finish (up to ``timeout``), free the model, and join the
        worker."""
        self.interrupt("the deployment is closing")  # first: a canary's step must not hold the worker
        self._changes.closing.set()  # and neither must a load on demand waiting for room
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            self._worker.call(lambda: self._changes.close(timeout), timeout=2 * timeout)
        except ApplyError:  # closed already
            pass
        except TimeoutError:  # a load that cannot be interrupted still runs: the process may exit anyway
            log.warning("%s: the change in progress did not end within %gs of close", self.name, 2 * timeout)
        self._worker.stop(timeout)
        self._stop_own_host()

    def _stop_own_host(self) -> None:
        """Join the keep-alive thread of the unlimited host this deployment made (a given host's owner
        stops that one)."""
        if self._own_host:
            self.host.stop()

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
