"""Chat and completions requests of a llama.cpp generation: validated here, computed by llama-server.

deploykit's routes validate a request with its own protocol models and limits first (the same 400s as for
the transformers engine), then this module admits it (429 past the slots and the queue), hands the validated
fields to the generation's llama-server (``engine.llamacpp``) and relays the answer: the model named as
deploykit serves it, one id per response, usage as the client asked, metrics counted, and the upstream
connection closed when the client goes away (llama-server then stops generating). A request that llama.cpp
refuses is answered with llama.cpp's message and status; one whose engine process dies fails at once (500),
and the next request gets a fresh, checked process.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ...engine.admission import QueueFull
from ...engine.llamacpp.client import EngineGone, RelayClient, UpstreamError
from ...engine.llamacpp.schema import unenforced_by_llamacpp
from ...engine.text import RequestError
from ...errors import DeploykitError
from ..errors import APIError, ClientGone
from .common import RETRY_AFTER_SECONDS, Lease, as_api_error, sse
from .protocol import IGNORED, ChatCompletionRequest, CompletionRequest, new_id, now
from .stream import LeasedStream
from .structured import plan_of

if TYPE_CHECKING:
    from ..metrics import ServingMetrics

DISCONNECT_POLL_SECONDS = 0.5
_NOT_FORWARDED = set(IGNORED) | {"model", "max_completion_tokens", "stream_options"}


def is_relayed(held: Lease) -> bool:
    return bool(getattr(held.runtime, "relay", False))


class _Ticket:
    """One request's place in the generation's slots, given back exactly once (``cancel``), however the
    request ends (``LeasedStream`` calls ``cancel`` even when a stream's body never ran)."""

    def __init__(self, held: Lease) -> None:
        self.slots = held.runtime.engine
        try:
            self.slots.enter()
        except QueueFull:
            held.release()
            raise APIError(429, "too many requests are waiting for this model; retry shortly", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        self._held = True

    def cancel(self) -> None:
        if self._held:
            self._held = False
            self.slots.leave()


def _max_tokens(requested: int | None, held: Lease) -> int:
    limits = held.runtime.limits
    if requested is not None and requested > limits.max_tokens:
        raise APIError(400, f"max_tokens {requested} is more than this model allows ({limits.max_tokens}, "
                            "spec.serving.max_tokens)", param="max_tokens", code="max_tokens_too_large")
    return requested if requested is not None else min(limits.default_max_tokens, limits.max_tokens)


def _upstream_body(body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> dict[str, Any]:
    data = body.model_dump(exclude_unset=True, exclude=_NOT_FORWARDED, mode="json", by_alias=True)
    data["max_tokens"] = max_tokens
    if body.stream:
        data["stream_options"] = {"include_usage": True}  # counted in deploykit's metrics
    return data


async def chat(body: ChatCompletionRequest, request: Request, held: Lease, name: str) -> Any:
    try:
        _check_structured(body)
    except RequestError as exc:
        held.release()
        raise as_api_error(exc) from None
    upstream = _upstream_body(body, _max_tokens(body.requested_max_tokens(), held))
    return await _relay("/v1/chat/completions", upstream, body, request, held, name, prefix="chatcmpl")


def _check_structured(body: ChatCompletionRequest) -> None:
    """``response_format`` goes to llama.cpp's own grammar support; a schema keyword it would not follow is
    refused here instead (RequestError naming it). ``tools`` are refused: llama-server forces a call only
    for chat templates it knows (SmolLM2's answer to ``tool_choice: required`` is free text), so it would
    accept and not follow them."""
    if body.tools:
        raise RequestError("tools are not served by the llama.cpp engine (llama-server does not force calls "
                           "for every chat template): use the transformers engine (spec.engine.name: "
                           "transformers), or response_format", param="tools", code="unsupported")
    plan = plan_of(body)
    if plan.constraint is None:
        return
    bad = unenforced_by_llamacpp(json.loads(plan.constraint.schema))
    if bad is not None:
        keyword, where = bad
        raise RequestError(f"{plan.constraint.param}: the schema keyword {keyword!r} (at {where}) cannot be "
                           "enforced by the llama.cpp engine; remove it", param=plan.constraint.param,
                           code="unsupported_schema")


async def completions(body: CompletionRequest, request: Request, held: Lease, name: str) -> Any:
    if body.echo:
        held.release()
        raise APIError(400, "echo is not supported by the llama.cpp engine", param="echo", code="unsupported")
    if body.logprobs is not None:
        held.release()
        raise APIError(400, "logprobs on /v1/completions are not supported by the llama.cpp engine; use "
                            "/v1/chat/completions with logprobs: true", param="logprobs", code="unsupported")
    items = len(body.prompts()) * body.n
    if items > held.runtime.limits.max_input_items:
        held.release()
        raise APIError(400, f"{items} prompts x n in one request; this model takes at most "
                            f"{held.runtime.limits.max_input_items} (spec.serving.max_input_items)", param="prompt")
    upstream = _upstream_body(body, _max_tokens(body.max_tokens, held))
    return await _relay("/v1/completions", upstream, body, request, held, name, prefix="cmpl")


async def _relay(path: str, upstream: dict[str, Any], body: ChatCompletionRequest | CompletionRequest,
                 request: Request, held: Lease, name: str, *, prefix: str) -> Any:
    ticket = _Ticket(held)
    try:
        client = await _connection(held)
    except BaseException:
        ticket.cancel()
        held.release()
        raise
    metrics: ServingMetrics = request.app.state.metrics
    labels = metrics.labels(name, held.gen.number)
    meta = {"id": new_id(prefix), "created": now(), "model": name}
    if body.stream:
        wants_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(held, client, path, upstream, meta, wants_usage, metrics, labels)
        return LeasedStream(events, lease=held, runs=[ticket], model=name)  # type: ignore[list-item]
    try:
        started = time.monotonic()
        answer = await _unless_gone(request, client.post(path, upstream), name)
        _count(metrics, labels, answer.get("usage"), started)
        answer.pop("timings", None)
        return {**answer, **meta}
    except (UpstreamError, EngineGone) as exc:
        raise _api_error(exc, held) from None
    finally:
        ticket.cancel()
        held.release()


async def _connection(held: Lease) -> RelayClient:
    """The generation's llama-server client; a dead process is replaced (and checked) on a worker thread."""
    runtime = held.runtime
    client = runtime.live_client()
    if client is not None:
        return client  # the common case, without leaving the event loop
    try:
        return await run_in_threadpool(runtime.connection)
    except DeploykitError as exc:
        raise APIError(503, f"the llama.cpp engine could not be restarted: {exc}", code="engine_unavailable",
                       headers={"Retry-After": "5"}) from None


async def _events(held: Lease, client: RelayClient, path: str, upstream: dict[str, Any], meta: dict[str, Any], wants_usage: bool,
                  metrics: ServingMetrics, labels: tuple[str, str]) -> AsyncIterator[bytes]:
    started = time.monotonic()
    first = True
    stream = client.events(path, upstream)
    try:
        async for event in stream:
            if first:
                metrics.time_to_first_token.labels(*labels).observe(time.monotonic() - started)
                first = False
            event.pop("timings", None)
            usage = event.get("usage") if not event.get("choices") else None
            if usage is not None:
                _count(metrics, labels, usage, started)
                if not wants_usage:
                    continue
            elif not wants_usage:
                event.pop("usage", None)
            event.update(meta)
            yield sse(event)
    except (UpstreamError, EngineGone) as exc:
        raise _api_error(exc, held) from None
    finally:
        await stream.aclose()  # closes the upstream connection when the client left early
    yield sse("[DONE]")


async def _unless_gone(request: Request, work: Awaitable[dict[str, Any]], name: str) -> dict[str, Any]:
    """``work``'s answer; cancelled (its connection closed) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise ClientGone(name)
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)


def _count(metrics: ServingMetrics, labels: tuple[str, str], usage: dict[str, Any] | None, started: float) -> None:
    if usage:
        metrics.prompt_tokens.labels(*labels).inc(int(usage.get("prompt_tokens", 0)))
        metrics.generation_tokens.labels(*labels).inc(int(usage.get("completion_tokens", 0)))
    metrics.request_latency.labels(*labels).observe(time.monotonic() - started)


def _api_error(exc: UpstreamError | EngineGone, held: Lease) -> APIError:
    if isinstance(exc, UpstreamError):
        status = exc.status if 400 <= exc.status < 600 else 500
        return APIError(status, f"llama.cpp: {exc.message}", code="engine_refused" if status < 500 else "engine_error")
    held.runtime.connection_broke()  # the next request checks the process before using it
    return APIError(500, f"generation failed: the llama.cpp engine process ended during the request ({exc})",
                    code="generation_failed")

