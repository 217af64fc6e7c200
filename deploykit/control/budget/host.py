"""``Host``: the deployments of one ``deploykit serve`` under one memory budget, or of a library
``Deployment`` (or a ``Supervisor`` given no budget) under none: ``Host.unlimited``, the same path.

It keeps what the scheduler needs (bytes per tier, priority, keep-alive, busy counts), asks
``scheduler.make_room`` before every load and does what it answers: asks the chosen idle deployments to
unload (each does, on its own change thread, through the drain/free path with the leak guard: the host
never changes what a deployment has loaded), then lets the load run with its bytes reserved. A load that
finds no room waits (``wait_timeout``, default 120 s) for deployments to become idle or unload, then fails
with a ``BudgetError`` naming the budget. A thread finds deployments idle past their keep-alive
(``scheduler.expired``) and asks them to unload. It never loads a model itself: the deployment does.
What it knows of each deployment and hands out (``Entry``, ``Grant``, ``BudgetView``...) is ``entries.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, wait
from contextlib import contextmanager
from functools import partial

from ...units import format_size
from .entries import LOADED, LOADING, UNLOADED, BudgetView, Entry, Grant, Held, Registration, Shrink
from .scheduler import Never, Resident, Room, Wait, Want, expired, make_room
from .tiers import Budget, BudgetError, plan_tiers

log = logging.getLogger(__name__)
DEFAULT_WAIT_TIMEOUT = 120.0  # seconds a load waits for room before its request gets 503
KEEP_ALIVE_POLL = 0.5  # seconds between keep-alive checks: an unload follows expiry within this
LOAD_HISTORY = 256  # load durations kept for the histogram
UNLOAD_WAIT = 30.0  # seconds to wait for the owners to unload what was chosen (idle ones: at once)


class Host:
    """Thread-safe. See the module docstring."""

    def __init__(self, budget: Budget, *, wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic, limited: bool = True) -> None:
        self.budget = budget
        self.limited = limited  # False: ``unlimited`` (no budget was set: status and metrics show none)
        self.wait_timeout = wait_timeout
        self.clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self.loads: Counter[tuple[str, str]] = Counter()  # (name, reason) -> loads
        self.unloads: Counter[tuple[str, str]] = Counter()  # (name, reason) -> unloads
        self.load_seconds: deque[float] = deque(maxlen=LOAD_HISTORY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()

    @classmethod
    def unlimited(cls) -> Host:
        """The host of deployments loaded without a budget (a library ``Deployment``, a ``Supervisor`` given
        none): no tier is limited, so room is always granted at once; nothing waits and nothing is unloaded
        for room. It still loads on demand and unloads past keep-alive: ``lifecycle`` means what it says."""
        return cls(Budget({}, source="no budget"), limited=False)

    @property
    def cpu_bytes(self) -> int | None:
        """The budget's CPU tier (None: not limited): what a deployment's default prefix cache is sized in."""
        return self.budget.tiers.get("cpu")

    # ---- membership ----------------------------------------------------------------------------

    def register(self, name: str, pool: Held, need: dict[str, int], *, priority: int,
                 keep_alive: float | None, shrink: Shrink | None = None) -> None:
        """Know ``name`` (refused with a BudgetError naming the budget if its plan alone exceeds it, its
        default prefix cache shrunk to nothing by ``shrink`` where it has one)."""
        least = shrink(self._zero()) if shrink is not None else need
        decision = make_room(self.budget, [], Want(name, least, priority))
        if isinstance(decision, Never):
            raise BudgetError(f"{name!r} can never be loaded: {decision.reason}")
        with self._cond:
            entry = self._entries.get(name)
            if entry is None or entry.pool is not pool:  # new, or another deployment of the name now (the
                entry = self._entries[name] = Entry(name, pool, dict(need), priority, keep_alive,  # old one's
                                                    LOADED if pool.loaded else UNLOADED)  # room went with it)
            else:
                entry.priority, entry.keep_alive = priority, keep_alive
                if entry.state == UNLOADED and not entry.extra:  # holds nothing: its next load is this plan
                    entry.bytes = dict(need)
            entry.want, entry.shrink = dict(need), shrink
        if keep_alive is not None:
            self.start()  # someone to unload it once idle past its keep-alive (``stop`` joins it)

    def registration(self, name: str) -> Registration | None:
        """What ``register`` was last told of ``name`` (None: not registered), so that a change that fails
        can give back the serving revision's (``budgeting.roll_budgeted``)."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is None:
                return None
            return Registration(dict(entry.want or entry.bytes), entry.priority, entry.keep_alive, entry.shrink)

    def _zero(self) -> dict[str, int]:
        return {tier: 0 for tier in self.budget.tiers}

    @contextmanager
    def rolling(self, name: str) -> Iterator[None]:
        """A rollout holds ``name``: it is not unloaded meanwhile (keep-alive or pressure)."""
        entry = self._entry(name)
        with self._cond:
            entry.rolling = True
        try:
            yield
        finally:
            with self._cond:
                entry.rolling = False
                entry.state = LOADED if entry.pool.loaded else UNLOADED
                self._cond.notify_all()

    def forget(self, name: str) -> None:
        with self._cond:
            self._entries.pop(name, None)
            self._cond.notify_all()

    def state(self, name: str) -> str | None:
        with self._cond:
            entry = self._entries.get(name)
            return entry.state if entry is not None else None

    def describe(self, name: str) -> BudgetView | None:
        """What ``deploykit status`` shows of ``name``: bytes, seconds since its last request, keep-alive left."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is None:
                return None
            idle = max(0.0, self.clock() - entry.pool.last_used)
            busy = entry.busy()
            left = (None if entry.keep_alive is None or entry.state != LOADED
                    else entry.keep_alive if busy else max(0.0, entry.keep_alive - idle))
            return BudgetView(entry.state, sum(entry.bytes.values()), dict(entry.bytes), entry.priority,
                              entry.keep_alive, round(idle, 1), None if left is None else round(left, 1), busy,
                              entry.waiting_for_room)

    def entries(self) -> list[Entry]:
        with self._cond:
            return list(self._entries.values())

    def used(self) -> dict[str, int]:
        """Bytes per tier of the loaded and loading deployments (a rollout's next generation included)."""
        with self._cond:
            return self._used()

    def _used(self) -> dict[str, int]:
        """Every generation still in memory: what the loaded and loading ones hold or reserve, a rollout's next
        generation, and the generations that no longer serve but are not freed yet (a stream still reads one)."""
        used = self._zero()
        for e in self._entries.values():
            for need in (e.bytes if e.state != UNLOADED else {}, e.extra, *_retiring(e)):
                for tier, b in need.items():
                    used[tier] = used.get(tier, 0) + b
        return used

    # ---- making room and loading ---------------------------------------------------------------

    @contextmanager
    def wanted(self, name: str) -> Iterator[None]:
        """A request waits for ``name`` (to load, then to pin it): it is busy meanwhile."""
        with self._cond:
            entry = self._entries.get(name)
            if entry is not None:
                entry.waiting += 1
        try:
            yield
        finally:
            with self._cond:
                if entry is not None:
                    entry.waiting -= 1
                self._cond.notify_all()

    def load(self, name: str, do_load: Callable[[Grant], None], *, reason: str,
             need: dict[str, int] | None = None, timeout: float | None = None,
             stop: threading.Event | None = None) -> bool:
        """Load ``name`` with ``do_load(grant)`` once room is made (one load per name at a time; False when it
        was loaded meanwhile). Raises BudgetError when no room can be made within ``timeout``, or once
        ``stop`` is set while it waits for room (the deployment is closing)."""
        entry = self._entry(name)
        with entry.load_lock:
            if entry.pool.loaded:
                return False
            with self.room(name, need or entry.want or entry.bytes, reason=reason, timeout=timeout, stop=stop,
                           shrink=None if need else entry.shrink) as grant:
                do_load(grant)
            return True

    @contextmanager
    def room(self, name: str, need: dict[str, int], *, reason: str, timeout: float | None = None,
             beside: bool = False, resize: bool = False, stop: threading.Event | None = None,
             shrink: Shrink | None = None) -> Iterator[Grant]:
        """Reserve ``need`` for ``name`` while the block loads it, unloading idle deployments as the
        scheduler says (waiting up to ``timeout`` for room). ``beside``: a blue-green rollout's next
        generation, held beside the one that serves; else the block makes what it reserved what ``name``
        holds. ``resize``: the serving generation itself grows or shrinks to ``need`` (a live change of
        ``spec.adapters``): it stays loaded meanwhile, and keeps what it held if the block fails. ``shrink``: ``need`` with its default prefix cache fitted to a room per tier (a cache is
        evictable): where ``need`` does not fit beside the others but the plan does with a smaller cache, that
        is reserved rather than unloading anyone or waiting; the grant says the room to fit the plan to."""
        entry = self._entry(name)
        started = self.clock()
        with self._cond:
            held = dict(entry.bytes)
        grant = self._reserve(entry, need, timeout=self.wait_timeout if timeout is None else timeout, beside=beside,
                              resize=resize, stop=stop, shrink=shrink)
        ok = False
        try:
            yield grant
            ok = True
        finally:
            with self._cond:
                if beside:
                    entry.extra, entry.counted = {}, None
                    if ok:
                        entry.bytes = dict(grant.bytes)
                else:
                    entry.state = LOADED if (ok or resize) and entry.pool.loaded else UNLOADED
                    entry.bytes = dict(grant.bytes) if ok or not resize else held
                self._cond.notify_all()
            if ok:
                self.loads[(name, reason)] += 1
                self.load_seconds.append(self.clock() - started)

    def _entry(self, name: str) -> Entry:
        with self._cond:
            entry = self._entries.get(name)
        if entry is None:
            raise BudgetError(f"{name!r} is not registered with the host budget")
        return entry

    def _reserve(self, entry: Entry, need: dict[str, int], *, timeout: float, beside: bool, resize: bool = False,
                 stop: threading.Event | None = None, shrink: Shrink | None = None) -> Grant:
        deadline = self.clock() + timeout
        try:
            while True:
                with self._cond:
                    decision = self._decide(entry, need, beside=beside, resize=resize, shrink=shrink)
                    if isinstance(decision, Grant):
                        return decision
                    if isinstance(decision, Never):
                        raise BudgetError(f"{entry.name!r} can never be loaded: {decision.reason}")
                    asked = self._detach(decision.unload) if isinstance(decision, Room) else []
                    if not asked:  # no room yet, or the unloads asked for are still under way
                        if stop is not None and stop.is_set():
                            raise BudgetError(f"stopped waiting for room for {entry.name!r}: it is closing")
                        if self._stop.is_set():
                            raise BudgetError(f"stopped waiting for room for {entry.name!r}: the server is stopping")
                        remaining = deadline - self.clock()
                        why = decision.reason if isinstance(decision, Wait) else "unloading others takes too long"
                        if remaining <= 0:
                            raise BudgetError(f"no room for {entry.name!r} after waiting {timeout:g}s: {why}")
                        if not beside:
                            entry.waiting_for_room = self._waiting(entry, need, shrink, why)
                        self._cond.wait(min(remaining, KEEP_ALIVE_POLL))
                        continue
                # an idle one unloads at once (whatever this wait's own timeout: auto's is 0); then decide
                # again: it now fits, or someone got busy meanwhile
                self._await_unloads(asked, self._unload(asked, "pressure"))
        finally:
            with self._cond:
                entry.waiting_for_room = None

    def _decide(self, entry: Entry, need: dict[str, int], *, beside: bool, resize: bool = False,
                shrink: Shrink | None) -> Grant | Room | Wait | Never:
        """Under the lock: reserve ``need`` (a ``Grant``) if it fits beside the others now, else ``need`` with
        its default prefix cache shrunk to the room left if that fits, else what the scheduler says for the
        least it can load with."""
        residents = self._residents(entry.name if not beside else None)
        want = entry.name if not beside else f"{entry.name} (next)"
        decision = make_room(self.budget, residents, Want(want, need, entry.priority))
        grant: Grant | None = Grant(dict(need)) if isinstance(decision, Room) and not decision.unload else None
        if grant is None and shrink is not None:
            least = make_room(self.budget, residents, Want(want, shrink(self._zero()), entry.priority))
            if isinstance(least, Room) and not least.unload:
                left = self._left(residents, want)
                grant = Grant(shrink(left), left)
            else:
                decision = least
        if grant is None:
            return decision
        if beside:
            entry.extra, entry.counted = dict(grant.bytes), entry.pool.plan
        else:  # a resize stays loaded: it serves throughout
            entry.state, entry.bytes = LOADED if resize else LOADING, dict(grant.bytes)
        return grant

    def _left(self, residents: list[Resident], want: str) -> dict[str, int]:
        """Per budget tier, what the residents other than ``want`` leave free."""
        left = dict(self.budget.tiers)
        for r in residents:
            if r.name != want:
                for tier, b in r.bytes.items():
                    if tier in left:
                        left[tier] -= b
        return {tier: max(0, b) for tier, b in left.items()}

    def _waiting(self, entry: Entry, need: dict[str, int], shrink: Shrink | None, why: str) -> str:
        """What status says while a load of ``entry`` waits for room."""
        least = shrink(self._zero()) if shrink is not None else need
        left = self._left(self._residents(entry.name), entry.name)
        return (f"waiting for room: needs {_sizes(least)}, the budget has {_sizes(left)} left ({why})")

    def _await_unloads(self, entries: list[Entry], futures: list[Future[bool]]) -> None:
        """Wait for the owners to unload ``entries``, but only while they stay idle: an owner whose change
        thread is busy with a change of its own (a rollout, a load) does the unload after it, if at all (then
        it is stale and does nothing), so waiting for it would hold this load up for as long; decide again."""
        deadline = self.clock() + UNLOAD_WAIT
        pending = set(futures)
        while pending and self.clock() < deadline:
            _, pending = wait(pending, KEEP_ALIVE_POLL)
            with self._cond:
                if all(e.busy() for e, f in zip(entries, futures) if f in pending):
                    return

    def _residents(self, exclude: str | None) -> list[Resident]:
        out = []
        for e in self._entries.values():
            if e.name != exclude and e.state != UNLOADED:
                out.append(Resident(e.name, e.bytes, e.priority, e.pool.last_used, e.busy(), e.keep_alive))
            if e.extra:
                out.append(Resident(f"{e.name} (next)", e.extra, e.priority, e.pool.last_used, 1))
            for i, held in enumerate(_retiring(e)):  # never unloaded: freed when their last caller leaves
                out.append(Resident(f"{e.name} (retiring {i + 1})", held, e.priority, e.pool.last_used, 1))
        return out

    def _detach(self, names: tuple[str, ...] | list[str]) -> list[Entry]:
        """Under the lock: the idle ones among ``names`` that no unload is asked for yet, now marked
        ``unloading``; the caller asks their owners (``_unload``) outside the lock."""
        out = []
        for name in names:
            entry = self._entries.get(name)
            if entry is None or entry.busy() or entry.unloading:
                continue
            entry.unloading = True
            out.append(entry)
        return out

    def _unload(self, entries: list[Entry], reason: str) -> list[Future[bool]]:
        """Ask each owner to unload its model on its own change thread (``Held.unload``: a pin that wins
        the race there keeps it); the host's record of it changes when that is done (``_unloaded``)."""
        return [entry.pool.unload(partial(self._unloaded, entry, reason=reason)) for entry in entries]

    def _unloaded(self, entry: Entry, unloaded: bool, *, reason: str) -> None:
        """On the owner's change thread, once it unloaded ``entry`` (or kept it: a pin won)."""
        with self._cond:
            entry.unloading = False
            if unloaded:
                entry.state = UNLOADED
                self.unloads[(entry.name, reason)] += 1
            self._cond.notify_all()
        if unloaded:
            log.info("unloaded %s (%s)", entry.name, "idle past its keep-alive" if reason == "idle" else
                     "making room under the budget")

    # ---- keep-alive ------------------------------------------------------------------------------

    def unload_expired(self, timeout: float = UNLOAD_WAIT) -> list[str]:
        """Unload the deployments idle past their keep-alive (each on its own change thread, waited for up
        to ``timeout``); returns the names unloaded."""
        with self._cond:
            residents = [Resident(e.name, e.bytes, e.priority, e.pool.last_used, e.busy(), e.keep_alive)
                         for e in self._entries.values() if e.state == LOADED]
            victims = self._detach(expired(residents, self.clock()))
        futures = self._unload(victims, "idle")
        wait(futures, timeout)
        return [e.name for e, f in zip(victims, futures) if f.done() and f.exception() is None and f.result()]

    def start(self) -> None:
        """Start the keep-alive thread (once; never after ``stop``). ``register`` starts it for the first
        deployment with a keep-alive; the host's owner joins it (``stop``)."""
        with self._thread_lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._keep_alive_loop, name="deploykit-keep-alive",
                                                daemon=True)
                self._thread.start()

    def _keep_alive_loop(self) -> None:
        while not self._stop.wait(KEEP_ALIVE_POLL):
            try:
                self.unload_expired()
            except Exception:  # a bug here must not stop keep-alive for good
                log.exception("keep-alive check failed")

    def interrupt(self) -> None:
        """The server is stopping (SIGTERM; any thread): every wait for room ends now with a BudgetError, none
        starts, and keep-alive stops; ``stop`` joins its thread."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        self.interrupt()
        with self._thread_lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)


def _retiring(entry: Entry) -> list[dict[str, int]]:
    """Bytes per tier of each generation of ``entry`` that no longer serves but is still in memory."""
    return [plan_tiers(plan) for plan in entry.pool.retiring() if plan is not None and plan is not entry.counted]


def _sizes(need: Mapping[str, int]) -> str:
    return ", ".join(f"{t}={format_size(b)}" for t, b in sorted(need.items())) or "nothing"
