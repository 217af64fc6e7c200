"""One change of a name at a time, across the ways a supervisor changes deployments (an API apply,
a rollback, a delete, a restore, a file's reconcile); the one that waits hears what it waits for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Turns:
    """Thread-safe: a lock per name, and what holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._busy: dict[str, str] = {}  # name -> the change running for it now

    @contextmanager
    def exclusive(self, name: str, what: str, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Run the block as the only change of ``name``; ``on_wait`` hears what it waits for, and how long."""
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        if not lock.acquire(blocking=False):
            busy = self._busy.get(name, "another change")
            started = time.monotonic()
            if on_wait is not None:
                on_wait(f"waiting for the {busy} to finish")
            lock.acquire()
            if on_wait is not None:
                on_wait(f"waited {time.monotonic() - started:.1f}s for the {busy}")
        self._busy[name] = f"{what} of {name!r} (started {time.strftime('%H:%M:%S')})"
        try:
            yield
        finally:
            self._busy.pop(name, None)
            lock.release()
