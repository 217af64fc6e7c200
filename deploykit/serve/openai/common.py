"""What the endpoints share: finding the model, pinning its generation without blocking the event loop or
holding a thread while it loads, turning sampling fields into an engine request, and bridging the engine's
thread to asyncio.

A request pins the newest Ready generation for its whole life (a stream included) with a ``Lease`` and
releases it exactly once when it ends, however it ends: answered, refused, or the client gone before, during
or after its response started (``stream.LeasedStream`` releases a stream's lease even when its body never
runs). The generation it started on serves it to the end even if a reload swapped a newer one in meanwhile.

A model that cannot load is a 503 whose message names no file, argv, environment or engine log: an API key's
holder learns that the load failed and where the operator looks (``deploykit status``, the server log); the
reason itself, paths included, is logged here and shown by ``/status`` to the control token's holder.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.concurrency import run_in_threadpool

from ...control.budget import BudgetError
from ...control.live.pool import NotLoaded
from ...control.live.served import STOPPING
from ...engine.adapters import UnknownAdapter
from ...engine.admission import QueueFull
from ...engine.requests import GenerationRequest, GenerationResult
from ...engine.text import RequestError
from ...engine.types import Constraint
from ...errors import DeploykitError
from ..errors import APIError
from .protocol import Sampling

if TYPE_CHECKING:
    from ...control.live.deployment import Deployment
    from ...control.live.pool import Generation
    from ...engine.runtime import TextRuntime

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
BUDGET_RETRY_AFTER_SECONDS = 10
LOAD_RETRY_AFTER_SECONDS = 5
T = TypeVar("T")


class Registry(Protocol):
    """The deployments an app serves (``Supervisor``, or ``Deployments`` for embedding)."""

    def get(self, name: str) -> Deployment | None: ...

    def loading_names(self) -> list[str]: ...

    def items(self) -> list[tuple[str, Deployment]]: ...

    def when_served(self, name: str) -> Future[None]: ...

    def why_not_served(self, name: str) -> str | None: ...


LOAD_WAIT_SECONDS = 300.0  # how long a request for a listed model waits for its load (as ``acquire_timeout``)


async def find(registry: Registry, name: str, *, wait: float = LOAD_WAIT_SECONDS) -> Deployment:
    """The deployment serving ``name``. A listed model still loading (first load, restore) is waited for,
    up to ``wait`` seconds, then answered; a 503 with ``Retry-After`` only when it cannot be served."""
    dep = registry.get(name)
    if dep is not None:
        return dep
    if name not in registry.loading_names():
        known = ", ".join(sorted(n for n, _ in registry.items())) or "none"
        raise APIError(404, f"the model {name!r} does not exist (served: {known})", param="model",
                       code="model_not_found")
    try:  # on the loop, holding no thread; shielded: the future is the registry's
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(registry.when_served(name))), wait)
    except TimeoutError:
        pass
    dep = registry.get(name)
    if dep is not None:
        return dep
    why = registry.why_not_served(name)
    if why == STOPPING:
        raise APIError(503, f"model {name!r} cannot be served: {STOPPING}", param="model", code="server_stopping")
    if why:
        raise load_failed(name, why)
    raise APIError(503, f"model {name!r} is still loading after {wait:.0f}s; retry shortly", param="model",
                   code="model_not_ready", headers={"Retry-After": str(LOAD_RETRY_AFTER_SECONDS)})


_logged: dict[str, str] = {}  # the last reason logged per model: a client retrying does not flood the log
_logged_lock = threading.Lock()


def load_failed(name: str, why: str) -> APIError:
    """The 503 for a model whose load failed: the reason (paths, argv, engine log) goes to the server log,
    once per model and reason; the client gets a stable code and where the operator looks."""
    with _logged_lock:
        fresh = _logged.get(name) != why
        _logged[name] = why
    if fresh:
        log.warning("model %r cannot be served: %s", name, why)
    return APIError(503, f"model {name!r} cannot be served now: its last load failed; see `deploykit status` "
                    "(control token) or the server log", param="model", code="model_load_failed",
                    headers={"Retry-After": str(LOAD_RETRY_AFTER_SECONDS)})


class Lease:
    """One request's pin on a generation, released exactly once, from any thread, without blocking:
    a release in a ``finally`` that the event loop is cancelling cannot be skipped halfway (an ``await``
    there would be cancelled too, which is how early disconnects used to pin a generation for good)."""

    def __init__(self, dep: Deployment, gen: Generation) -> None:
        self.dep, self.gen = dep, gen
        self._lock = threading.Lock()
        self._released = False

    @property
    def runtime(self) -> Any:
        return self.gen.runtime

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.dep.pool.release(self.gen)  # a retired generation is freed on a thread of its own


async def _pin(dep: Deployment) -> Generation:
    """Pin the current generation. While there is none (an on-demand load, a recreate), wait on the event
    loop, holding no thread, for ``dep.servable()`` (the load runs on the deployment's change thread),
    and pin again; up to ``acquire_timeout``, then a 503 with ``Retry-After``. Nothing is pinned until
    ``try_pin`` succeeds on the loop, so a request cancelled meanwhile leaves nothing behind."""
    gen = dep.pool.try_pin()
    if gen is not None:
        return gen
    loop = asyncio.get_running_loop()
    deadline = loop.time() + dep.acquire_timeout
    with dep.wanted():  # busy from now: what loads for this request stays loaded
        while (gen := dep.pool.try_pin()) is None:
            try:  # shielded: a request giving up must not cancel the load the others wait for
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(dep.servable())),
                                       max(0.0, deadline - loop.time()))
            except NotLoaded:  # unloaded (keep-alive, pressure) since it looked: ``servable`` loads it
                continue
            except TimeoutError:
                raise APIError(503, f"model {dep.name!r} is still loading after {dep.acquire_timeout:g}s; "
                               "retry shortly", param="model", code="model_not_ready",
                               headers={"Retry-After": str(LOAD_RETRY_AFTER_SECONDS)}) from None
    return gen


async def lease(dep: Deployment, kind: str) -> Lease:
    """The deployment's current generation, pinned for one request (``kind``: "text" or "embedding");
    the caller releases it when the request ends, however it ends."""
    try:
        held = Lease(dep, await _pin(dep))
    except BudgetError as exc:
        raise APIError(503, f"model {dep.name!r} cannot be loaded now: {exc}", param="model",
                       code="budget_exhausted", headers={"Retry-After": str(BUDGET_RETRY_AFTER_SECONDS)}) from None
    except DeploykitError as exc:
        raise load_failed(dep.name, str(exc)) from None
    runtime = held.runtime
    if runtime is None or runtime.kind != kind:
        held.release()
        what = {"text": "text generation", "embedding": "embeddings"}[kind]
        raise APIError(400, f"model {dep.name!r} ({held.gen.task}) does not serve {what}", param="model",
                       code="wrong_model_type")
    return held


async def prepare(dep: Deployment, kind: str, work: Callable[[Any], T]) -> tuple[Lease, T]:
    """Pin the generation and run ``work(runtime)`` (tokenising, checking limits) off the loop. The
    caller owns the returned lease (released here if ``work`` fails)."""
    return await prepared(await lease(dep, kind), work)


async def prepared(held: Lease, work: Callable[[Any], T]) -> tuple[Lease, T]:
    """``prepare`` on a generation already pinned."""
    try:
        return held, await run_in_threadpool(work, held.runtime)
    except RequestError as exc:
        held.release()
        raise as_api_error(exc) from None
    except BaseException:
        held.release()
        raise


def as_api_error(exc: RequestError) -> APIError:
    return APIError(400, str(exc), param=exc.param, code=exc.code)


def engine_request(body: Sampling, prompt_ids: list[int], max_tokens: int, runtime: TextRuntime, *,
                   choice: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
                   grammar: Constraint | None = None, adapter: str | None = None) -> GenerationRequest:
    """The engine request of choice ``choice`` (0..n-1): choice j samples with ``seed + j``, so that a
    seeded request repeats and its n choices still differ."""
    vocab = len(runtime.tokenizer)
    bad = [t for t in (body.logit_bias or {}) if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is not in this model's vocabulary (0 to {vocab - 1})",
                           param="logit_bias", code="invalid_token_id")
    return GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_tokens, temperature=body.temperature,
                             top_p=body.top_p, seed=None if body.seed is None else body.seed + choice,
                             stop_strings=tuple(body.stop_strings()), logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, presence_penalty=body.presence_penalty,
                             frequency_penalty=body.frequency_penalty, logit_bias=body.bias_pairs(),
                             grammar=grammar, adapter=adapter)


def max_tokens_of(requested: int | None, runtime: TextRuntime) -> int:
    limits = runtime.limits
    return requested if requested is not None else min(limits.default_max_tokens, limits.max_tokens)


class TokenEvents:
    """The engine's events for one request, delivered on the event loop (the engine calls ``put``
    from its own thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[int | GenerationResult] = asyncio.Queue()

    def put(self, event: int | GenerationResult) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def __aiter__(self) -> AsyncIterator[int | GenerationResult]:
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, GenerationResult):
                return


