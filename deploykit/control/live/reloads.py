"""The reloads of one ``Deployment``: what each did (``ReloadRecord``, timed by ``ReloadClock``), the
recent ones and the counts (``ReloadLog``, read by ``status()`` and the Prometheus metrics), how a
failure reads for the user (``describe``) and
where the state store keeps it (``store_failure``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import DeploykitError, ManifestError, PlanInfeasible
from ...placement.inventory import process_rss

if TYPE_CHECKING:
    from ...spec.manifest import LoadedManifest
    from ..revisions.state import StateStore

log = logging.getLogger(__name__)
RELOAD_HISTORY = 100  # reload records kept in memory


@dataclass(frozen=True)
class ReloadRecord:
    generation: int
    revision: int | None
    ok: bool
    seconds: float
    strategy: str
    error: str | None = None
    rss_before: int | None = None
    rss_after: int | None = None


class ReloadLog:
    """The latest ``RELOAD_HISTORY`` reloads (``records``, oldest first) and the counts since start:
    every reload that swapped or failed (``count``), and those that failed (``failures``)."""

    def __init__(self, keep: int = RELOAD_HISTORY) -> None:
        self._lock = threading.Lock()  # the change thread appends while /status and /metrics read
        self._records: deque[ReloadRecord] = deque(maxlen=keep)
        self.count = 0
        self.failures = 0

    def record(self, record: ReloadRecord) -> None:
        with self._lock:
            if not record.ok:
                self.failures += 1
            self.count += 1
            self._records.append(record)

    @property
    def records(self) -> tuple[ReloadRecord, ...]:
        """A copy, oldest first (a reader never iterates what the change thread appends to)."""
        with self._lock:
            return tuple(self._records)

    def summary(self) -> dict[str, float]:
        """Counts and the longest reload, read together."""
        with self._lock:
            longest = max((r.seconds for r in self._records), default=0.0)
            return {"total": self.count, "failed": self.failures, "longest_seconds": round(longest, 3)}


class ReloadClock:
    """When a reload started and the process's RSS then; ``record`` what the reload did once it ends."""

    def __init__(self) -> None:
        self.started, self.rss_before = time.perf_counter(), process_rss()

    def record(self, log: ReloadLog, generation: int, revision: int | None, ok: bool, strategy: str,
               error: str | None = None) -> None:
        log.record(ReloadRecord(generation, revision, ok, time.perf_counter() - self.started, strategy, error,
                                self.rss_before, process_rss()))


def describe(exc: Exception, loaded: LoadedManifest | None) -> str:
    """An error as the user should read it: with file:line:column where the manifest is to blame."""
    if isinstance(exc, ManifestError):
        return "\n".join(str(i) for i in exc.issues)
    if isinstance(exc, PlanInfeasible) and exc.field and loaded is not None:
        return loaded.located(exc.field, str(exc))
    if not isinstance(exc, DeploykitError):
        return f"internal error: {type(exc).__name__}: {exc}"
    return str(exc)


def store_failure(store: StateStore, name: str, exc: Exception, loaded: LoadedManifest | None, error: str) -> None:
    """Keep a failed reload's ``error`` where ``deploykit status`` reads it (a recorded deployment only):
    a change that cannot become a revision as its pending error, any other as a ``ReloadFailed`` event."""
    if name and store.deployment(name) is not None:
        if isinstance(exc, (ManifestError, PlanInfeasible)) or loaded is None:
            store.set_pending_error(name, error)
        else:
            store.record_event(name, "ReloadFailed", error)
