"""What one generation's requests did, for a canary's traffic gates, and how new requests are split
between two generations.

``TrafficLog`` is written by the serving layer (and the library's calls) as each request ends (its time to
first token, whether it failed with a 5xx) and read by the canary for its step's window each time one ends
(``watch``: the canary's wake-up). ``Split`` decides,
request by request, whether a new request goes to the new generation: deterministic (the k-th request of a
step goes to the new generation when ``floor((k + 1) * p) > floor(k * p)``), so a step's measured share is
its configured one to within one request, where a random draw would wander by several points on the few
hundred requests of a short step.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

MAX_RECORDS = 100_000  # bounded: the latest requests of one generation


@dataclass(frozen=True)
class TrafficWindow:
    """The requests of one generation in a time window: how many, how many failed (5xx), and their times to
    first token (seconds; requests that produced no token have none)."""

    requests: int
    failures: int
    ttfts: tuple[float, ...]

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0


def p95(values: tuple[float, ...]) -> float | None:
    """The 95th percentile by nearest rank (the value at rank ceil(0.95 n)); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class TrafficLog:
    """The ended requests of one generation, newest last; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: deque[tuple[float, float | None, bool]] = deque(maxlen=MAX_RECORDS)
        self.total = 0
        self.watch: Callable[[], None] | None = None  # called after each record (a canary waiting on its step)

    def record(self, *, ttft: float | None, failed: bool, at: float | None = None) -> None:
        with self._lock:
            self._records.append((time.monotonic() if at is None else at, ttft, failed))
            self.total += 1
            watch = self.watch
        if watch is not None:
            watch()

    def window(self, since: float, until: float | None = None) -> TrafficWindow:
        end = math.inf if until is None else until
        with self._lock:
            rows = [r for r in self._records if since <= r[0] < end]
        return TrafficWindow(len(rows), sum(1 for r in rows if r[2]),
                             tuple(r[1] for r in rows if r[1] is not None))


class Split:
    """Which generation each new request goes to, at ``percent`` to the new one. Not thread-safe: the
    pool calls it under its lock."""

    def __init__(self, percent: int = 0) -> None:
        self.percent = percent
        self._count = 0

    def next_is_new(self) -> bool:
        k, p = self._count, self.percent
        self._count += 1
        return (k + 1) * p // 100 > k * p // 100
