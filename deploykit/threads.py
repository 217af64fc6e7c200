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


def release_openmp_threads() -> None:
    """Hand back the OpenMP worker threads the calling thread started (``omp_pause_resource_all``,
    OpenMP 5.0), for a thread that ran torch work it will not repeat soon (a load, a reshard, scoring).

    Why: every thread that runs a parallel torch operation gets its own team of OpenMP threads, kept
    until that thread ends. Once a process holds more OpenMP threads than CPUs, GNU OpenMP stops
    spinning between parallel regions (its "throttled" spin count), so every region of the engine thread
    then pays a futex wake-up. Measured on 2 cores, SmolLM2-135M with int8 layers: torch's int8 matmul
    took 2-3x as long, and one user's decoding ran at 35 tok/s instead of 58, merely because the thread
    that loaded the model was still alive (bench/openmp_teams.py). Without an OpenMP runtime in
    the process (no torch yet, or another threading layer) this does nothing."""
    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft: the threads end; the next parallel region starts new ones


_PAUSE: list[Callable[[int], int] | None] = []


def _omp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime loaded in this process (looked up once it is)."""
    if _PAUSE:
        return _PAUSE[0]
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:  # not Linux
        return None
    runtimes = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp", "libomp")))
    if not runtimes:
        return None  # nothing loaded one yet: look again next time
    try:
        fn = ctypes.CDLL(runtimes[0]).omp_pause_resource_all
    except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
        _PAUSE.append(None)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    _PAUSE.append(fn)
    return fn
