"""Threads with an owner: a ``ThreadGroup`` starts them and its owner joins them all when it closes, so
nothing deploykit starts outlives what started it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ThreadGroup:
    """The threads one owner started (finished ones are dropped as new ones start)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def start(self, target: Callable[..., object], *args: object, name: str) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
        thread.start()
        return thread

    def join(self, timeout: float) -> list[str]:
        """Join every thread (up to ``timeout`` in all); the names of those still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        return sorted(t.name for t in threads if t.is_alive() and t is not threading.current_thread())
