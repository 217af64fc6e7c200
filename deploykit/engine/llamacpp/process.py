"""One ``llama-server`` process: its flags, starting it, waiting for it to load, and stopping it.

Each generation of a llama.cpp deployment owns one such process (llama-swap's ``proxy/process.go`` is the
anchor). What deploykit owes a process it starts:

- **No exposure, no port race**: it listens on a unix socket in a private directory (mode 0700) rather than
  a TCP port (no check-then-use free port, nothing on the network), with an API key of its own (passed in
  its environment, not on its command line, so ``ps`` does not show it).
- **A scrubbed environment**: only an allowlist of deploykit's variables reaches it (``PATH``, ``HOME``,
  locale, ``TMPDIR``, the OpenMP/ggml/CUDA settings: ``_ENV_NAMES``, ``_ENV_PREFIXES``); deploykit's control
  token and API keys, cloud and Hugging Face credentials, proxies and ``LLAMA_ARG_*`` never do.
- **A session of its own**, as ``llama-server`` started alone is (``start_new_session``: ``setsid`` in the
  child, no Python code between fork and exec). With the kernel's autogroup scheduling (on by default on
  desktop and server kernels) a session is one scheduling group: an engine inside deploykit's session
  shares one group's CPU share with deploykit's own threads (the relay, the API), unlike the llama-server
  alone it is measured against (bench/llamacpp.py). Its own session is also its own process group, so a
  terminal's Ctrl-C does not reach it behind deploykit's back.
- **It dies with deploykit**, even when deploykit is killed with SIGKILL, without Python code between fork
  and exec (``preexec_fn`` is unsafe in a threaded process; ``PR_SET_PDEATHSIG`` through ctypes there could
  deadlock, and it follows the forking *thread*, not the process): each engine has a watcher, a ``/bin/sh``
  blocked reading a pipe whose only write end deploykit holds. deploykit writes the engine's process group
  id (its pid) into the pipe as soon as it has started; when deploykit ends, however it ends, the kernel
  closes that end, the watcher reads end-of-file and kills that group. (Only a SIGKILL of deploykit
  between the engine's fork and that one write would leave it running.) A child forked with ``os.fork``
  (not ``subprocess``) would inherit the write end and delay this until it ends too.
- **A bounded log**: its output goes to a ring of its last lines (``logring``), never to a growing file.
- ``stop`` ends the process group (SIGTERM, then SIGKILL after a grace; SIGKILL at once for a hung one)
  and reaps both processes.

It must never speak HTTP beyond the readiness probe (that is ``client``'s) nor know about manifests.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ...errors import ApplyError
from .client import RelayClient, unix_client
from .flags import PlacementFlags, SpeculativeFlags
from .logring import LogRing

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 5.0
LOG_TAIL_BYTES = 4000
HEALTH_READ_TIMEOUT = 2.0  # the watchdog's /health poll
LOOP_READ_TIMEOUT = 2.0  # the watchdog's /slots poll, answered by the decode loop between two steps
SOCKET_NAME = "server.sock"  # llama-server listens on a unix socket when --host ends in .sock
SOCKET_DIR_PREFIX = "deploykit-llama-"  # <tmp>/deploykit-llama-<deploykit's pid>-<random>/server.sock
_SOCKET_DIR = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"(\d{1,10})-[A-Za-z0-9_]+")  # fullmatch
# The watcher: read the engine's process group id, wait for end-of-file on stdin (deploykit's end of the
# pipe closed: deploykit has ended), then kill that group. Only shell builtins: nothing to find on PATH.
_WATCHER = ["/bin/sh", "-c", 'read -r group || exit 0; read -r _ ; kill -s KILL -- "-$group"']
_ENV_NAMES = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "USER", "LOGNAME", "LD_LIBRARY_PATH"})
_ENV_PREFIXES = ("LC_", "OMP_", "GOMP_", "KMP_", "GGML_", "CUDA_", "HIP_", "ROCR_", "NVIDIA_")


@dataclass(frozen=True)
class ServerOptions:
    """The flags of one llama-server: deploykit's plan and ``spec.engine`` decide every one of them."""

    binary: Path
    model: Path
    slots: int = 4
    context: int = 4096  # per slot; the server's context is slots x context, not shared between slots
    threads: int | None = None
    batch_size: int = 512
    http_threads: int | None = None  # --threads-http: every admitted request and the watchdog's /health at once
    placement: PlacementFlags = field(default_factory=lambda: PlacementFlags(0, (), (), 0))  # the plan's GPU layers
    speculative: SpeculativeFlags | None = None  # spec.speculative

    def flags(self) -> list[str]:
        """llama-server's arguments, without host, port and key."""
        args = ["--model", str(self.model), "--parallel", str(self.slots),
                "--ctx-size", str(self.slots * self.context), "--no-kv-unified",
                "--batch-size", str(self.batch_size), "--ubatch-size", str(self.batch_size),
                "--fit", "off", "--cache-ram", "0", "--jinja", "--no-webui", *self.placement.as_args()]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.http_threads is not None:
            args += ["--threads-http", str(self.http_threads)]
        if self.speculative is not None:
            args += self.speculative.as_args()
        return args


