"""The one thread that changes a deployment: every start, reload, apply, rollback and close runs on it, in
the order asked, so no two changes of one deployment ever interleave and its state has one writer.

``call(fn)`` runs ``fn`` on the worker and returns (or raises) what it did (``submit(fn)``: a future of it,
for a caller that must not block); a call from the worker itself runs at once (a change that asks for
another part of itself). ``request(fn)`` asks for ``fn`` to run once soon without waiting (a file changed);
requests made while one waits coalesce into one run. ``stop`` runs nothing more and joins the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from ...errors import ApplyError
from ...threads import release_openmp_threads

log = logging.getLogger(__name__)
T = TypeVar("T")
_Job = tuple[Callable[[], object], "Future[Any] | None"]
_STOP: _Job = (lambda: None, None)  # the sentinel that ends the loop (compared by identity)


class ChangeWorker:
    """The change thread of the deployment ``name`` (started at the first call)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._requested = False  # a coalesced request is queued and has not started
        self._stopped = False
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the worker and return its result (its exception is raised here). ``timeout``: the
        most seconds to wait for it (``TimeoutError`` then; the job still runs when its turn comes)."""
        return self.submit(fn).result(timeout)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the worker; the returned future ends with what it did (from the worker itself:
        run at once, the future already done). For a caller that must not block a thread on it."""
        future: Future[T] = Future()
        if threading.current_thread() is self._thread:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
            return future
        self._put((fn, future))
        return future

    def request(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once soon, without waiting; a request already queued covers this one."""
        with self._lock:
            if self._requested or self._stopped:
                return
            self._requested = True
        self._put((self._requested_run(fn), None))

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` after what is queued, without waiting (nothing once stopped)."""
        try:
            self._put((fn, None))
        except ApplyError:
            pass

    def _requested_run(self, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with self._lock:
                self._requested = False  # a request from now on runs again after this one
            return fn()
        return run

    def _put(self, job: _Job) -> None:
        with self._lock:
            if self._stopped:
                raise ApplyError(f"deployment {self.name!r} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"deploykit-change-{self.name}",
                                                daemon=True)
                self._thread.start()
            self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, future = job
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # the caller gets it; a background request only logs it
                if future is None:
                    log.exception("change of %s failed", self.name)
                else:
                    future.set_exception(exc)
                continue
            finally:  # a load or reshard must not leave OpenMP threads that slow the engine's
                release_openmp_threads()
            if future is not None:
                future.set_result(result)

    def stop(self, timeout: float = 60.0) -> None:
        """Run nothing more after what is queued now, and join the thread (from any other thread)."""
        with self._lock:
            self._stopped = True
            thread = self._thread
            self._jobs.put(_STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the change thread of %s is still running after %gs", self.name, timeout)
