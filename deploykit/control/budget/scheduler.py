"""Which deployments to unload to make room for one, and which have been idle past their keep-alive.

Pure decisions over small values (no clock, no locks, no I/O), tested as tables; ``budget.host`` does
what they say. The rules (docs/budget.md), after Ollama's ``server/sched.go`` but with exact bytes:

- a deployment that alone exceeds the budget can never load (``Never``);
- one that fits beside the loaded ones unloads nothing (``Room(())``);
- otherwise idle loaded deployments (no request running, queued or waiting) whose priority is at most
  the requester's are unloaded, lowest priority first, then least recently used, skipping those that
  hold nothing in a tier that is short, until it fits (``Room(names)``);
- if even all of those would not make room, nothing is unloaded and the request waits (``Wait``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...units import format_size
from .tiers import Budget


@dataclass(frozen=True)
class Resident:
    """A deployment holding (or reserving, while it loads) memory."""

    name: str
    bytes: Mapping[str, int]  # per tier
    priority: int = 0
    last_used: float = 0.0  # when its last request ended (any monotonic clock)
    busy: int = 0  # requests running, queued or waiting for it; a load in progress counts as busy
    keep_alive: float | None = None  # seconds; None: forever


@dataclass(frozen=True)
class Want:
    """A deployment asking for room: a request for it, an eager start, or a rollout's new generation."""

    name: str
    bytes: Mapping[str, int]
    priority: int = 0


@dataclass(frozen=True)
class Room:
    """Unload these (in order), then load."""

    unload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wait:
    """No room can be made now; try again when something is unloaded or becomes idle."""

    reason: str


@dataclass(frozen=True)
class Never:
    """The deployment alone exceeds the budget."""

    reason: str


def _free(budget: Budget, residents: Iterable[Resident]) -> dict[str, int]:
    free = dict(budget.tiers)
    for r in residents:
        for tier, b in r.bytes.items():
            if tier in free:
                free[tier] -= b
    return free


def _short(free: Mapping[str, int], need: Mapping[str, int]) -> dict[str, int]:
    return {t: b - free[t] for t, b in need.items() if t in free and b > free[t]}  # unlisted: unlimited


def _describe(short: Mapping[str, int]) -> str:
    return ", ".join(f"{t} short by {format_size(b)}" for t, b in sorted(short.items()))


def evictable(residents: Iterable[Resident], want: Want) -> list[Resident]:
    """The residents that may be unloaded for ``want``, in the order they would be: idle ones of
    priority <= the requester's, lowest priority first, then least recently used (then by name, so
    ties are stable)."""
    return sorted((r for r in residents if r.name != want.name and r.busy == 0 and r.priority <= want.priority),
                  key=lambda r: (r.priority, r.last_used, r.name))


def make_room(budget: Budget, residents: Sequence[Resident], want: Want) -> Room | Wait | Never:
    """What to unload so that ``want`` fits in ``budget`` beside ``residents``. See the module docstring."""
    over = budget.over(want.bytes)
    if over:
        return Never(f"{want.name} needs {_sizes(want.bytes)} alone, more than {budget.describe()} allows "
                     f"({_describe(over)})")
    free = _free(budget, (r for r in residents if r.name != want.name))
    short = _short(free, want.bytes)
    if not short:
        return Room(())
    chosen: list[str] = []
    for r in evictable(residents, want):
        if not any(r.bytes.get(t, 0) for t in short):
            continue  # unloading it frees nothing where room is missing
        chosen.append(r.name)
        for tier, b in r.bytes.items():
            if tier in free:
                free[tier] += b
        short = _short(free, want.bytes)
        if not short:
            return Room(tuple(chosen))
    held = ", ".join(f"{r.name} ({'busy' if r.busy else f'priority {r.priority}'})"
                     for r in residents if r.name != want.name) or "nothing"
    return Wait(f"{want.name} needs {_sizes(want.bytes)}; {budget.describe()} is held by {held}: "
                f"{_describe(_short(_free(budget, residents), want.bytes))} and nothing idle of priority <= "
                f"{want.priority} can be unloaded")


def expired(residents: Iterable[Resident], now: float) -> list[str]:
    """Idle residents whose keep-alive has passed since their last request ended, longest idle first."""
    due = [r for r in residents if r.busy == 0 and r.keep_alive is not None and now - r.last_used >= r.keep_alive]
    return [r.name for r in sorted(due, key=lambda r: (r.last_used, r.name))]


def _sizes(need: Mapping[str, int]) -> str:
    return ", ".join(f"{t}={format_size(b)}" for t, b in sorted(need.items())) or "nothing"
