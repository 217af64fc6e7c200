"""The generations of one deployment held in memory: pin, swap, drain, free, and the leak guard.

A caller pins the current generation for the duration of its work; a swap makes a new generation
current at once, and the old one is freed (references dropped, ``gc.collect()``, the CUDA cache
emptied where CUDA exists) when its last caller unpins it. A recreate drains first: no generation is
current, new pins wait, and the old one is freed once its callers leave. A canary stages a candidate beside
the current generation; new pins go to it for the share its step sets (``traffic.Split``) until it is
promoted (the old one then retires like a swap) or discarded (it retires instead).

Generations whose model carries accelerate offload hooks (GPU plans with CPU/disk blocks) run one
forward at a time (``forward_lock``): those hooks move weights around each forward and are not
thread-safe. CPU-only plans (disk blocks memory-mapped, no hooks) run concurrent forwards.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import ApplyError
from ...placement.inventory import process_rss
from ...placement.kv import kv_budget
from ...placement.plan import Plan
from ...threads import ThreadGroup
from .memory import report_reclaimed, return_memory
from .traffic import Split, TrafficLog

if TYPE_CHECKING:
    from ...engine.loader import LoadedModel
    from ...engine.runtime import Runtime
    from ...engine.serving import ServingSpec

log = logging.getLogger(__name__)
MEMORY_HISTORY = 64  # leak-guard samples kept


class NotLoaded(ApplyError):
    """The deployment is unloaded (budget, keep-alive, on-demand): the caller asks the host to load it."""


@dataclass
class Generation:
    number: int
    revision: int
    loaded: LoadedModel | None  # None once freed
    plan: Plan | None
    strategy: str = ""
    refs: int = 0
    retired: bool = False
    freeing: bool = False  # claimed by the one caller that frees it
    forward_lock: threading.Lock | None = None
    runtime: Runtime | None = None  # what serves requests on this generation (closed when freed)
    task: str = "causal-lm"
    created: float = field(default_factory=time.time)
    traffic: TrafficLog = field(default_factory=TrafficLog)  # its requests, for a canary's traffic gates


def _run_here(fn: Callable[[], bool]) -> Future[bool]:
    """A pool without an owner thread (tests of the pool alone) does the owner's work on the caller's."""
    future: Future[bool] = Future()
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)
    return future


def kv_cache_budget(plan: Plan | None) -> int:
    """Bytes the KV cache may take: as much as fits, on every device that holds a share of it (each layer's
    on the device that runs it), beside the weights and the prefix cache (the plan knows them:
    ``placement.kv.kv_budget``), else 1 GiB. Sizing it here keeps a batching engine from guessing from
    host RAM."""
    default = 1 << 30
    room = kv_budget(plan) if plan is not None else None
    return default if room is None else max(64 << 20, room)


def new_generation(number: int, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                   serving: ServingSpec) -> Generation:
    """A generation with its runtime (batching engine or embedder) built from the deployment's limits."""
    from ...engine.runtime import build_runtime

    lock = threading.Lock() if loaded.serialize_forward else None
    runtime = loaded.runtime or build_runtime(loaded, serving.limits, task=serving.load.task,
                                              kv_cache_bytes=kv_cache_budget(plan), forward_lock=lock,
                                              adapters=serving.adapters, speculative=serving.speculative)
    return Generation(number, revision, loaded, plan, strategy, forward_lock=lock, runtime=runtime,
                      task=serving.load.task)


@dataclass(frozen=True)
class PoolView:
    """The pool at one moment, read under its lock (``GenerationPool.view``): what is current (and its
    number and revision, read together), whether it is unloaded, and a canary's candidate."""

    current: Generation | None
    number: int  # the current generation's (the latest made when none is current)
    unloaded: bool
    candidate: int | None  # a canary's staged generation
    share: int  # percent of new requests the candidate takes
    in_flight: int  # callers holding the current generation
    baseline_rss: int | None
    revision: int | None = None  # the current generation's, read with it

    @property
    def serving(self) -> bool:
        """The one meaning of "serving": a generation is current, or it loads at its next request
        (unloaded under a budget)."""
        return self.current is not None or self.unloaded


