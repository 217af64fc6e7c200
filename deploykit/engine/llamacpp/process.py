"""One ``llama-server`` process: its flags, starting it, waiting for it to load, and stopping it.

Each generation of a llama.cpp deployment owns one such process (llama-swap's ``proxy/process.go`` is the
anchor): on loopback, on a free port, with an API key of its own (passed in its environment, not on its
command line, so ``ps`` does not show it), in a process group of its own (``setsid``: a terminal's Ctrl-C
does not reach it behind deploykit's back), and with ``PR_SET_PDEATHSIG`` so that a deploykit killed with
SIGKILL leaves no server behind. The death signal follows the *thread* that forked, so every process is
forked by one spawner thread that lives exactly as long as any process it started (started with the first,
joined when the last is stopped). ``stop`` ends the process group: SIGTERM, then SIGKILL. The environment's
``LLAMA_ARG_*`` variables are dropped: only the flags built here apply.

It must never speak HTTP beyond the readiness probe (that is ``client``'s) nor know about manifests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ...errors import ApplyError
from .flags import PlacementFlags

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
STOP_GRACE_SECONDS = 5.0
LOG_TAIL_BYTES = 4000


@dataclass(frozen=True)
class ServerOptions:
    """The flags of one llama-server: deploykit's plan and ``spec.engine`` decide every one of them."""

    binary: Path
    model: Path
    slots: int = 4
    context: int = 4096  # per slot; the server's context is slots x context, not shared between slots
    threads: int | None = None
    batch_size: int = 512
    placement: PlacementFlags = field(default_factory=lambda: PlacementFlags(0, (), (), 0))  # the plan's GPU layers

    def flags(self) -> list[str]:
        """llama-server's arguments, without host, port and key."""
        args = ["--model", str(self.model), "--parallel", str(self.slots),
                "--ctx-size", str(self.slots * self.context), "--no-kv-unified",
                "--batch-size", str(self.batch_size), "--ubatch-size", str(self.batch_size),
                "--fit", "off", "--cache-ram", "0", "--jinja", "--no-webui", *self.placement.as_args()]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        return args


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Spawner:
    """The thread that forks llama-server processes. A child's PR_SET_PDEATHSIG fires when the *thread* that
    forked it ends, so this thread lives exactly as long as any process it started: it is started with the
    first and joined when the last one is released."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]] | None] = queue.Queue()
        self._live = 0

    def run(self, job: Callable[[], Any]) -> Any:
        """``job()`` (a fork) on the spawner thread; the caller ``release``s it once its process ended."""
        with self._lock:
            if self._thread is None:
                self._jobs = queue.Queue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,), daemon=True,
                                                name="deploykit-llama-spawner")
                self._thread.start()
            jobs = self._jobs
            self._live += 1  # reserved before the job is queued: a release meanwhile keeps the thread
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        jobs.put((job, answer))
        result = answer.get()
        if isinstance(result, BaseException):
            self.release()
            raise result
        return result

    def release(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live > 0 or self._thread is None:
                return
            thread, jobs, self._thread = self._thread, self._jobs, None
        jobs.put(None)
        thread.join()

    @staticmethod
    def _loop(jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]] | None]) -> None:
        while (item := jobs.get()) is not None:
            job, answer = item
            try:
                answer.put(job())
            except BaseException as exc:  # handed to the caller
                answer.put(exc)


_spawner = _Spawner()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _environment(api_key: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    env["LLAMA_API_KEY"] = api_key
    return env


class LlamaServer:
    """A started llama-server process (``start``), ready once ``wait_ready`` returns; ``stop`` ends it."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.api_key = secrets.token_urlsafe(24)
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._stopped_status: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exit_status(self) -> int | None:
        """None while it runs; its exit status (negative: the signal) once it has ended (or was stopped)."""
        proc = self._proc
        return self._stopped_status if proc is None else proc.poll()

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process has ended, waiting up to ``timeout`` (None: it still runs). A
        connection broken by a dying process is seen before the process can be reaped."""
        proc = self._proc
        if proc is None:
            return self._stopped_status
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def start(self) -> None:
        self.port = free_port()
        self._log = tempfile.TemporaryFile(prefix="deploykit-llama-")
        argv = [str(self.options.binary), "--host", "127.0.0.1", "--port", str(self.port), *self.options.flags()]
        log_file = self._log
        self._proc = _spawner.run(lambda: subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=_environment(self.api_key),
            start_new_session=True, preexec_fn=_die_with_parent))
        log.info("started llama-server pid %s on port %d: %s", self.pid, self.port, " ".join(argv[1:]))

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200 (the model is loaded); ApplyError if the process ended or
        the time ran out (with the end of its log)."""
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            status = self.exit_status()
            if status is not None:
                raise ApplyError(f"llama-server exited with status {status} while loading: {self.log_tail()}")
            if self._healthy():
                return time.monotonic() - start
            time.sleep(0.05)
        raise ApplyError(f"llama-server did not load within {timeout:g}s: {self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):  # refused while starting, 503 while loading
            return False

    def log_tail(self) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - LOG_TAIL_BYTES))
            return self._log.read().decode(errors="replace").strip()[-LOG_TAIL_BYTES:]
        except (OSError, ValueError):
            return ""

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """End the process group (SIGTERM, then SIGKILL after ``grace``) and reap it. Idempotent."""
        proc = self._proc
        if proc is not None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(grace)
            log.info("llama-server pid %d stopped (status %s)", proc.pid, proc.returncode)
            self._proc, self._stopped_status = None, proc.returncode
            _spawner.release()
        if self._log is not None:
            self._log.close()
            self._log = None


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # setsid made it a group leader: the group id is its pid
    except ProcessLookupError:
        pass
