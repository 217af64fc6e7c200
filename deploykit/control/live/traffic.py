"""What one generation's requests did, for a canary's traffic gates, and how new requests are split
between two generations.

``TrafficLog`` is written by the serving layer (and the library's calls) as each request ends (its time to
first token, whether it failed with a 5xx), often on the event loop: a record is O(log n) under a short lock
and never scans what came before. What a canary reads is kept as it goes: it opens a ``Tally`` when a window
begins (a step, the whole canary), every record from then on is added to each open tally (a count, a count
of failures, and the exact nearest-rank 95th percentile of the times to first token kept by two heaps), and
reading one is O(1). ``watch`` is the canary's wake-up. ``Split`` decides,
request by request, whether a new request goes to the new generation: deterministic (the k-th request of a
step goes to the new generation when ``floor((k + 1) * p) > floor(k * p)``), so a step's measured share is
its configured one to within one request, where a random draw would wander by several points on the few
hundred requests of a short step.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficWindow:
    """The requests of one generation in a time window: how many, how many failed (5xx), and their times to
    first token (seconds; requests that produced no token have none): either the values (``ttfts``) or,
    from a running ``Tally``, their 95th percentile alone (``p95_ttft``)."""

    requests: int
    failures: int
    ttfts: tuple[float, ...] = ()
    p95_ttft: float | None = None

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def ttft_p95(self) -> float | None:
        return self.p95_ttft if self.p95_ttft is not None else p95(self.ttfts)


def p95(values: tuple[float, ...]) -> float | None:
    """The 95th percentile by nearest rank (the value at rank ceil(0.95 n)); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


class Tally:
    """Running aggregates of the requests recorded since it was opened (``TrafficLog.tally``). The 95th
    percentile by nearest rank is kept exactly: ``_low`` (a max-heap, negated) holds the ceil(0.95 n)
    smallest times, ``_high`` the rest; the percentile is the largest of ``_low``. Written under the log's
    lock only."""

    def __init__(self, log: TrafficLog) -> None:
        self._log = log
        self.requests = 0
        self.failures = 0
        self._low: list[float] = []
        self._high: list[float] = []

    def add(self, ttft: float | None, failed: bool) -> None:
        self.requests += 1
        self.failures += failed
        if ttft is None:
            return
        if self._low and ttft > -self._low[0]:
            heapq.heappush(self._high, ttft)
        else:
            heapq.heappush(self._low, -ttft)
        rank = math.ceil(0.95 * (len(self._low) + len(self._high)))
        while len(self._low) > rank:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        while len(self._low) < rank:
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def window(self) -> TrafficWindow:
        with self._log.lock:
            return TrafficWindow(self.requests, self.failures, (), -self._low[0] if self._low else None)

    def close(self) -> None:
        """Stop adding to it (its window stays readable)."""
        self._log.untally(self)


class TrafficLog:
    """The ended requests of one generation: a total, and the running tallies readers opened; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._tallies: list[Tally] = []
        self.total = 0
        self.watch: Callable[[], None] | None = None  # called after each record (a canary waiting on its step)

    def record(self, *, ttft: float | None, failed: bool) -> None:
        with self.lock:
            self.total += 1
            for tally in self._tallies:
                tally.add(ttft, failed)
            watch = self.watch
        if watch is not None:
            watch()

    def tally(self) -> Tally:
        """Running aggregates of every request recorded from now on, until ``Tally.close``."""
        tally = Tally(self)
        with self.lock:
            self._tallies.append(tally)
        return tally

    def untally(self, tally: Tally) -> None:
        with self.lock:
            if tally in self._tallies:
                self._tallies.remove(tally)


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
