"""The watchdog of one llama.cpp generation: it owns the running ``llama-server`` after its first start,
finds it dead or hung, replaces it with bounded, backed-off restarts, and tells requests when to use it.

- **Death** is only what the process says: its exit status (a broken or refused connection in a request
  only wakes the watchdog, which then waits briefly for that status). A connect timeout under load is not a
  death.
- **Hung** is a process that runs but has not answered ``/health`` (llama-server answers it from its HTTP
  threads, loaded or not) for ``HUNG_AFTER_SECONDS``, each poll read with a timeout. A hung process is killed
  (SIGKILL: a stopped process never handles SIGTERM), which also breaks its in-flight requests at once.
- **Stalled** is a process whose HTTP threads answer ``/health`` while its decode loop is stuck (a kernel that
  never returns, a deadlock in the loop): requests in flight get no token, and new ones queue behind them.
  While deploykit has requests in flight there (``busy``), the watchdog asks the loop itself (``/slots``, which
  llama-server answers from the loop between two decode steps); no answer for ``STALLED_AFTER_SECONDS`` (longer
  than one decode step of any sane batch) is a stall: the process is killed and replaced like a hung one.
- **Restarts run on the watchdog's own thread**, never in a request's: a request that finds the engine
  starting or restarting waits on the state (an asyncio future, no worker thread held) for at most its bound,
  then gets ``EngineUnavailable`` (a 503 with Retry-After). After a death the first restart is immediate unless
  the last one was recent (a crash loop), then the delay doubles up to ``BACKOFF_MAX_SECONDS``;
  ``RESTART_ATTEMPTS`` failed starts in a row leave the engine ``failed`` with the reason: every request is
  answered at once (503), the deployment shows Degraded and ``/readyz`` 503, and the watchdog keeps trying, one
  start every ``FAILED_RETRY_SECONDS``, until one works (then it is ready again) or the generation is closed.
- **Stopping** (``close``) sets the stop event a start in progress watches, its load and its health probe
  included: it never waits for a probe's timeout.
- Its state (``EngineState``: starting, ready, restarting, failed, closed) and reason are what ``/status``
  shows (``report``).

It never knows about HTTP routes or manifests: it is given a ``start`` function that returns a loaded,
checked ``LlamaServer`` (or raises).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .process import LlamaServer

log = logging.getLogger(__name__)
WATCH_INTERVAL_SECONDS = 1.0
HUNG_AFTER_SECONDS = 10.0
SUSPECT_WAIT_SECONDS = 2.0  # a broken connection is seen before the dying process can be reaped
RESTART_ATTEMPTS = 5
BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
STABLE_SECONDS = 60.0  # a process that served this long ends a crash loop: the next restart is immediate
RETRY_AFTER_SECONDS = 5
FAILED_RETRY_SECONDS = 30.0  # a failed engine is tried again this often, until it starts or is closed
STALLED_AFTER_SECONDS = float(os.environ.get("DEPLOYKIT_LLAMA_STALLED_AFTER", "60"))  # no decode-loop answer


class EngineState(str, Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    CLOSED = "closed"


class EngineUnavailable(Exception):
    """No ready engine within the request's bound (restarting), or none at all (failed, closed). Its text
    names the state only, for an API client; ``reason`` (the last error: argv, paths, the engine's log) is the
    operator's, shown by ``/status`` and in ``detail`` to an in-process caller."""

    def __init__(self, message: str, reason: str | None = None, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        super().__init__(message)
        self.reason, self.retry_after = reason, retry_after

    @property
    def detail(self) -> str:
        return f"{self} ({self.reason})" if self.reason else str(self)


_SEE = "; its reason: `deploykit status` (control token) or the server log"


@dataclass(frozen=True)
class EngineReport:
    """What ``/status`` shows of a generation's engine process."""

    pid: int | None
    state: EngineState
    reason: str | None
    crashes: int  # deaths and hangs found
    restarts: int  # processes started to replace them
    last_crash: str | None


class _Backoff:
    """The delay before a restart: none after a stable run, doubling within a crash loop."""

    def __init__(self) -> None:
        self.delay = 0.0
        self._last_restart = -STABLE_SECONDS

    def after_death(self) -> float:
        if time.monotonic() - self._last_restart >= STABLE_SECONDS:
            self.delay = 0.0
        return self.delay

    def failed(self) -> float:
        self.delay = min(max(self.delay * 2, BACKOFF_FIRST_SECONDS), BACKOFF_MAX_SECONDS)
        return self.delay

    def restarted(self) -> None:
        self._last_restart = time.monotonic()
        self.delay = min(max(self.delay * 2, BACKOFF_FIRST_SECONDS), BACKOFF_MAX_SECONDS)


class Supervisor:
    """Owns one generation's process from its first start (on the caller's thread: a failure there fails
    the load) to ``close``; between them, the watchdog thread is the only one that replaces it."""

    def __init__(self, start: Callable[[threading.Event], LlamaServer], *, name: str,
                 busy: Callable[[], bool] = lambda: False) -> None:
        self._start = start
        self._busy = busy  # deploykit has requests in flight on this engine now
        self._stalled_since: float | None = None  # busy, and the decode loop has not answered since
        self._cond = threading.Condition()  # reentrant (an RLock)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.state: EngineState = EngineState.STARTING
        self.reason: str | None = None
        self.crashes = self.restarts = 0
        self.last_crash: str | None = None
        self._failed_why = ""
        self._suspect = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._backoff = _Backoff()
        self._proc: LlamaServer = start(self._stop)
        self._set(EngineState.READY, None)
        self._thread = threading.Thread(target=self._watch, name=f"deploykit-llama-watchdog-{name}", daemon=True)
        self._thread.start()

    # -- what requests use ------------------------------------------------------------------------------

    @property
    def proc(self) -> LlamaServer:
        return self._proc

    def ready(self) -> LlamaServer | None:
        """The process when it is ready to use now (no wait, no thread): the common case."""
        with self._cond:
            return self._proc if self.state is EngineState.READY and not self._suspect else None

    async def wait_ready(self, timeout: float) -> LlamaServer:
        """The ready process, waiting up to ``timeout`` on the event loop (no thread held) while it starts
        or restarts; ``EngineUnavailable`` when it is not ready by then, failed or closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            with self._cond:
                proc = self._usable()
                if proc is not None:
                    return proc
                future = loop.create_future()
                self._waiters.append((loop, future))
            try:
                await asyncio.wait({future}, timeout=max(0.0, deadline - loop.time()))
            finally:
                with self._cond:
                    self._waiters = [w for w in self._waiters if w[1] is not future]
            if loop.time() >= deadline:
                with self._cond:
                    proc = self._usable()
                if proc is not None:
                    return proc
                raise EngineUnavailable(f"the llama.cpp engine is {self.state.value}; it was not ready within "
                                        f"{timeout:g}s", self.reason)

    def wait_ready_blocking(self, timeout: float) -> LlamaServer:
        """``wait_ready`` for a caller on its own thread (the library's ``Deployment.chat``)."""
        with self._cond:
            self._cond.wait_for(lambda: self.state not in (EngineState.STARTING, EngineState.RESTARTING)
                                and not self._suspect, timeout)
            proc = self._usable()
        if proc is None:
            raise EngineUnavailable(f"the llama.cpp engine is {self.state.value}{_SEE}", self.reason)
        return proc

    def _usable(self) -> LlamaServer | None:
        """Under the lock: the process if ready; raises when it never will be."""
        if self.state in (EngineState.FAILED, EngineState.CLOSED):
            raise EngineUnavailable(f"the llama.cpp engine is {self.state.value}{_SEE}", self.reason)
        return self._proc if self.state is EngineState.READY and not self._suspect else None

    def connection_broke(self, proc: LlamaServer) -> None:
        """A request's connection to ``proc`` broke or was refused: if it is the serving process, requests
        wait while the watchdog checks it (a process already replaced needs no check)."""
        with self._cond:
            if proc is not self._proc or self.state is not EngineState.READY:
                return
            self._suspect = True
        self._wake.set()

    def report(self) -> EngineReport:
        with self._cond:
            return EngineReport(self._proc.pid, self.state, self.reason, self.crashes, self.restarts,
                                self.last_crash)

    def close(self) -> None:
        """Stop the watchdog (interrupting a restart), then the process. Idempotent."""
        self._set(EngineState.CLOSED, "the generation was closed")
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._proc.stop()

    # -- the watchdog thread ----------------------------------------------------------------------------

    def _set(self, state: EngineState, reason: str | None) -> None:
        with self._cond:
            if self.state is EngineState.CLOSED:
                return
            self.state, self.reason = state, reason
            self._suspect = False  # a new state, or the check of a suspect process, is the verdict
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def _watch(self) -> None:
        last_healthy = time.monotonic()
        while True:
            if self.state is EngineState.FAILED:
                if self._stop.wait(FAILED_RETRY_SECONDS):
                    return
                self._retry_failed()
                last_healthy = time.monotonic()
                continue
            self._wake.wait(WATCH_INTERVAL_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                return
            if self.state is not EngineState.READY:
                continue
            why, last_healthy = self._verdict(last_healthy)
            if why is None:
                why = self._stall()
            if why is not None:
                self._replace(why)
                last_healthy = time.monotonic()

    def _verdict(self, last_healthy: float) -> tuple[str | None, float]:
        """Why the process must be replaced (None: it serves), and when it last answered ``/health``."""
        proc = self._proc
        status = proc.wait_exit(SUSPECT_WAIT_SECONDS) if self._suspect else proc.exit_status()
        if status is not None:
            return f"llama-server pid {proc.pid} exited with status {status}", last_healthy
        if proc.healthy():
            self._clear_suspect()
            return None, time.monotonic()
        self._clear_suspect()  # alive: a broken connection alone is not a death
        if time.monotonic() - last_healthy >= HUNG_AFTER_SECONDS:
            return (f"llama-server pid {proc.pid} did not answer /health for {HUNG_AFTER_SECONDS:g}s "
                    "(hung); it was killed"), last_healthy
        return None, last_healthy

    def _stall(self) -> str | None:
        """Why the process must be replaced for a stuck decode loop (None: it progresses, or has no work)."""
        if not self._busy() or self._proc.loop_answers():
            self._stalled_since = None
            return None
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        if now - self._stalled_since < STALLED_AFTER_SECONDS:
            return None
        self._stalled_since = None
        return (f"llama-server pid {self._proc.pid} made no progress on the requests in flight for "
                f"{STALLED_AFTER_SECONDS:g}s (its decode loop did not answer; stalled); it was killed")

    def _clear_suspect(self) -> None:
        with self._cond:
            if not self._suspect:
                return
            self._suspect = False
        self._set(self.state, self.reason)  # wakes the requests that waited on the check

    def _replace(self, why: str) -> None:
        """End the process, then start another with backoff; ``failed`` after ``RESTART_ATTEMPTS``."""
        with self._cond:
            self.crashes += 1
            self.last_crash = why
        log.warning("%s; starting a fresh one", why)
        self._set(EngineState.RESTARTING, why)
        self._proc.stop(grace=0)  # SIGKILL: a hung (or stopped) process ignores SIGTERM
        delay, error = self._backoff.after_death(), ""
        for _ in range(RESTART_ATTEMPTS):
            if delay and self._stop.wait(delay):
                return
            failure = self._try_start()
            if failure is None or self._stop.is_set():
                return
            error = failure
            delay = self._backoff.failed()  # the reason is kept; the next attempt waits longer
        self._failed_why = f"{why}; {RESTART_ATTEMPTS} restarts failed"
        self._set(EngineState.FAILED, f"{self._failed_why}, the last: {error[:500]}; retrying every "
                                      f"{FAILED_RETRY_SECONDS:g}s")
        log.error("llama-server could not be restarted: %s", self.reason)

    def _retry_failed(self) -> None:
        """One more start of a failed engine (every ``FAILED_RETRY_SECONDS``): ready again when it works."""
        error = self._try_start()
        if error is not None and not self._stop.is_set():
            self._set(EngineState.FAILED, f"{self._failed_why}, the last: {error[:500]}; retrying every "
                                          f"{FAILED_RETRY_SECONDS:g}s")

    def _try_start(self) -> str | None:
        """Start a fresh process and serve it (None), or say why it could not start."""
        try:
            proc = self._start(self._stop)
        except Exception as exc:
            log.warning("restarting llama-server failed: %s", exc)
            return str(exc)
        with self._cond:
            if self.state is EngineState.CLOSED:  # closed while it started: not served
                proc.stop(grace=0)
                return None
            self._proc = proc
            self.restarts += 1
        self._backoff.restarted()
        self._set(EngineState.READY, None)
        return None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
