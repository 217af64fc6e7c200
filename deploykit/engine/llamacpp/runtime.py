"""A generation served by llama.cpp: its ``llama-server`` process, checked, behind deploykit's own API.

Why a relay, not a ``TextEngine`` over llama-server's ``/completion``: deploykit validates each request with
its own protocol models (same 400s, keys, limits, 429, metrics, cancel on disconnect) and then hands the
validated body to llama-server's OpenAI endpoints, relaying the answer (streamed events included) with
deploykit's model name. Tokenising, the chat template, sampling, stop strings, logprobs and detokenising
all stay llama.cpp's, so answers are exactly llama-server's and the relay adds one loopback hop and a JSON
rewrite per event, not a Python step per token; fields llama.cpp implements later (its grammars for
``response_format`` and ``tools``) can be forwarded without a new token path here.

The process can die (OOM, a crash, ``kill -9``): its in-flight requests fail at once (their connections
break), the death is logged and counted (``crashes``, ``last_crash``), and the next request starts a fresh
process, waits for it and runs the health check before it is used. ``close`` ends the process: unloading a
llama.cpp generation frees its memory with it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import ApplyError
from ..admission import QueueFull
from ..health import HealthResult
from ..types import Limits
from ..text import RequestError
from .client import EngineGone, RelayClient, UpstreamError, greedy_probe, post_blocking
from .process import LlamaServer, ServerOptions

log = logging.getLogger(__name__)
HEALTH_TOKENS = 4
SUSPECT_WAIT_SECONDS = 2.0
REQUEST_TIMEOUT_SECONDS = 600.0


@dataclass(frozen=True)
class LlamaOptions:
    server: ServerOptions
    health_input: str = "Hello"
    health_timeout: float = 120.0


class Slots:
    """deploykit's admission in front of llama-server: ``slots`` requests run there at once, up to
    ``max_queued`` more wait (in llama-server's own queue), beyond that a request is refused (429)."""

    def __init__(self, slots: int, max_queued: int) -> None:
        self.slots, self.max_queued = slots, max_queued
        self._in_flight = 0
        self._lock = threading.Lock()
        self._closed = False

    def enter(self) -> None:
        with self._lock:
            if self._closed:
                raise QueueFull("this generation is closing")
            if self._in_flight >= self.slots + self.max_queued:
                raise QueueFull(f"{self._in_flight} requests in flight")
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)

    def stats(self) -> dict[str, int]:
        with self._lock:
            n = self._in_flight
        return {"running": min(n, self.slots), "waiting": max(0, n - self.slots)}

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closed = True


class LlamaRuntime:
    """One generation's llama-server, as the OpenAI routes use a text runtime (``kind``, ``limits``,
    ``engine.stats``, ``close``) plus the relay's ``connection()``."""

    kind = "text"
    relay = True  # serve.openai routes hand requests to llama-server instead of a token engine
    tokenizer = None  # llama-server tokenises

    def __init__(self, options: LlamaOptions, limits: Limits) -> None:
        self.options = options
        self.limits = limits
        self.context_length = options.server.context
        self.engine = Slots(options.server.slots, limits.max_queued)
        self.crashes = 0
        self.last_crash: str | None = None
        self._lock = threading.Lock()  # one restart at a time
        self._closed = False
        self._suspect = False  # a request's connection broke: is the process gone?
        self._server, self._client = self._started()

    @property
    def pid(self) -> int | None:
        return self._server.pid

    @property
    def eos_ids(self) -> set[int]:
        return set()

    def _started(self) -> tuple[LlamaServer, RelayClient]:
        """A new process, loaded (``/health``) and answering a greedy request; stopped if either fails."""
        server = LlamaServer(self.options.server)
        server.start()
        try:
            server.wait_ready(self.options.health_timeout)
            self._probe(server)
        except BaseException:
            server.stop()
            raise
        return server, RelayClient(server.url, server.api_key)

    def _probe(self, server: LlamaServer) -> HealthResult:
        try:
            text, tokens, seconds = greedy_probe(server.url, server.api_key, self.options.health_input,
                                                 max_tokens=HEALTH_TOKENS, timeout=self.options.health_timeout)
        except (UpstreamError, EngineGone) as exc:
            raise ApplyError(f"health check failed: llama-server did not answer a greedy request: {exc}; "
                             f"{server.log_tail()[-500:]}") from None
        if tokens < 1:
            raise ApplyError("health check failed: llama-server generated no token for the health input")
        return HealthResult(seconds, f"llama-server pid {server.pid} ({self.options.server.binary.name}) answered "
                                     f"a greedy request with {tokens} token(s) {text!r} in {seconds:.2f}s")

    def health_check(self, text: str, *, timeout: float) -> HealthResult:
        """The check ``control`` runs before this generation serves (the start ran it once already; this
        runs it again on the same process, which is cheap)."""
        return self._probe(self._server)

    def connection(self) -> RelayClient:
        """The client of a live, checked llama-server: a process that died since the last request is
        replaced first (the caller runs this off the event loop). ApplyError when closed or a restart fails."""
        with self._lock:
            if self._closed:
                raise ApplyError("this llama.cpp generation is closed")
            status = self._server.wait_exit(SUSPECT_WAIT_SECONDS) if self._suspect else self._server.exit_status()
            self._suspect = False
            if status is None:
                return self._client
            self.crashes += 1
            self.last_crash = f"llama-server pid {self._server.pid} exited with status {status}"
            log.warning("%s; starting a fresh one: %s", self.last_crash, self._server.log_tail()[-300:])
            self._client.close()
            self._server.stop()
            self._server, self._client = self._started()
            return self._client

    def live_client(self) -> RelayClient | None:
        """The client while the process runs (a cheap, non-blocking check); None: call ``connection``."""
        if self._closed or self._suspect or self._server.exit_status() is not None:
            return None
        return self._client

    def connection_broke(self) -> None:
        """A request's connection to llama-server broke: the next request checks (waiting briefly for it to
        end) whether the process died before using it again."""
        self._suspect = True

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request on this thread (``Deployment.generate`` / ``chat``), on a live, checked process."""
        self.connection()
        server = self._server
        try:
            return post_blocking(server.url, server.api_key, path, body, timeout=REQUEST_TIMEOUT_SECONDS)
        except UpstreamError as exc:
            raise RequestError(f"llama.cpp: {exc.message}") from None
        except EngineGone as exc:
            self.connection_broke()
            raise RequestError(f"generation failed: the llama.cpp engine process ended ({exc})") from None

    def describe(self) -> str:
        return f"llama-server pid {self.pid} on {self._server.url}"

    def close(self, timeout: float | None = 30.0) -> None:
        with self._lock:
            self._closed = True
            self.engine.close()
            self._client.close()
            self._server.stop()
