"""``Deployment``: a live model inside a long-running Python process, swapped atomically on reload.

    dep = Deployment.from_manifest("manifests/minilm.yaml", watch=True)
    with dep.acquire() as model:        # pins the current generation for the duration
        model(**inputs)
    dep.generation, dep.status()
    dep.close()

A thin facade over a ``GenerationPool`` (pin, swap, drain, free, leak guard), a ``Rollout`` (blue-green,
recreate, auto) and a ``ManifestWatcher``. Each successful (re)load makes a new generation; a caller
that acquired generation N keeps it until its ``with`` block ends. The in-process calls (``acquire``,
``generate``, ``chat``, ``embed``) live in ``embedded``; its loads (the first, and those on demand
under a host, by ``pin``) in ``on_demand``; the reload records, counts, timing and worker thread in ``reloads``; the shape of
``status()`` in ``report``.

A reload that fails at any step (bad manifest, missing file, plan infeasible, load error, failed
health check) leaves the serving generation untouched; the error appears in ``status()`` (with the
manifest's file:line where it applies), in the state store (so ``deploykit status`` shows it too) and
in its events. A later reload that succeeds, or finds nothing to change, clears it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ApplyError, DeploykitError
from ..names import Phase
from ..spec.manifest import LoadedManifest, manifest_named
from .embedded import EmbeddedApi
from .on_demand import OnDemandLoading
from .pool import GenerationPool
from .report import live_status
from .reconciler import ApplyOutcome
from .reloads import ReloadClock, ReloadLog, ReloadRecord, ReloadWorker, describe, store_failure
from .rollout import Rollout, RolloutResult
from .state import StateStore, open_store

if TYPE_CHECKING:
    from ..artifacts.reshard import ProgressSink
    from .host import Host
    from .watcher import ManifestWatcher

log = logging.getLogger(__name__)
DEFAULT_ACQUIRE_TIMEOUT = 300.0  # seconds acquire() waits while a recreate rollout reloads


class Deployment(OnDemandLoading, EmbeddedApi):
    """A deployed model held by this process. Thread-safe. See the module docstring."""

    def __init__(self, manifest_path: Path, *, name: str | None = None, devices: str | None = None,
                 store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                 host: Host | None = None) -> None:
        self.manifest_path = Path(manifest_path)
        self._wanted_name = name
        self.devices = devices
        self.store = store or open_store()
        self.acquire_timeout = acquire_timeout
        self.name: str = name or ""
        self.pool = GenerationPool(self.name)
        self._reload_lock = threading.Lock()  # one reload at a time
        self._phase = Phase.PENDING  # Pending, Progressing while a change runs, then Ready/Failed, Closed
        self._last_error: str | None = None
        self._conflict: str | None = None  # a watched file declares this API-owned name (supervisor)
        self._callbacks: list[Callable[[Deployment], None]] = []
        self.reload_log = ReloadLog()
        self._watcher: ManifestWatcher | None = None
        self._worker: ReloadWorker | None = None
        self._closed = False
        self._given: LoadedManifest | None = None  # a manifest handed over (control API), not a file
        self.last_outcome: ApplyOutcome | None = None
        self.host = host  # the budget this deployment loads and unloads under (deploykit serve), if any
        self._verified: int | None = None  # the revision whose shards this process checked by hash
        self.pending: LoadedManifest | None = None  # an on-demand manifest to apply at its first load
        self._load_error: str | None = None  # why the last load on demand failed (cleared by one that works)

    @classmethod
    def from_manifest(cls, path: str | Path, *, watch: bool = False, name: str | None = None,
                      devices: str | None = None, state_dir: str | Path | None = None,
                      store: StateStore | None = None, acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT,
                      debounce: float = 0.3, host: Host | None = None) -> Deployment:
        """Apply the manifest at ``path`` and hold its model. ``watch=True`` reloads on changes."""
        store = store or open_store(Path(state_dir) if state_dir is not None else None)
        dep = cls(Path(path), name=name, devices=devices, store=store, acquire_timeout=acquire_timeout, host=host)
        dep.start()
        if watch:
            dep.watch(debounce=debounce)
        return dep

    @classmethod
    def from_loaded(cls, loaded: LoadedManifest, *, devices: str | None = None, store: StateStore | None = None,
                    acquire_timeout: float = DEFAULT_ACQUIRE_TIMEOUT, force: bool = False,
                    progress: ProgressSink | None = None,
                    on_step: Callable[[str], None] | None = None, host: Host | None = None) -> Deployment:
        """Apply an already loaded manifest (one sent over the control API, or a revision's recorded
        manifest after a restart) and hold its model. It has no file to watch: ``roll_to`` changes it."""
        dep = cls(Path(loaded.source), name=loaded.name, devices=devices, store=store,
                  acquire_timeout=acquire_timeout, host=host)
        dep._given = loaded
        dep.start(force=force, progress=progress, on_step=on_step)
        return dep

    def _manifest(self) -> LoadedManifest:
        return self._given if self._given is not None else manifest_named(self.manifest_path, self._wanted_name)

    def start(self, *, force: bool = False, progress: ProgressSink | None = None,
              on_step: Callable[[str], None] | None = None) -> None:
        """Apply the manifest (or load the current revision, verified and health-checked)."""
        loaded = self._manifest()
        self.name = self.pool.name = loaded.name
        self._phase = Phase.PROGRESSING
        try:
            if self.host is None:
                self.load_initial(loaded, force=force, progress=progress, on_step=on_step)
            else:
                from .budgeting import start_budgeted

                start_budgeted(self, self.host, loaded, force=force, progress=progress, on_step=on_step)
        except Exception as exc:
            self._phase, self._last_error = Phase.FAILED, describe(exc, loaded)
            raise
        self._phase = Phase.READY

    # ---- serving --------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        return self.pool.number

    @property
    def memory(self) -> list[tuple[int, int]]:
        return list(self.pool.memory)

    @property
    def reloads(self) -> deque[ReloadRecord]:
        """The latest reloads, oldest first (``ReloadLog.records``)."""
        return self.reload_log.records

    @property
    def reload_count(self) -> int:
        return self.reload_log.count

    @property
    def reload_failures(self) -> int:
        return self.reload_log.failures

    # ---- reloading ------------------------------------------------------------------------------

    def on_reload(self, callback: Callable[[Deployment], None]) -> None:
        """Call ``callback(deployment)`` after every successful swap."""
        self._callbacks.append(callback)

    def reload(self) -> bool:
        """Re-read the manifest and roll out what changed. True when a new generation serves.

        Never raises for a bad manifest or a failed rollout: the error goes to ``status()``.
        """
        with self._reload_lock:
            if self._closed:
                return False
            swapped = self._reload_once() is True
        if swapped:
            self._notify()
        return swapped

    def roll_to(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
                on_step: Callable[[str], None] | None = None) -> RolloutResult:
        """Roll out ``loaded`` (a manifest handed over, e.g. by the control API) instead of re-reading
        the file; it becomes this deployment's manifest. Unlike ``reload`` it raises on failure (after
        recording it as a reload failure: the serving generation stays)."""
        return self._roll(loaded, force=force, progress=progress, on_step=on_step)

    def reconcile(self, *, force: bool = False, progress: ProgressSink | None = None,
                  on_step: Callable[[str], None] | None = None) -> RolloutResult:
        """Roll out the manifest file as it is now (what a save of it does) and raise the real reason
        when that fails; the serving generation stays. ``deploykit apply`` of a watched file."""
        return self._roll(None, force=force, progress=progress, on_step=on_step)

    def _roll(self, given: LoadedManifest | None, *, force: bool, progress: ProgressSink | None,
              on_step: Callable[[str], None] | None) -> RolloutResult:
        """``roll_to`` (``given``) or ``reconcile`` (None: the file as it is now), raising on failure."""
        with self._reload_lock:
            if self._closed:
                raise ApplyError(f"{self.name!r} is being deleted")
            result = self._reload_once(given, force=force, progress=progress, on_step=on_step, raise_errors=True)
        assert isinstance(result, RolloutResult)
        if result.swapped:
            self._notify()
        return result

    def set_conflict(self, message: str | None) -> None:
        """Show (or clear) an ownership conflict as this deployment's error (the supervisor's)."""
        self._conflict = message

    def _notify(self) -> None:
        for callback in list(self._callbacks):
            try:
                callback(self)
            except Exception:  # a callback's bug must not break serving
                log.exception("on_reload callback failed")

    def _reload_once(self, given: LoadedManifest | None = None, *, force: bool = False,
                     progress: ProgressSink | None = None, on_step: Callable[[str], None] | None = None,
                     raise_errors: bool = False) -> bool | RolloutResult:
        clock = ReloadClock()
        loaded: LoadedManifest | None = given
        strategy = "none"
        self._phase = Phase.PROGRESSING
        try:
            loaded = given or self._manifest()
            if loaded.name != self.name:
                raise ApplyError(f"the manifest now names {loaded.name!r}, this deployment is "
                                 f"{self.name!r}; a rename is a new deployment")
            if self.host is None:
                result = Rollout(self.pool, self.store, devices=self.devices,
                                 acquire_timeout=self.acquire_timeout).run(loaded, force=force, progress=progress,
                                                                           on_step=on_step)
            else:
                from .budgeting import roll_budgeted

                result = roll_budgeted(self, self.host, loaded, force=force, progress=progress, on_step=on_step)
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
        self._last_error = None
        swapped = self._finish_reload(result, clock)
        return result if raise_errors else swapped

    def _finish_reload(self, result: RolloutResult, clock: ReloadClock) -> bool:
        self._phase = Phase.READY if self.pool.current is not None else Phase.FAILED
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
        self._last_error = error
        self._phase = Phase.FAILED
        clock.record(self.reload_log, self.generation, None, False, strategy, self._last_error)

    def request_reload(self) -> None:
        """Reload on this deployment's own worker thread (returns at once; bursts coalesce), so one
        deployment's slow reload never delays another's."""
        if self._worker is None:
            self._worker = ReloadWorker(self.name, self.reload)
        self._worker.request()

    def watch(self, *, debounce: float = 0.3) -> None:
        """Reload in a background thread whenever the manifest's content changes."""
        from .watcher import ManifestWatcher

        if self._watcher is None:
            self._watcher = ManifestWatcher([self.manifest_path], lambda paths: self.reload(),
                                            debounce=debounce)
            self._watcher.start()

    # ---- status and shutdown --------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Phase, generation, revision, load state, budget, last error, reloads, memory and plan
        (``report.live_status``)."""
        return live_status(self.pool.current, self._last_error or self._conflict or self._load_error, self._phase,
                           name=self.name, pool=self.pool, host=self.host, manifest=self.manifest_path,
                           reloads=self.reload_log)

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching, let in-flight calls finish (up to ``timeout``), free the model."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._worker is not None:
            self._worker.stop()
        with self._reload_lock:
            self._closed = True
            self.pool.close(timeout)
            self._phase = Phase.CLOSED

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