def clear_stale_socket_dirs(root: Path | None = None) -> list[Path]:
    """Remove the socket directories under ``root`` (the temporary directory) that a deploykit process left
    when it was killed: only directories named as deploykit names them, owned by this user, whose
    deploykit process is gone. Returns what was removed."""
    base = Path(tempfile.gettempdir() if root is None else root)
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    for entry in entries:
        match = _SOCKET_DIR.fullmatch(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or no pid at all: not ours to judge
    return True


def scrubbed_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The allowlisted part of deploykit's environment (``environ``): what any llama-server deploykit runs
    sees, ``--version`` included (no credential, no proxy, no ``LLAMA_ARG_*``)."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}


def child_environment(api_key: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: the allowlisted part of deploykit's (``environ``), and its own key."""
    env = scrubbed_environment(environ)
    env["LLAMA_API_KEY"] = api_key
    return env


class LlamaServer:
    """A started llama-server process (``start``), ready once ``wait_ready`` returns; ``stop`` ends it."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.api_key = secrets.token_urlsafe(24)
        self.socket = Path()
        self._dir: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._watcher: subprocess.Popen[bytes] | None = None
        self._lifeline: int | None = None  # deploykit's end of the watcher's pipe
        self._log: LogRing | None = None
        self._health: httpx.Client | None = None
        self.relay: RelayClient | None = None  # the relay's requests to this process (set by ``start``)
        self._loop: httpx.Client | None = None  # the watchdog's /slots client (with the key)
        self._stopped_status: int | None = None
        self._stop_lock = threading.RLock()  # start and stop exclude each other: a stopped server never starts
        self._stopped = False
        self._reap_lock = threading.Lock()  # the engine is reaped, and its group signalled, under it

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def exit_status(self) -> int | None:
        """None while it runs; its exit status (negative: the signal) once it has ended (or was stopped)."""
        proc = self._proc
        if proc is None:
            return self._stopped_status
        with self._reap_lock:
            return proc.poll()

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process has ended, waiting up to ``timeout`` (None: it still runs). A
        connection broken by a dying process is seen before the process can be reaped."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.exit_status()
            if status is not None or time.monotonic() >= deadline:
                return status
            time.sleep(0.02)

    def start(self) -> None:
        """Start the process (not ready yet: ``wait_ready``). A server already stopped (from another thread:
        its generation closed) is not started."""
        with self._stop_lock:
            if self._stopped:
                raise ApplyError("llama-server was not started: it was stopped first (the generation is closing)")
            clear_stale_socket_dirs()
            # mode 0700: only this user may connect; named with deploykit's pid, so a later start can tell the
            # directory of a deploykit killed with -9 (which leaves it behind) from one still in use
            self._dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
            self.socket = Path(self._dir) / SOCKET_NAME
            argv = [str(self.options.binary), "--host", str(self.socket), *self.options.flags()]
            try:
                self._start_watcher()
                self._start_engine(argv)
                self._health = unix_client(self.socket, timeout=HEALTH_READ_TIMEOUT)
                self._loop = unix_client(self.socket, timeout=LOOP_READ_TIMEOUT, api_key=self.api_key)
                self.relay = RelayClient(self.socket, self.api_key)
            except BaseException:
                self.stop(grace=0)
                raise
        log.info("started llama-server pid %s on %s: %s", self.pid, self.socket, " ".join(argv[1:]))

    def _start_watcher(self) -> None:
        read_end, self._lifeline = os.pipe()  # both ends non-inheritable: no other child gets the write end
        try:
            self._watcher = subprocess.Popen(_WATCHER, stdin=read_end, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, env={}, process_group=0)
        finally:
            os.close(read_end)

    def _start_engine(self, argv: list[str]) -> None:
        assert self._watcher is not None
        out_read, out_write = os.pipe()
        try:
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_write, stderr=subprocess.STDOUT,
                                          env=child_environment(self.api_key), start_new_session=True)
        except BaseException:
            os.close(out_read)
            raise
        finally:
            os.close(out_write)
        assert self._lifeline is not None
        os.write(self._lifeline, f"{self._proc.pid}\n".encode())  # the watcher's group to kill: the engine's
        self._log = LogRing(out_read, name=f"deploykit-llama-log-{self._proc.pid}")

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> float:
        """Seconds until ``/health`` answered 200 (the model is loaded); ApplyError if the process ended, the
        time ran out (with the end of its log) or ``stop`` was set (the generation is closing)."""
        start = time.monotonic()
        deadline = start + timeout
        with unix_client(self.socket, timeout=2.0) as client:
            while time.monotonic() < deadline:
                status = self.exit_status()
                if status is not None:
                    if self._log is not None:
                        self._log.close(1.0)  # its last words: the pipe is at its end once the process ended
                    raise ApplyError(f"llama-server exited with status {status} while loading: {self.log_tail()}")
                if healthy(client):
                    return time.monotonic() - start
                if stop is not None and stop.is_set():
                    raise ApplyError("llama-server was stopped while loading (the generation is closing)")
                time.sleep(0.05)
        raise ApplyError(f"llama-server did not load within {timeout:g}s: {self.log_tail()}")

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 within ``HEALTH_READ_TIMEOUT`` now (the watchdog's poll)."""
        return self._health is not None and healthy(self._health)

    def loop_answers(self) -> bool:
        """Whether llama-server's decode loop answers now: ``/slots`` (a task its loop runs between two decode
        steps, unlike ``/health``) within ``LOOP_READ_TIMEOUT``. An engine without ``/slots`` (an answer other
        than 200: disabled, older) cannot be judged this way and counts as answering."""
        client = self._loop
        if client is None:
            return True
        try:
            client.get("/slots")
        except (httpx.HTTPError, OSError):
            return False
        return True

    def log_tail(self) -> str:
        return self._log.tail(LOG_TAIL_BYTES) if self._log is not None else ""

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """End the process group (SIGTERM, then SIGKILL after ``grace``; 0: SIGKILL at once) and reap it.
        Idempotent; safe from any thread."""
        with self._stop_lock:
            self._stopped = True
            proc, watcher, self._proc, self._watcher = self._proc, self._watcher, None, None
            if self.relay is not None:
                self.relay.close()
            for client in (self._health, self._loop):
                if client is not None:
                    client.close()
            self._health = self._loop = None
            if proc is not None:
                _end_group(proc, grace, self._reap_lock)
            if watcher is not None:  # killed, not told by the pipe's end: the engine's pid may be reused now
                watcher.kill()
                watcher.wait()
            if proc is not None:
                log.info("llama-server pid %d stopped (status %s)", proc.pid, proc.returncode)
                self._stopped_status = proc.returncode
            if self._lifeline is not None:
                os.close(self._lifeline)
                self._lifeline = None
            if self._log is not None:
                self._log.close()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def healthy(client: Any) -> bool:
    """Whether llama-server's ``/health`` answers 200 now (503 while loading; refused while starting)."""
    try:
        return bool(client.get("/health").status_code == 200)
    except (httpx.HTTPError, OSError):
        return False


def _end_group(proc: subprocess.Popen[bytes], grace: float, reaping: threading.Lock) -> None:
    """SIGTERM the engine's group (it shuts down cleanly), SIGKILL it after ``grace``, reap the engine. The
    group is signalled only while its leader is not reaped (every reap of it runs under ``reaping``, held while
    signalling; a zombie still holds its pid): once reaped, its pid, and so its group id, may name another
    process's group."""
    _signal_group(proc, signal.SIGTERM if grace > 0 else signal.SIGKILL, reaping)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with reaping:
            if proc.poll() is not None:
                return
        time.sleep(0.02)
    _signal_group(proc, signal.SIGKILL, reaping)
    with reaping:
        proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: int, reaping: threading.Lock) -> None:
    with reaping:
        if proc.returncode is not None:
            return  # reaped: its group id is no longer the engine's to signal
        try:
            os.killpg(proc.pid, sig)  # the engine leads its own session and group (start_new_session)
        except ProcessLookupError:
            pass
