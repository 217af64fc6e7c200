"""What runs on a deployment's change thread (``worker.ChangeWorker``), and the state only that thread
moves: ``ChangeRunner`` owns the deployment's one state (``machine.StateCell``), its reload log, its loads
(``on_demand.Loads``: the pool and what it loads), the abort signal of a gated rollout and its latest
progress. Every method here runs on that thread, called through ``Deployment`` (``worker.call``,
``submit`` or ``post``); the other threads only read what it publishes (``Deployment.state``).

A change that fails at any step (bad manifest, missing file, plan infeasible, load error, failed health
check) leaves the serving generation untouched; its error goes to the state, the store and the reload log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ApplyError, DeploykitError
from ...spec.manifest import LoadedManifest, manifest_named
from ..admission import admit
from ..budget import BudgetError
from ..revisions.change import Change
from .budgeting import roll_budgeted, serve_last_ready, start_budgeted
from .canary import AbortSignal, CanaryProgress
from .machine import Event, StateCell, Trigger
from .on_demand import Loads
from .reloads import ReloadClock, ReloadLog, describe, store_failure
from .rollout import RolloutResult

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ..budget.host import Grant, Host
    from ..revisions.state import StateStore
    from .pool import GenerationPool

log = logging.getLogger(__name__)
StepSink = Callable[[str], None] | None


class ChangeRunner:
    """The change side of one deployment (``owner``: the ``Deployment`` its reload callbacks are given)."""

    def __init__(self, owner: Any, loads: Loads, *, manifest_path: Path, wanted_name: str | None,
                 named: Callable[[str], None]) -> None:
        self._owner = owner
        self.loads = loads
        self.manifest_path = manifest_path
        self.wanted_name = wanted_name
        self._named = named  # tells the deployment its name once the manifest says it
        self.cell = StateCell()  # moved only here
        self.reload_log = ReloadLog()
        self.abort = AbortSignal()  # a rollback ends a gated rollout in progress with it
        self.rollout_progress: CanaryProgress | None = None  # the latest gated rollout (in progress or ended)
        self.given: LoadedManifest | None = None  # a manifest handed over (control API), not a file
        self.callbacks: list[Callable[[Any], None]] = []
        self.closed = False
        self.closing = threading.Event()  # close() began: a load waiting for room stops waiting

    @property
    def name(self) -> str:
        return self.loads.name

    @property
    def pool(self) -> GenerationPool:
        return self.loads.pool

    @property
    def store(self) -> StateStore:
        return self.loads.store

    @property
    def host(self) -> Host:
        return self.loads.host

    @property
    def devices(self) -> str | None:
        return self.loads.devices

    @property
    def budget_cpu(self) -> int | None:
        return self.host.cpu_bytes

    @property
    def acquire_timeout(self) -> float:
        return self.loads.acquire_timeout

    def start(self, *, force: bool, progress: ProgressSink | None, on_step: StepSink,
              change: Change | None) -> bool:
        """Load what serves at start. True: the last promoted revision serves and the manifest, gated,
        differs from it (the caller rolls it out next, through its gates)."""
        loaded = change.loaded if change is not None else self.manifest()
        change = change if change is not None else Change(loaded, self.devices, budget_cpu=self.budget_cpu)
        self.loads.name = self.pool.name = loaded.name
        self._named(loaded.name)
        self.cell.move(Event(Trigger.CHANGE_STARTED))
        self.store.interrupt_restarted(loaded.name)  # a rollout a dead process left Progressing: say so
        try:
            admit(loaded, self.loads.policy)  # before anything looks at it (a restore, a watched file's first load)
            gated_next = start_budgeted(self.loads, self.host, change, force=force, progress=progress,
                                        on_step=on_step)
        except Exception as exc:
            if not self._serve_last_good(exc, change):
                self.cell.move(Event(Trigger.CHANGE_FAILED, serving=False, error=describe(exc, loaded)))
                raise
            self.cell.move(Event(Trigger.CHANGE_FAILED, serving=True, error=describe(exc, loaded)))
            return False
        self.cell.move(Event(Trigger.CHANGE_SUCCEEDED, serving=self.serving()))
        return gated_next

    def _serve_last_good(self, failure: Exception, change: Change) -> bool:
        """A start whose manifest fails (a restart while the file holds a broken change): the last Ready
        revision serves, as it did before the restart (through the host: ``serve_last_ready``), and the
        failure shows as the pending error. False (the start fails) when there is none, something serves
        already, or it cannot be loaded either."""
        current = self.store.current(self.name)
        if self.pool.current is not None or current is None or current.plan is None:
            return False
        try:
            serve_last_ready(self.loads, self.host, change)
        except DeploykitError as exc:  # refused or broken too (a policy that refuses it, files gone): said once
            log.warning("%s: the last Ready revision cannot serve either: %s", self.name, exc)
            return False
        except Exception:
            log.exception("%s: loading the last Ready revision after a failed start failed", self.name)
            return False
        log.warning("%s: the manifest could not be applied (%s); the last Ready revision serves", self.name, failure)
        return True

    def serving(self) -> bool:
        return self.pool.view().serving  # the one meaning (unloaded: loads at its next request)

    def load_for_request(self) -> bool:
        """On the worker: a request found the deployment unloaded; load it once the host has made room
        (waiting for room here, on this deployment's own thread; a close stops the wait). True when the
        last promoted revision loaded and a gated change waits to roll out from it (``roll_pending``)."""
        if self.closed:
            raise ApplyError(f"deployment {self.name!r} is closed")
        if self.pool.unloaded:
            self.host.load(self.name, self.load_on_demand, reason="request", stop=self.closing)
        return self.loads.pending is not None and not self.pool.unloaded

    def roll_pending(self) -> None:
        """On the worker, after ``load_for_request`` said so: the pending gated change rolls out from what
        serves, through its gates (a failure goes to status, as a reload's)."""
        pending = None if self.closed else self.loads.take_pending()
        from_file = self.given is None  # a watched file's change: the file, not this copy, rules after it
        if pending is not None and self._reload_once(pending[0], force=pending[1], adopt=not from_file) is True:
            self._notify()

    def load_on_demand(self, grant: Grant) -> None:
        """On the worker: load what serves now (``Loads.load_current``), in the room the host's ``grant``
        left; a failure that is not a lack of room shows in ``status()`` like a failed reload, and a load
        that works clears it."""
        if not self.pool.unloaded:
            return  # loaded meanwhile (a rollout, another request)
        self.loads.room_left = grant.left
        try:
            gated_next = self.loads.load_current()
        except BudgetError:
            raise
        except DeploykitError as exc:
            error = describe(exc, self.loads.pending)
            log.warning("loading %s on demand failed: %s", self.name, error)
            self.cell.move(Event(Trigger.LOAD_FAILED, serving=self.serving(), error=error))
            raise
        failed = self.loads.take_pending_failure()
        if failed is not None:  # the pending change failed; the last Ready revision loaded and serves
            self.cell.move(Event(Trigger.CHANGE_FAILED, serving=True, error=describe(*failed)))
            return
        self.cell.move(Event(Trigger.LOAD_SUCCEEDED, serving=True))
        if gated_next:
            log.info("%s: the last promoted revision loaded; its pending change rolls out from it, through its "
                     "gates", self.name)

    def reload_now(self) -> bool:
        if self.closed:
            return False
        swapped = self._reload_once() is True
        if swapped:
            self._notify()
        return swapped

    def roll(self, given: LoadedManifest | None, *, force: bool, progress: ProgressSink | None,
              on_step: StepSink, change: Change | None, adopt: bool = True) -> RolloutResult:
        """``roll_to`` (``given``) or ``reconcile`` (None: the file as it is now), raising on failure.
        ``adopt`` False: ``given`` serves but the file stays this deployment's manifest (its next reload
        reads the file again: an emergency rollback of a git source's deployment)."""
        if self.closed:
            raise ApplyError(f"{self.name!r} is being deleted")
        result = self._reload_once(given, force=force, progress=progress, on_step=on_step, raise_errors=True,
                                   change=change, adopt=adopt)
        assert isinstance(result, RolloutResult)
        if result.swapped:
            self._notify()
        return result

    def _notify(self) -> None:
        for callback in list(self.callbacks):
            try:
                callback(self._owner)
            except Exception:  # a callback's bug must not break serving
                log.exception("on_reload callback failed")

    def _reload_once(self, given: LoadedManifest | None = None, *, force: bool = False,
                     progress: ProgressSink | None = None, on_step: StepSink = None,
                     raise_errors: bool = False, change: Change | None = None,
                     adopt: bool = True) -> bool | RolloutResult:
        """One change rolled out. ``given``: a manifest handed over rather than read from the file, kept as
        what this deployment follows from then on when ``adopt`` (the control API's); None: the file now."""
        clock = ReloadClock()
        loaded: LoadedManifest | None = given
        strategy = "none"
        self.cell.move(Event(Trigger.CHANGE_STARTED))
        try:
            loaded = given or self.manifest()
            if loaded.name != self.name:
                raise ApplyError(f"the manifest now names {loaded.name!r}, this deployment is "
                                 f"{self.name!r}; a rename is a new deployment")
            admit(loaded, self.loads.policy)  # a reload, a rollback, an adapter change: each admitted
            if change is None or change.loaded is not loaded:
                change = Change(loaded, self.devices, budget_cpu=self.budget_cpu)  # parsed once, checked and planned once from here
            self.abort.file_before(self._file_digest() if given is not None else None)
            result = self._rollout(change, force=force, progress=progress, on_step=on_step)
            strategy = result.strategy
        except Exception as exc:  # any failure, expected or not: recorded, the last good generation serves
            if not isinstance(exc, DeploykitError):
                log.error("reload of %s failed unexpectedly", self.name, exc_info=exc)
            self._record_failure(exc, loaded, strategy, clock)
            if raise_errors:
                raise
            return False
        if given is not None and adopt:
            self.given = given
        swapped = self._finish_reload(result, clock)
        return result if raise_errors else swapped

    def _rollout(self, change: Change, *, force: bool, progress: ProgressSink | None,
                 on_step: StepSink) -> RolloutResult:
        return roll_budgeted(self.loads, self.host, change, force=force, progress=progress, on_step=on_step,
                             abort=self.abort, publish=self._owner._publish)

    def _finish_reload(self, result: RolloutResult, clock: ReloadClock) -> bool:
        if result.outcome is not None:
            self.loads.last_outcome = result.outcome
        serving = self.serving()
        self.cell.move(Event(Trigger.CHANGE_SUCCEEDED if serving else Trigger.CHANGE_FAILED, serving=serving,
                              error=None if serving else "nothing serves after the change"))
        if not result.swapped:  # nothing changed that needs a new generation
            return False
        current = self.pool.current
        clock.record(self.reload_log, self.pool.number, current.revision if current else None, True, result.strategy)
        return True

    def _record_failure(self, exc: Exception, loaded: LoadedManifest | None, strategy: str,
                        clock: ReloadClock) -> None:
        error = describe(exc, loaded)
        view = self.pool.view()
        serving = f"generation {view.number} keeps serving" if view.current is not None else "nothing serves"
        log.warning("reload of %s failed; %s: %s", self.name, serving, error)
        store_failure(self.store, self.name, exc, loaded, error)  # first: who sees it here sees it in the store
        self.cell.move(Event(Trigger.CHANGE_FAILED, serving=self.serving(), error=error))
        clock.record(self.reload_log, self.pool.number, None, False, strategy, error)

    def close(self, timeout: float) -> None:
        self.closed = True
        self.pool.close(timeout)
        self.cell.move(Event(Trigger.CLOSED))

    def _file_digest(self) -> str | None:
        """The watched file's manifest as it is now; None without one (or when it cannot be read)."""
        if self.given is not None:
            return None
        try:
            return manifest_named(self.manifest_path, self.wanted_name).digest
        except DeploykitError:
            return None

    def manifest(self) -> LoadedManifest:
        return self.given if self.given is not None else manifest_named(self.manifest_path, self.wanted_name)

