"""``Deployment``: a live model inside a long-running Python process, swapped atomically on reload.

    dep = Deployment.from_manifest("manifests/minilm.yaml", watch=True)
    with dep.acquire() as model:        # pins the current generation for the duration
        model(**inputs)
    dep.generation, dep.status()
    dep.close()

A thin facade over a ``GenerationPool`` (pin, swap, drain, free, leak guard), a ``Rollout`` (blue-green,
recreate, auto, canary: ``rollout_progress`` shows a gated one, ``abort_rollout`` ends it), its ``Loads`` (the first load, and those on demand under a host) and a
``ManifestWatcher``. Each successful (re)load makes a new generation; a caller that acquired generation N
keeps it until its ``with`` block ends.

One owner changes it: every start, reload, apply, rollback, load on demand and close runs on its
``ChangeWorker`` thread, which alone moves its typed ``State`` (``machine``); ``state()`` reads it with
the pool as one ``LiveStatus`` (``report``). The in-process calls (``acquire``, ``generate``, ``chat``,
``embed``) live in ``embedded``; the reload records and timing in ``reloads``.

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
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ApplyError, DeploykitError
from ...spec.manifest import LoadedManifest, manifest_named
from ..budget import BudgetError
from ..revisions.change import Change
from ..revisions.reconciler import ApplyOutcome
from ..revisions.state import StateStore, open_store
from .budgeting import roll_budgeted, start_budgeted
from .canary import AbortSignal, CanaryProgress
from .embedded import EmbeddedApi
from .machine import Event, State, StateCell, Trigger
from .on_demand import Loads
from .pool import Generation, GenerationPool, NotLoaded
from .reloads import ReloadClock, ReloadLog, ReloadRecord, describe, store_failure
from .rollout import Rollout, RolloutResult
from .status import LiveStatus, live_status
from .worker import ChangeWorker

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ..budget.host import Host
    from .watcher import ManifestWatcher

log = logging.getLogger(__name__)
DEFAULT_ACQUIRE_TIMEOUT = 300.0  # seconds acquire() waits while a recreate rollout reloads
StepSink = Callable[[str], None] | None


class Deployment(EmbeddedApi):
    """A deployed model held by this process. Thread-safe. See the module docstring."""

    def __init__(self, manifest_path: Path, *, name: str | None = None, devices: str | None = None,
                 store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                 host: Host | None = None) -> None:
        self.manifest_path = Path(manifest_path)
        self._wanted_name = name
        self.devices = devices
        self.store = store or open_store()
        self.acquire_timeout = acquire_timeout
        self.host = host  # the budget this deployment loads and unloads under (deploykit serve), if any
        self.name: str = name or ""
        self.pool = GenerationPool(self.name)
        self.loads = Loads(self.name, self.pool, self.store, devices, host, acquire_timeout)
        self._cell = StateCell()  # moved only on the worker
        self._worker = ChangeWorker(name or self.manifest_path.stem)
        self.pool.owner = self._worker.submit  # what is loaded changes on this deployment's change thread
        self._callbacks: list[Callable[[Deployment], None]] = []
        self.reload_log = ReloadLog()
        self._watcher: ManifestWatcher | None = None
        self._closed = False
        self._given: LoadedManifest | None = None  # a manifest handed over (control API), not a file
        self._abort = AbortSignal()  # a rollback ends a gated rollout in progress with it
        self._closing = threading.Event()  # close() began: a load waiting for room stops waiting
        self._loading_lock = threading.Lock()
        self._loading: Future[None] | None = None  # the load on demand asked of the worker (``servable``)
        self.rollout_progress: CanaryProgress | None = None  # the latest gated rollout (in progress or ended)

    @classmethod
    def from_manifest(cls, path: str | Path, *, watch: bool = False, name: str | None = None,
                      devices: str | None = None, state_dir: str | Path | None = None,
                      store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                      debounce: float = 0.3, host: Host | None = None) -> Deployment:
        """Apply the manifest at ``path`` and hold its model. ``watch=True`` reloads on changes."""
        store = store or open_store(Path(state_dir) if state_dir is not None else None)
        dep = cls(Path(path), name=name, devices=devices, store=store, acquire_timeout=acquire_timeout, host=host)
        dep._start_or_close()
        if watch:
            dep.watch(debounce=debounce)
        return dep

    @classmethod
    def from_loaded(cls, loaded: LoadedManifest, *, devices: str | None = None, store: StateStore | None = None,
                    acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT, force: bool = False,
                    progress: ProgressSink | None = None, on_step: StepSink = None,
                    host: Host | None = None, change: Change | None = None) -> Deployment:
        """Apply an already loaded manifest (one sent over the control API, or a revision's recorded
        manifest after a restart) and hold its model. It has no file to watch: ``roll_to`` changes it."""
        dep = cls(Path(loaded.source), name=loaded.name, devices=devices, store=store,
                  acquire_timeout=acquire_timeout, host=host)
        dep._given = loaded
        dep._start_or_close(force=force, progress=progress, on_step=on_step, change=change)
        return dep

    def _start_or_close(self, **options: Any) -> None:
        """``start``; a deployment that never started stops its worker (nobody else holds it)."""
        try:
            self.start(**options)
        except BaseException:
            self._worker.stop()
            raise

    def _manifest(self) -> LoadedManifest:
        return self._given if self._given is not None else manifest_named(self.manifest_path, self._wanted_name)

    def start(self, *, force: bool = False, progress: ProgressSink | None = None, on_step: StepSink = None,
              change: Change | None = None) -> None:
        """Apply the manifest (or load the current revision, verified and health-checked). ``change``: the
        manifest already checked and planned by the caller (it is not planned again)."""
        self._worker.call(lambda: self._start(force=force, progress=progress, on_step=on_step, change=change))

    def _start(self, *, force: bool, progress: ProgressSink | None, on_step: StepSink,
               change: Change | None) -> None:
        loaded = change.loaded if change is not None else self._manifest()
        change = change if change is not None else Change(loaded, self.devices)
        self.name = self.pool.name = self.loads.name = loaded.name
        self._cell.move(Event(Trigger.CHANGE_STARTED))
        try:
            if self.host is None:
                self.loads.load_initial(loaded, force=force, progress=progress, on_step=on_step, change=change)
            else:
                start_budgeted(self.loads, self.host, change, force=force, progress=progress, on_step=on_step)
        except Exception as exc:
            self._cell.move(Event(Trigger.CHANGE_FAILED, serving=False, error=describe(exc, loaded)))
            raise
        self._cell.move(Event(Trigger.CHANGE_SUCCEEDED, serving=self._serving()))

    def _serving(self) -> bool:
        return self.pool.view().serving  # the one meaning (unloaded: loads at its next request)

    # ---- serving --------------------------------------------------------------------------------

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
        Under a host, an unloaded deployment is loaded first, once the host has made room (a
        ``BudgetError`` naming the budget if it cannot in time). The event loop waits without a thread:
        ``pool.try_pin`` and ``servable``."""
        import time

        timeout = self.acquire_timeout if timeout is None else timeout
        if self.host is None:
            return self.pool.pin(timeout)
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
                    raise ApplyError(f"deployment {self.name!r} is still loading after {timeout:g}s") from None

    def wanted(self) -> AbstractContextManager[None]:
        """A request waits for this deployment (to load, then to pin it): under a host it is busy meanwhile,
        so what loads for the request stays loaded until it is pinned."""
        return self.host.wanted(self.name) if self.host is not None else nullcontext()

    def servable(self) -> Future[None]:
        """A future that ends once a pin may succeed (then pin again: ``pool.try_pin``): a generation is
        current, or (under a host) the load on demand this asks the change thread for has ended, raising
        what it raised. A caller waits on it without holding the change thread or a thread of its own."""
        if self.host is None or not self.pool.unloaded:
            return self.pool.changed()
        with self._loading_lock:  # a burst of requests asks for one load
            if self._loading is None or self._loading.done():
                self._loading = self._worker.submit(self._load_for_request)
            return self._loading

    def unpin(self, gen: Generation) -> None:
        self.pool.unpin(gen)

    def _load_for_request(self) -> None:
        """On the worker: a request found the deployment unloaded; load it once the host has made room
        (waiting for room here, on this deployment's own thread; a close stops the wait)."""
        assert self.host is not None
        if self._closed:
            raise ApplyError(f"deployment {self.name!r} is closed")
        if self.pool.unloaded:
            self.host.load(self.name, self._load_on_demand, reason="request", stop=self._closing)

    def _load_on_demand(self) -> None:
        """On the worker: load what serves now (``Loads.load_current``); a failure that is not a lack of
        room shows in ``status()`` like a failed reload, and a load that works clears it."""
        if not self.pool.unloaded:
            return  # loaded meanwhile (a rollout, another request)
        try:
            self.loads.load_current()
        except BudgetError:
            raise
        except DeploykitError as exc:
            error = describe(exc, self.loads.pending)
            log.warning("loading %s on demand failed: %s", self.name, error)
            self._cell.move(Event(Trigger.LOAD_FAILED, serving=self._serving(), error=error))
            raise
        self._cell.move(Event(Trigger.LOAD_SUCCEEDED, serving=True))

    # ---- reloading ------------------------------------------------------------------------------

    def on_reload(self, callback: Callable[[Deployment], None]) -> None:
        """Call ``callback(deployment)`` after every successful swap."""
        self._callbacks.append(callback)

    def reload(self) -> bool:
        """Re-read the manifest and roll out what changed. True when a new generation serves.

        Never raises for a bad manifest or a failed rollout: the error goes to ``status()``.
        """
        try:
            return self._worker.call(self._reload_now)
        except ApplyError:
            if self._closed:
                return False
            raise

    def _reload_now(self) -> bool:
        if self._closed:
            return False
        swapped = self._reload_once() is True
        if swapped:
            self._notify()
        return swapped

    def roll_to(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
                on_step: StepSink = None, change: Change | None = None) -> RolloutResult:
        """Roll out ``loaded`` (a manifest handed over, e.g. by the control API) instead of re-reading
        the file; it becomes this deployment's manifest. Unlike ``reload`` it raises on failure (after
        recording it as a reload failure: the serving generation stays). ``change``: ``loaded`` already
        checked and planned by the caller."""
        self._supersede(loaded)
        return self._worker.call(lambda: self._roll(loaded, force=force, progress=progress, on_step=on_step,
                                                    change=change))

    def reconcile(self, *, force: bool = False, progress: ProgressSink | None = None,
                  on_step: StepSink = None) -> RolloutResult:
        """Roll out the manifest file as it is now (what a save of it does) and raise the real reason
        when that fails; the serving generation stays. ``deploykit apply`` of a watched file."""
        self._supersede(self._file_manifest())
        return self._worker.call(lambda: self._roll(None, force=force, progress=progress, on_step=on_step,
                                                    change=None))

    def _roll(self, given: LoadedManifest | None, *, force: bool, progress: ProgressSink | None,
              on_step: StepSink, change: Change | None) -> RolloutResult:
        """``roll_to`` (``given``) or ``reconcile`` (None: the file as it is now), raising on failure."""
        if self._closed:
            raise ApplyError(f"{self.name!r} is being deleted")
        result = self._reload_once(given, force=force, progress=progress, on_step=on_step, raise_errors=True,
                                   change=change)
        assert isinstance(result, RolloutResult)
        if result.swapped:
            self._notify()
        return result

    def set_conflict(self, message: str | None) -> None:
        """Show (or clear) an ownership conflict as this deployment's error (the supervisor's)."""
        self._worker.post(lambda: self._cell.move(Event(Trigger.CONFLICT, error=message)))

    def _notify(self) -> None:
        for callback in list(self._callbacks):
            try:
                callback(self)
            except Exception:  # a callback's bug must not break serving
                log.exception("on_reload callback failed")

    def _reload_once(self, given: LoadedManifest | None = None, *, force: bool = False,
                     progress: ProgressSink | None = None, on_step: StepSink = None,
                     raise_errors: bool = False, change: Change | None = None) -> bool | RolloutResult:
        clock = ReloadClock()
        loaded: LoadedManifest | None = given
        strategy = "none"
        self._cell.move(Event(Trigger.CHANGE_STARTED))
        try:
            loaded = given or self._manifest()
            if loaded.name != self.name:
                raise ApplyError(f"the manifest now names {loaded.name!r}, this deployment is "
                                 f"{self.name!r}; a rename is a new deployment")
            if change is None or change.loaded is not loaded:
                change = Change(loaded, self.devices)  # parsed once, checked and planned once from here
            result = self._rollout(change, force=force, progress=progress, on_step=on_step)
            strategy = result.strategy
        except Exception as exc:  # any failure, expected or not: recorded, the last good generation serves
            if not isinstance(exc, DeploykitError):
                log.error("reload of %s failed unexpectedly", self.name, exc_info=exc)
            self._record_failure(exc, loaded, strategy, clock)
            if raise_errors:
                raise
            return False
        if given is not None:
            self._given = given
        swapped = self._finish_reload(result, clock)
        return result if raise_errors else swapped

    def _rollout(self, change: Change, *, force: bool, progress: ProgressSink | None,
                 on_step: StepSink) -> RolloutResult:
        if self.host is None:
            rollout = Rollout(self.pool, self.store, devices=self.devices, acquire_timeout=self.acquire_timeout,
                              abort=self._abort, publish=self._publish)
            return rollout.run(change.loaded, force=force, progress=progress, on_step=on_step, change=change)
        return roll_budgeted(self.loads, self.host, change, force=force, progress=progress, on_step=on_step,
                             abort=self._abort, publish=self._publish)

    def _publish(self, progress: CanaryProgress | None) -> None:
        self.rollout_progress = progress  # one reference swapped: a reader sees a whole progress

    @property
    def rolling(self) -> bool:
        """A gated rollout (canary, or blue-green with gates) is in progress and may still be aborted."""
        return self._abort.armed

    def wait_idle(self) -> None:
        """Return once the change in progress on the worker (if any) has ended."""
        self._worker.call(lambda: None)

    def abort_rollout(self, reason: str) -> bool:
        """End the gated rollout in progress at once (any thread; the worker does the rollback). True: it
        will not be promoted; False when none is in progress (or it is already being promoted)."""
        return self._abort.abort(reason)

    def interrupt(self, reason: str) -> None:
        """The deployment is about to close (the server is stopping): end a gated rollout in progress, and
        any that would start, now, so that ``close`` does not wait behind a canary's step."""
        self._abort.close(reason)

    def _finish_reload(self, result: RolloutResult, clock: ReloadClock) -> bool:
        if result.outcome is not None:
            self.loads.last_outcome = result.outcome
        serving = self._serving()
        self._cell.move(Event(Trigger.CHANGE_SUCCEEDED if serving else Trigger.CHANGE_FAILED, serving=serving,
                              error=None if serving else "nothing serves after the change"))
        if not result.swapped:  # nothing changed that needs a new generation
            return False
        current = self.pool.current
        clock.record(self.reload_log, self.generation, current.revision if current else None, True, result.strategy)
        return True

    def _record_failure(self, exc: Exception, loaded: LoadedManifest | None, strategy: str,
                        clock: ReloadClock) -> None:
        error = describe(exc, loaded)
        log.warning("reload of %s failed; generation %d keeps serving: %s", self.name, self.generation, error)
        store_failure(self.store, self.name, exc, loaded, error)  # first: who sees it here sees it in the store
        self._cell.move(Event(Trigger.CHANGE_FAILED, serving=self._serving(), error=error))
        clock.record(self.reload_log, self.generation, None, False, strategy, error)

    def request_reload(self) -> None:
        """Reload on this deployment's worker (returns at once; bursts coalesce), so one deployment's
        slow reload never delays another's. A gated rollout of another manifest in progress ends first."""
        self._supersede(self._file_manifest())
        self._worker.request(self.reload)

    def _file_manifest(self) -> LoadedManifest | None:
        """The manifest file as it is now (None when it cannot be read: that change fails on the worker)."""
        if self._given is not None:
            return None
        try:
            return manifest_named(self.manifest_path, self._wanted_name)
        except DeploykitError:
            return None

    def _supersede(self, loaded: LoadedManifest | None) -> None:
        """A change of ``loaded`` is asked for while a gated rollout of another manifest runs: end that
        rollout now (its step would otherwise run out before the change could start)."""
        progress = self.rollout_progress
        if loaded is None or progress is None or not self.rolling:
            return
        rolling = self.store.get(self.name, progress.revision)
        if rolling is not None and rolling.manifest_digest != loaded.digest:
            self._abort.abort("superseded by a newer change of the manifest")

    def watch(self, *, debounce: float = 0.3) -> None:
        """Reload on the worker whenever the manifest's content changes."""
        from .watcher import ManifestWatcher

        if self._watcher is None:
            self._watcher = ManifestWatcher([self.manifest_path], lambda paths: self.request_reload(),
                                            debounce=debounce)
            self._watcher.start()

    # ---- status and shutdown --------------------------------------------------------------------

    def state(self) -> LiveStatus:
        """The one snapshot of this deployment (phase, generation and revision read together, load state,
        budget, last error, reloads, memory, plan, canary progress) that every view formats: read it once
        per answer."""
        view = self.pool.view()  # first: a state read after it can only be newer
        return live_status(view, self._cell.get(), name=self.name, host=self.host, manifest=self.manifest_path,
                           reloads=self.reload_log, rollout=self.rollout_progress)

    def status(self) -> dict[str, Any]:
        """``state()`` as a JSON object."""
        return self.state().to_dict()

    @property
    def phase_state(self) -> State:
        """The typed state the worker holds (``machine.State``)."""
        return self._cell.get()

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching, let in-flight calls finish (up to ``timeout``), free the model, and join the
        worker."""
        self.interrupt("the deployment is closing")  # first: a canary's step must not hold the worker
        self._closing.set()  # and neither must a load on demand waiting for room
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        try:
            self._worker.call(lambda: self._close(timeout), timeout=2 * timeout)
        except ApplyError:  # closed already
            pass
        except TimeoutError:  # a load that cannot be interrupted still runs: the process may exit anyway
            log.warning("%s: the change in progress did not end within %gs of close", self.name, 2 * timeout)
        self._worker.stop(timeout)

    def _close(self, timeout: float) -> None:
        self._closed = True
        self.pool.close(timeout)
        self._cell.move(Event(Trigger.CLOSED))

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
