"""A generation served by llama.cpp: its ``llama-server`` process, checked, behind deploykit's own API.

Why a relay, not a ``TextEngine`` over llama-server's ``/completion``: deploykit validates each request with
its own protocol models (same 400s, keys, limits, 429, metrics, cancel on disconnect) and then hands the
validated body to llama-server's OpenAI endpoints, relaying the answer (streamed events included) with
deploykit's model name. Tokenising, the chat template, sampling, stop strings, logprobs and detokenising
all stay llama.cpp's, so answers are exactly llama-server's and the relay adds one loopback hop and a JSON
rewrite per event, not a Python step per token; fields llama.cpp implements later (its grammars for
``response_format`` and ``tools``) can be forwarded without a new token path here.

The process can die (OOM, a crash, ``kill -9``) or hang (``kill -STOP``, a deadlock): the generation's
``Supervisor`` finds either (exit status; ``/health`` unanswered), kills what is left, and starts a fresh
process with backoff on its own thread, health-checked before it is used; in-flight requests fail at once
(their connections break) and new ones wait for the fresh process, bounded (``ENGINE_WAIT_SECONDS``), without
holding a worker thread. ``close`` ends the process: unloading a llama.cpp generation frees its memory with it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ...errors import ApplyError
from ..admission import QueueFull
from ..health import HealthResult
from ..types import Limits
from ..text import RequestError
from .client import (EngineBusy, EngineGone, ProbeStopped, RelayClient, UpstreamError, get_blocking, greedy_probe,
                     post_blocking)
from .process import LlamaServer, ServerOptions
from .supervisor import EngineReport, EngineUnavailable, Supervisor

log = logging.getLogger(__name__)
HEALTH_TOKENS = 4
REQUEST_TIMEOUT_SECONDS = 600.0
HTTP_SPARE_THREADS = 4  # llama-server HTTP threads beside one per slot: /health, /props, a health probe
ENGINE_WAIT_SECONDS = 15.0  # how long a request waits for a starting or restarting engine before a 503


@dataclass(frozen=True)
class LlamaOptions:
    server: ServerOptions
    health_input: str = "Hello"
    health_timeout: float = 120.0


class Slots:
    """deploykit's admission in front of llama-server: ``slots`` requests are sent to it at once, up to
    ``max_queued`` more wait here, in deploykit (``turn``), beyond that a request is refused (429). Waiting
    requests hold no llama-server HTTP thread: its pool is ``slots`` plus a few (``HTTP_SPARE_THREADS``),
    whatever ``max_queued`` is (2000 queued requests once gave it 2009 threads)."""

    def __init__(self, slots: int, max_queued: int) -> None:
        self.slots, self.max_queued = slots, max_queued
        self._in_flight = 0  # admitted: sent, or waiting for a turn
        self._sending = 0  # holding a turn: sent to llama-server
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def enter(self, count: int = 1) -> None:
        """Take ``count`` places (one per prompt: llama-server runs each prompt of a request as a task of
        its own); QueueFull when they are not all free now."""
        with self._lock:
            if self._closed:
                raise QueueFull("this generation is closing")
            if self._in_flight + count > self.slots + self.max_queued:
                raise QueueFull(f"{self._in_flight} requests in flight")
            self._in_flight += count

    def turn_blocking(self) -> None:
        """``turn`` for a caller's own thread (``Deployment.chat``/``generate``): it waits, first come first
        served with the HTTP routes' requests, in an event loop of its own."""
        asyncio.run(self.turn())

    async def turn(self) -> None:
        """Wait (on the event loop, first come first served) until one of the ``slots`` is free, and take it;
        ``leave(turned=True)`` gives it back."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._sending < self.slots and not self._waiters:
                self._sending += 1
                return
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            with self._lock:
                handed = waiter not in self._waiters
                if not handed:
                    self._waiters.remove(waiter)
            if handed:  # the turn was given to it as it was cancelled: pass it on
                self._pass_turn()
            raise

    def _pass_turn(self) -> None:
        """Give a turn that ends to the first waiter whose event loop still runs, else free it."""
        while True:
            with self._lock:
                if not self._waiters:
                    self._sending -= 1
                    return
                loop, future = self._waiters.popleft()
            try:
                loop.call_soon_threadsafe(_grant, future)
                return
            except RuntimeError:  # its loop is closed: nobody waits there any more
                continue

    def leave(self, count: int = 1, *, turned: bool = False) -> None:
        with self._lock:
            self._in_flight = max(0, self._in_flight - count)
        if turned:
            self._pass_turn()

    def busy(self) -> bool:
        """Whether requests are in flight on the engine now (the watchdog then expects it to progress)."""
        with self._lock:
            return self._in_flight > 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, sending = self._in_flight, self._sending
        return {"running": sending, "waiting": max(0, n - sending)}

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            self._closed = True


def _grant(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def engine_options(options: LlamaOptions) -> LlamaOptions:
    """``options`` with llama-server's HTTP threads set: one per slot and a few for the watchdog's /health
    and probes, never one per queued request (the queue is deploykit's: ``Slots``)."""
    server = dataclasses.replace(options.server, http_threads=options.server.slots + HTTP_SPARE_THREADS)
    return dataclasses.replace(options, server=server)


class LlamaRuntime:
    """One generation's llama-server, as the OpenAI routes use a text runtime (``kind``, ``limits``,
    ``engine.stats``, ``close``) plus the relay's ``ready_client`` / ``client``."""

    kind = "text"
    relay = True  # serve.openai routes hand requests to llama-server instead of a token engine
    tokenizer = None  # llama-server tokenises

    def __init__(self, options: LlamaOptions, limits: Limits) -> None:
        self.options = engine_options(options)
        self.limits = limits
        self.context_length = options.server.context
        self.engine = Slots(options.server.slots, limits.max_queued)
        self.vocab_size: int | None = None  # llama-server's n_vocab: logit_bias ids are checked against it
        self._supervisor = Supervisor(self._started, name=options.server.model.stem[:24], busy=self.engine.busy)

    @property
    def pid(self) -> int | None:
        return self._supervisor.proc.pid

    @property
    def eos_ids(self) -> set[int]:
        return set()

    def report(self) -> EngineReport:
        """The process now: pid, state (starting, ready, restarting, failed) and why, deaths, restarts."""
        return self._supervisor.report()

    def _started(self, stop: threading.Event) -> LlamaServer:
        """A new process, loaded (``/health``) and answering a greedy request; stopped if either fails. Its
        load and its probe both end as soon as ``stop`` is set (the generation closes): nothing waits for a
        probe's timeout."""
        server = LlamaServer(self.options.server)
        server.start()
        try:
            server.wait_ready(self.options.health_timeout, stop)
            self._probe(server, stop)
            if self.vocab_size is None and not stop.is_set():
                self.vocab_size = _vocab_size(server)
        except BaseException:
            server.stop(grace=0)
            raise
        return server

    def _probe(self, server: LlamaServer, stop: threading.Event | None = None) -> HealthResult:
        try:
            text, tokens, seconds = greedy_probe(server.socket, server.api_key, self.options.health_input,
                                                 max_tokens=HEALTH_TOKENS, timeout=self.options.health_timeout,
                                                 stop=stop)
        except ProbeStopped:
            raise ApplyError("llama-server was stopped during its health check (the generation is closing)") from None
        except (UpstreamError, EngineGone, EngineBusy) as exc:
            raise ApplyError(f"health check failed: llama-server did not answer a greedy request: {exc}; "
                             f"{server.log_tail()[-500:]}") from None
        if tokens < 1:
            raise ApplyError("health check failed: llama-server generated no token for the health input")
        return HealthResult(seconds, f"llama-server pid {server.pid} ({self.options.server.binary.name}) answered "
                                     f"a greedy request with {tokens} token(s) {text!r} in {seconds:.2f}s")

    def health_check(self, text: str, *, timeout: float) -> HealthResult:
        """The check ``control`` runs before this generation serves (the start ran it once already; this
        runs it again on the same process, which is cheap)."""
        return self._probe(self._supervisor.proc)

    def ready_client(self) -> RelayClient | None:
        """The client of the ready process (no wait, no thread), or None: await ``client``."""
        server = self._supervisor.ready()
        return server.relay if server is not None else None

    async def client(self) -> RelayClient:
        """The client of the ready process, waiting on the event loop while it starts or restarts;
        ``EngineUnavailable`` when it is not ready within ``ENGINE_WAIT_SECONDS`` (or failed, or closed)."""
        server = await self._supervisor.wait_ready(ENGINE_WAIT_SECONDS)
        assert server.relay is not None
        return server.relay

    def connection_broke(self, client: RelayClient) -> None:
        """A request's connection through ``client`` broke or was refused: the watchdog checks that process
        now (if it still serves), and requests wait for its verdict."""
        server = self._supervisor.proc
        if server.relay is client:
            self._supervisor.connection_broke(server)

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request on this thread (``Deployment.generate`` / ``chat``), on a live, checked process, admitted
        by the same slots as the HTTP routes' (QueueFull past them)."""
        server: LlamaServer | None = None
        self.engine.enter()
        turned = False
        try:
            self.engine.turn_blocking()  # sent only with a slot free, as the HTTP routes' requests are
            turned = True
            server = self._supervisor.wait_ready_blocking(ENGINE_WAIT_SECONDS)
            return post_blocking(server.socket, server.api_key, path, body, timeout=REQUEST_TIMEOUT_SECONDS)
        except UpstreamError as exc:
            raise RequestError(f"llama.cpp: {exc.message}") from None
        except EngineUnavailable as exc:  # an in-process caller is the operator: it gets the reason
            raise RequestError(f"the llama.cpp engine is not available: {exc.detail}") from None
        except EngineBusy as exc:
            raise RequestError(f"the llama.cpp engine is not available: {exc}") from None
        except EngineGone as exc:
            if server is not None:
                self._supervisor.connection_broke(server)
            raise RequestError(f"generation failed: the llama.cpp engine's connection broke ({exc})") from None
        finally:
            self.engine.leave(turned=turned)

    def describe(self) -> str:
        return f"llama-server pid {self.pid} on {self._supervisor.proc.socket}"

    def close(self, timeout: float | None = 30.0) -> None:
        self.engine.close()
        self._supervisor.close()


def _vocab_size(server: LlamaServer) -> int | None:
    """The model's vocabulary size as llama-server reports it (``/v1/models``' ``meta.n_vocab``)."""
    try:
        models = get_blocking(server.socket, server.api_key, "/v1/models", timeout=10.0).get("data") or [{}]
    except (UpstreamError, EngineGone, EngineBusy):
        return None
    n_vocab = (models[0].get("meta") or {}).get("n_vocab")
    return int(n_vocab) if isinstance(n_vocab, int) and n_vocab > 0 else None