class GenerationPool:
    """Thread-safe holder of the current generation and the retiring ones of one deployment."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._current: Generation | None = None
        self._number = 0
        self._closed = False
        self.baseline_rss: int | None = None
        self.memory: deque[tuple[int, int]] = deque(maxlen=MEMORY_HISTORY)  # (generation freed, RSS after)
        self.unloaded = False  # unloaded under the host's budget: a pin raises NotLoaded instead of waiting
        self.last_used = time.monotonic()  # when the last caller unpinned (keep-alive counts from here)
        self._frees = ThreadGroup()  # frees started by ``release``; ``close`` joins them
        self._candidate: Generation | None = None  # a canary's new generation, beside the current one
        self._split = Split()  # the share of new pins the candidate takes
        self.owner: Callable[[Callable[[], bool]], Future[bool]] = _run_here  # runs on the change thread
        self._watchers: list[Future[None]] = []  # ``changed()``'s futures, ended by the next change
        self._made: list[Generation] = []  # generations made current or candidate, not yet freed (``retiring``)
        self._unloading: Generation | None = None  # being freed by ``unload_now``
        self.broken: str | None = None  # why nothing serves and nothing will until a change (``mark_broken``)

    @property
    def current(self) -> Generation | None:
        return self._current

    def view(self) -> PoolView:
        """Everything a status shows of the pool, read at one moment."""
        with self._cond:
            gen, candidate = self._current, self._candidate
            return PoolView(gen, gen.number if gen is not None else self._number, self.unloaded,
                            candidate.number if candidate is not None else None,
                            self._split.percent if candidate is not None else 0,
                            gen.refs if gen is not None else 0, self.baseline_rss,
                            gen.revision if gen is not None else None)

    @property
    def number(self) -> int:
        """The current generation's number (a canary's candidate counts once promoted); the latest made
        when none is current."""
        gen = self._current
        return gen.number if gen is not None else self._number

    @property
    def loaded(self) -> bool:
        """A generation is current (``budget.host.Held``)."""
        return self._current is not None

    @property
    def plan(self) -> Plan | None:
        """The current generation's plan (``budget.host.Held``)."""
        gen = self._current
        return gen.plan if gen is not None else None

    @property
    def in_use(self) -> int:
        """Callers holding the current generation now (``budget.host.Held``)."""
        gen = self._current
        return gen.refs if gen is not None else 0

    @property
    def candidate(self) -> Generation | None:
        """A canary's new generation, loaded beside the current one (None outside a canary)."""
        return self._candidate

    @property
    def share(self) -> int:
        """Percent of new pins the candidate takes."""
        return self._split.percent if self._candidate is not None else 0

    def _chosen(self) -> Generation | None:
        """Under the lock: the generation a new pin gets (the candidate for its share of them)."""
        gen = self._current
        if gen is not None and self._candidate is not None and self._split.next_is_new():
            return self._candidate
        return gen

    def try_pin(self) -> Generation | None:
        """The current generation pinned (or, during a canary, the candidate for its share of pins), or None
        at once when there is none (a recreate is reloading)."""
        with self._cond:
            gen = self._chosen()
            if gen is not None:
                gen.refs += 1
            return gen

    def pin(self, timeout: float) -> Generation:
        """The current generation, pinned; waits up to ``timeout`` while a recreate has none."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._current is None:
                if self.unloaded:
                    raise NotLoaded(f"deployment {self.name!r} is not loaded")
                if self.broken is not None:
                    raise ApplyError(self.broken)
                if self._closed:
                    raise ApplyError(f"deployment {self.name!r} is closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ApplyError(f"deployment {self.name!r} has no model ready after {timeout:g}s "
                                     "(a recreate rollout is reloading it)")
                self._cond.wait(remaining)
            gen = self._chosen()
            assert gen is not None
            gen.refs += 1
            return gen

    def changed(self) -> Future[None]:
        """A future that ends once a pin may find something new: at once when a generation is current,
        else at the next install, unload or close. It ends with ``NotLoaded`` while the deployment is
        unloaded (the caller loads it) and with ``ApplyError`` once closed. A request on the event loop
        waits on it without holding a thread (``pin`` is the blocking wait)."""
        future: Future[None] = Future()
        with self._cond:
            if self._closed:
                future.set_exception(ApplyError(f"deployment {self.name!r} is closed"))
            elif self._current is None and self.unloaded:
                future.set_exception(NotLoaded(f"deployment {self.name!r} is not loaded"))
            elif self._current is None and self.broken is not None:
                future.set_exception(ApplyError(self.broken))
            elif self._current is not None:
                future.set_result(None)
            else:
                self._watchers.append(future)
        return future

    def _wake(self) -> None:
        """Under the lock: what the current generation is, or whether one is loaded, changed."""
        self._cond.notify_all()
        watchers, self._watchers = self._watchers, []
        for future in watchers:
            future.set_result(None)  # its waiter looks again (``changed`` says what it finds)

    def unpin(self, gen: Generation) -> None:
        """Unpin; frees a retired generation on this thread when this was its last caller."""
        if self._unpinned(gen):
            self._free(gen)

    def release(self, gen: Generation) -> None:
        """Unpin without ever blocking: a retired generation left with no caller is freed on a thread
        of its own (for the event loop, and for cleanup that must not be interrupted halfway)."""
        if self._unpinned(gen):
            self._frees.start(self._free, gen, name=f"deploykit-free-{self.name}")

    def _unpinned(self, gen: Generation) -> bool:
        with self._cond:
            if gen.refs <= 0:  # a caller released twice: never let the count go negative
                log.error("%s: generation %d unpinned more often than pinned", self.name, gen.number)
                return False
            gen.refs -= 1
            self.last_used = time.monotonic()
            free = gen.retired and gen.refs == 0 and gen.loaded is not None
            self._cond.notify_all()
        return free

    def _numbered(self, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                  serving: ServingSpec) -> Generation:
        """A new generation of ``loaded`` with the next number (the runtime is built outside the lock)."""
        with self._cond:
            self._number += 1
            number = self._number
        return new_generation(number, loaded, plan, revision, strategy, serving)

    def install(self, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                serving: ServingSpec) -> Generation:
        """Make ``loaded`` the current generation; the previous one is freed once unpinned."""
        return self.put(self.build(loaded, plan, revision, strategy, serving))

    def build(self, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
              serving: ServingSpec) -> Generation:
        """A generation of ``loaded`` with its runtime, not current yet (``put`` makes it current, ``abandon``
        frees it): what may fail is done before anything is recorded or swapped."""
        return self._numbered(loaded, plan, revision, strategy, serving)

    def abandon(self, gen: Generation) -> None:
        """Free a generation ``build`` made that never became current."""
        gen.retired = True
        self._free(gen)

    def mark_broken(self, reason: str) -> None:
        """Nothing serves and nothing will load by itself (a failed recreate whose restore failed too):
        waiting and new pins fail at once with ``reason`` until a generation is installed."""
        with self._cond:
            if self._current is None:
                self.broken = reason
                self._wake()

    def put(self, gen: Generation) -> Generation:
        """Make ``gen`` (from ``build``) the current generation; the previous one is freed once unpinned.
        Nothing here can fail before the swap."""
        with self._cond:
            old, self._current = self._current, gen
            self._made.append(gen)  # in memory until freed (``retiring``); before, the host's reservation counts it
            self.unloaded, self.broken = False, None
            self.last_used = time.monotonic()
            if old is not None:
                old.retired = True
            free_old = old is not None and old.refs == 0
            self._wake()
        if self.baseline_rss is None:
            self.baseline_rss = process_rss()
        if free_old and old is not None:
            self._free(old)
        return gen

    def stage(self, loaded: LoadedModel, plan: Plan | None, revision: int, strategy: str,
              serving: ServingSpec) -> Generation:
        """Hold ``loaded`` beside the current generation as the candidate, taking no requests yet (a candidate
        left from before is given up first: never overwritten while it holds memory)."""
        self.discard()
        gen = self._numbered(loaded, plan, revision, strategy, serving)
        with self._cond:
            self._candidate, self._split = gen, Split(0)
            self._made.append(gen)
        return gen

    def route(self, percent: int) -> None:
        """Send ``percent`` of new pins to the candidate (a running request stays where it started)."""
        with self._cond:
            self._split = Split(percent)

    def promote(self) -> Generation:
        """The candidate becomes the current generation; the old one is freed once its last caller leaves."""
        with self._cond:
            gen, self._candidate = self._candidate, None
            assert gen is not None, "no candidate to promote"
            old, self._current = self._current, gen
            if old is not None:
                old.retired = True
            free_old = old is not None and old.refs == 0
            self._wake()
        if free_old and old is not None:
            self._free(old)
        return gen

    def discard(self) -> None:
        """Give up the candidate: no new pin gets it, and it is freed once its last caller leaves."""
        with self._cond:
            gen, self._candidate = self._candidate, None
            if gen is None:
                return
            gen.retired = True
            free = gen.refs == 0
            self._cond.notify_all()
        if free:
            self._free(gen)

    def drain(self, timeout: float) -> None:
        """Stop handing out the current generation, wait up to ``timeout`` for its callers, free it."""
        with self._cond:
            old, self._current = self._current, None
            if old is None:
                return
            old.retired = True
            deadline = time.monotonic() + timeout
            while old.refs > 0 and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if old.refs > 0:
                log.warning("%s: %d request(s) still in flight after %gs; freeing when they end",
                            self.name, old.refs, timeout)
                return
        self._free(old)

    def unload(self, then: Callable[[bool], None]) -> Future[bool]:
        """Unload the current generation if no caller holds it, on the owner's change thread (``owner``:
        the deployment's ``ChangeWorker.submit``; the host asks, the owner does), then call
        ``then(unloaded)`` there. The future ends after that, with whether it unloaded. The request is for
        the generation current now: if another is current when its turn comes (it waited behind a rollout),
        it is stale and unloads nothing."""
        target = self._current

        def job() -> bool:
            unloaded = target is not None and self.unload_now(target)
            then(unloaded)
            return unloaded

        try:
            return self.owner(job)
        except ApplyError:  # its change thread has stopped: it is closing, and unloads itself
            then(False)
            return _run_here(lambda: False)

    def unload_now(self, target: Generation | None = None) -> bool:
        """On the owner's change thread: unload and free the current generation if no caller holds it
        (checked and done under the pool's lock, so a request pinning it at the same moment either wins,
        or finds it unloaded and asks for a load); nothing when ``target`` is given and no longer current."""
        with self._cond:
            gen = self._current
            if gen is None or gen.refs > 0 or self._closed or (target is not None and gen is not target):
                return False
            self._current, self.unloaded, gen.retired = None, True, True
            self._unloading = gen  # the host counts it as loaded until this unload answers
            self._wake()
        try:
            self._free(gen)  # the drain/free path, with the leak guard
        finally:
            with self._cond:
                self._unloading = None
        return True

    def retiring(self) -> list[Plan | None]:
        """The plans of the generations that no longer serve but are still in memory (``budget.host.Held``):
        draining or retired with callers left, a discarded candidate, or being freed."""
        with self._cond:
            self._made = [g for g in self._made if g.loaded is not None]
            return [g.plan for g in self._made
                    if g is not self._current and g is not self._candidate and g is not self._unloading]

    def mark_unloaded(self) -> None:
        """Nothing is loaded and nothing should wait for a load (an on-demand deployment not yet used)."""
        with self._cond:
            if self._current is None:
                self.unloaded = True
                self._wake()

    def close(self, timeout: float) -> None:
        self.discard()
        self.drain(timeout)
        with self._cond:
            self._closed = True
            self._wake()
        left = self._frees.join(timeout)
        if left:
            log.warning("%s: still freeing after %gs: %s", self.name, timeout, ", ".join(left))

    def _free(self, gen: Generation) -> None:
        with self._cond:
            if gen.loaded is None or gen.freeing:
                return
            gen.freeing = True
            runtime, gen.runtime = gen.runtime, None
        try:
            if runtime is not None:
                runtime.close()  # its in-flight requests held pins: none are left
        except Exception:
            # Freeing is the last step of an unload, a swap or a close: whatever close could not stop (it
            # says what), the generation's references still go, or it would stay "freeing" with its model
            # held and no way to free it again.
            log.exception("%s: closing generation %d's engine failed; its model is released anyway",
                          self.name, gen.number)
        del runtime  # this frame's reference would keep the model alive past empty_cache below
        with self._cond:
            gen.loaded, gen.freeing = None, False
        return_memory()
        self._check_memory(gen)

    def _check_memory(self, freed: Generation) -> None:
        """Leak guard: after a generation is freed, RSS should be near the first generation's."""
        rss = process_rss()
        current = self._current if self._current is not None else freed  # an unload: nothing current
        model_bytes = sum(d.bytes for d in current.plan.devices) if current.plan else 0
        self.memory.append((freed.number, rss))
        if self.baseline_rss is None or not model_bytes:
            return
        report_reclaimed(self.name, freed.number, rss=rss, baseline=self.baseline_rss, model_bytes=model_bytes)
