"""What ``Host`` (``host.py``) knows of each deployment and hands out: the ``Held`` protocol a deployment's
pool answers, an ``Entry`` per deployment, what a ``Grant`` reserved, what ``Host.register`` was told
(``Registration``) and what ``deploykit status`` shows (``BudgetView``). Values only: no threads, no clock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ...placement.plan import Plan

Shrink = Callable[[Mapping[str, int]], dict[str, int]]


class Held(Protocol):
    """What the host may ask of a deployment's generations (``live.pool.GenerationPool`` is one): whether
    one is loaded and how many callers hold it, when it was last used, and to unload it (the owner does,
    on its own change thread: the host never changes what a deployment has loaded itself)."""

    @property
    def loaded(self) -> bool: ...

    @property
    def in_use(self) -> int: ...

    @property
    def last_used(self) -> float: ...

    def unload(self, then: Callable[[bool], None]) -> Future[bool]:
        """Unload what is current now if it is idle when its turn comes, on the owner's change thread (the
        one writer of what is loaded), and call ``then(unloaded)`` there; the future ends after it, with
        whether it did. An unload that finds another generation current by then is stale: it does nothing."""

    @property
    def plan(self) -> Plan | None:
        """The current generation's plan (None when none is current)."""

    def retiring(self) -> list[Plan | None]:
        """The plans of the generations no longer current that are still in memory (draining, or retired and
        not yet freed): the budget counts them until they are freed."""


UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"


@dataclass(frozen=True)
class Grant:
    """What ``Host.room`` reserved: ``bytes`` per tier and, where the load's default prefix cache was shrunk
    to fit (``shrink``), ``left``: the room per tier the budget left it beside the others, which its plan is
    fitted to (``tiers.fit_prefix_cache``); None: the plan as it was asked for."""

    bytes: dict[str, int]
    left: dict[str, int] | None = None


@dataclass(frozen=True)
class BudgetView:
    """One deployment under the budget, as ``deploykit status`` shows it."""

    state: str  # unloaded | loading | loaded
    bytes: int
    tiers: dict[str, int]
    priority: int
    keep_alive: float | None
    idle_seconds: float  # since its last request
    keep_alive_left: float | None
    busy: int  # requests holding or waiting for it, a load or a rollout under way
    waiting: str | None = None  # why its load waits for room, while it does ("waiting for room: ...")


@dataclass(frozen=True)
class Registration:
    """What ``Host.register`` was last told of a deployment (``Host.registration``): to tell it again."""

    need: dict[str, int]
    priority: int
    keep_alive: float | None
    shrink: Shrink | None


@dataclass
class Entry:
    """What the host knows of one deployment."""

    name: str
    pool: Held
    bytes: dict[str, int]  # per tier, of the plan that serves (or will)
    priority: int = 0
    keep_alive: float | None = None
    state: str = UNLOADED
    waiting: int = 0  # requests waiting for this deployment to load (they count as busy)
    rolling: bool = False  # a rollout holds it: never unloaded meanwhile
    extra: dict[str, int] = field(default_factory=dict)  # a blue-green rollout's next generation
    load_lock: threading.Lock = field(default_factory=threading.Lock)
    unloading: bool = False  # its owner was asked to unload it and has not answered yet
    want: dict[str, int] = field(default_factory=dict)  # what its next load asks for (its plan, as registered)
    shrink: Shrink | None = None  # its need with the default prefix cache fitted to the room left
    waiting_for_room: str | None = None  # a load of it waits for room: why (status shows it)
    # during a blue-green rollout, the plan of the generation that served when it began: ``bytes`` counts it
    # until the rollout ends, also once it retires (so ``retiring`` must not count it twice)
    counted: Plan | None = None

    def busy(self) -> int:
        return self.pool.in_use + self.waiting + (self.state == LOADING) + self.rolling