def model_parts(model: str) -> tuple[str, str | None]:
    """A request's ``model``: (deployment, LoRA adapter or None). An adapter is ``<deployment>:<adapter>``."""
    name, colon, adapter = model.partition(":")
    return name, (adapter if colon else None)


def check_adapter(held: Lease, model: str, adapter: str | None) -> None:
    """404 (and the lease released) when ``adapter`` is not served by the pinned generation."""
    if adapter is None:
        return
    adapters = getattr(held.runtime, "adapters", None)
    if adapters is None or adapter not in adapters.names():
        held.release()
        served = ", ".join(f"{held.dep.name}:{n}" for n in (adapters.names() if adapters else [])) or "none"
        raise APIError(404, f"the model {model!r} does not exist (adapters of {held.dep.name!r}: {served})",
                       param="model", code="model_not_found")


def submit(runtime: TextRuntime, request: GenerationRequest, events: TokenEvents) -> Any:
    try:
        return runtime.engine.submit(request, listener=events.put)
    except UnknownAdapter as exc:  # removed between the request's check and its submit
        raise APIError(404, f"the adapter {exc.args[0]!r} is no longer served", param="model",
                       code="model_not_found") from None
    except QueueFull:
        raise APIError(429, "too many requests are waiting for this model; retry shortly",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except ValueError as exc:  # what this engine cannot do (sampling on the continuous backend)
        raise APIError(400, str(exc), code="unsupported") from None


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
