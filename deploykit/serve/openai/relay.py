"""Chat and completions requests of a llama.cpp generation: validated here, computed by llama-server.

deploykit's routes validate a request with its own protocol models and limits first (the same 400s as for
the transformers engine), then this module checks what only the llama.cpp engine needs (``logit_bias`` ids
within the model's vocabulary, a ``seed`` llama.cpp can take), admits it (429 past the slots and the queue),
hands the validated fields to the generation's llama-server (``engine.llamacpp``) and relays the answer: the
model named as deploykit serves it, one id per response, usage as the client asked, metrics counted, and the
upstream connection closed when the client goes away (llama-server then stops generating).

- The request's lease is released on every path: a refusal here (``_checked``), a 429, an engine that is
  not ready, an answer, a failure.
- Sampling fields the client leaves unset are sent as the OpenAI API's defaults (``temperature`` 1, ``top_p``
  1, no top-k or min-p truncation), never llama-server's own (``engine.llamacpp.sampling``); a ``seed`` must
  fit llama.cpp's uint32.
- A streamed answer is forwarded as llama-server's bytes (llama-swap's proxy does the same): each event's id
  and model are rewritten by a bytes replace learned from the first event, and only the events that carry
  ``usage``, ``timings`` or an error are parsed as JSON. Time to first token counts from the request's
  arrival at the API.
- A request that llama.cpp refuses is answered with llama.cpp's message and status. One whose engine ends or
  hangs during it fails at once (503 with Retry-After, or the error event of a started stream); requests that
  find the engine restarting wait for it (bounded, on the event loop), then get a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from ...engine.admission import QueueFull
from ...engine.grammar import check_cost
from ...engine.llamacpp.client import EngineBusy, EngineGone, EngineRefused, RelayClient, Upstream, UpstreamError
from ...engine.llamacpp.sampling import sampling_fields
from ...engine.llamacpp.schema import unenforced_by_llamacpp
from ...engine.llamacpp.supervisor import EngineUnavailable
from ...engine.text import RequestError
from ..errors import APIError, ClientGone
from ..served_by import arrival
from .common import RETRY_AFTER_SECONDS, Lease, as_api_error
from .protocol import IGNORED, ChatCompletionRequest, CompletionRequest, new_id, now
from .rewrite import NOT_RELAYED, Rewriter
from .stream import LeasedStream
from .structured import plan_of

if TYPE_CHECKING:
    from ..metrics import ServingMetrics

DISCONNECT_POLL_SECONDS = 0.5
_NOT_FORWARDED = set(IGNORED) | {"model", "max_completion_tokens", "stream_options", "temperature", "top_p", "seed"}
ENGINE_RETRY_AFTER_SECONDS = 5
T = TypeVar("T")


def is_relayed(held: Lease) -> bool:
    return bool(getattr(held.runtime, "relay", False))


class _Ticket:
    """One request's place in the generation's slots, given back exactly once (``cancel``), however the
    request ends (``LeasedStream`` calls ``cancel`` even when a stream's body never ran); it also closes the
    request's open upstream answer, if any (llama-server then stops generating it)."""

    def __init__(self, held: Lease, items: int = 1, param: str = "prompt") -> None:
        self.slots, self.items = held.runtime.engine, items
        self.upstream: Upstream | None = None
        room = self.slots.slots + self.slots.max_queued
        if items > room:  # never admitted, however long it waits: not a 429
            held.release()
            what = "prompts x n" if param == "prompt" else "choices (n)"
            raise APIError(400, f"{items} {what} in one request; this model admits at most {room} at once "
                                "(engine.slots + serving.max_queued)", param=param, code="too_many_prompts")
        try:
            self.slots.enter(items)
        except QueueFull:
            held.release()
            raise APIError(429, "too many requests are waiting for this model; retry shortly", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        self._held, self._turned = True, False

    async def turn(self) -> None:
        """Wait in deploykit's queue until a llama-server slot is free for this request."""
        await self.slots.turn()
        self._turned = True

    def cancel(self) -> None:
        if self._held:
            self._held = False
            self.slots.leave(self.items, turned=self._turned)
            if self.upstream is not None:
                _closing.add(task := asyncio.ensure_future(self.upstream.aclose()))
                task.add_done_callback(_closing.discard)


_closing: set[asyncio.Future[None]] = set()  # upstream answers being closed (held until done)


def _checked(held: Lease, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The upstream body ``build`` makes; on any refusal the lease is released before the error goes up."""
    try:
        return build()
    except RequestError as exc:
        held.release()
        raise as_api_error(exc) from None
    except BaseException:
        held.release()
        raise


def _max_tokens(requested: int | None, held: Lease) -> int:
    limits = held.runtime.limits
    if requested is not None and requested > limits.max_tokens:
        raise APIError(400, f"max_tokens {requested} is more than this model allows ({limits.max_tokens}, "
                            "spec.serving.max_tokens)", param="max_tokens", code="max_tokens_too_large")
    return requested if requested is not None else min(limits.default_max_tokens, limits.max_tokens)


def _check_bias(bias: dict[int, float] | None, vocab: int | None) -> None:
    """llama.cpp drops a bias on a token id outside its vocabulary without a word: refuse it instead."""
    if not bias:
        return
    if vocab is None:
        raise RequestError("logit_bias cannot be checked: this llama-server does not report its vocabulary size",
                           param="logit_bias", code="unsupported")
    bad = [t for t in bias if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is not in this model's vocabulary (0 to {vocab - 1})",
                           param="logit_bias", code="invalid_token_id")


def _upstream_body(body: ChatCompletionRequest | CompletionRequest, held: Lease, max_tokens: int | None) -> dict[str, Any]:
    """The body llama-server gets: the validated fields, the OpenAI API's sampling defaults made explicit."""
    _check_bias(body.logit_bias, held.runtime.vocab_size)
    data = body.model_dump(exclude_unset=True, exclude=_NOT_FORWARDED, mode="json", by_alias=True)
    data.update(max_tokens=_max_tokens(max_tokens, held),
                **sampling_fields(temperature=body.temperature, top_p=body.top_p, seed=body.seed))
    if body.stream:
        data["stream_options"] = {"include_usage": True}  # counted in deploykit's metrics
    return data


async def chat(body: ChatCompletionRequest, request: Request, held: Lease, name: str) -> Any:
    def build() -> dict[str, Any]:
        _check_structured(body)
        return _upstream_body(body, held, body.requested_max_tokens())

    upstream = _checked(held, build)
    return await _relay("/v1/chat/completions", upstream, body, request, held, name, prefix="chatcmpl",
                        items=body.n, param="n")


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
    schema = json.loads(plan.constraint.schema)
    bad = unenforced_by_llamacpp(schema)
    if bad is not None:
        keyword, where = bad
        raise RequestError(f"{plan.constraint.param}: the schema keyword {keyword!r} (at {where}) cannot be "
                           "enforced by the llama.cpp engine; remove it", param=plan.constraint.param,
                           code="unsupported_schema")
    check_cost(schema, plan.constraint.param)  # llama-server compiles it too, on its HTTP thread


async def completions(body: CompletionRequest, request: Request, held: Lease, name: str) -> Any:
    def build() -> dict[str, Any]:
        if body.echo:
            raise RequestError("echo is not supported by the llama.cpp engine", param="echo", code="unsupported")
        if body.logprobs is not None:
            raise RequestError("logprobs on /v1/completions are not supported by the llama.cpp engine; use "
                               "/v1/chat/completions with logprobs: true", param="logprobs", code="unsupported")
        items = len(body.prompts()) * body.n
        if items > held.runtime.limits.max_input_items:
            raise RequestError(f"{items} prompts x n in one request; this model takes at most "
                               f"{held.runtime.limits.max_input_items} (spec.serving.max_input_items)",
                               param="prompt")
        return _upstream_body(body, held, body.max_tokens)

    upstream = _checked(held, build)
    return await _relay("/v1/completions", upstream, body, request, held, name, prefix="cmpl",
                        items=len(body.prompts()) * body.n)


async def _relay(path: str, upstream: dict[str, Any], body: ChatCompletionRequest | CompletionRequest,
                 request: Request, held: Lease, name: str, *, prefix: str, items: int = 1,
                 param: str = "prompt") -> Any:
    """``items``: the places the request takes in the generation's slots (one per prompt and choice)."""
    done = _Done(request, held, name, arrival(request))
    our_id = new_id(prefix)
    ticket = _Ticket(held, items, param)
    try:
        await _connection(held)  # the engine ready (or a 503 after its wait) before a turn is taken, so that
        await ticket.turn()      # requests queued behind a restarting engine do not time out one after another
        if body.stream:
            client, opened = await _sent(held, request, name, lambda c: c.open_stream(path, upstream))
            ticket.upstream = opened
            wants_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _events(held, client, opened, Rewriter(our_id, name, wants_usage), done)
            return LeasedStream(events, lease=held, runs=[ticket], model=name)  # type: ignore[list-item]
        _, raw = await _sent(held, request, name, lambda c: c.post(path, upstream))
    except BaseException:
        ticket.cancel()
        held.release()
        raise
    try:
        answer = json.loads(raw)
        done.finished(answer.get("usage"), ttft=None, timings=answer.get("timings"))
        for key in NOT_RELAYED:
            answer.pop(key, None)
        answer.update(id=our_id, created=now(), model=name)
        return Response(json.dumps(answer, separators=(",", ":")), media_type="application/json")
    finally:
        ticket.cancel()
        held.release()


async def _sent(held: Lease, request: Request, name: str,
                send: Callable[[RelayClient], Awaitable[T]]) -> tuple[RelayClient, T]:
    """``send``'s answer from the ready engine. A connection refused before anything was sent (a process that
    just died, not yet seen by its watchdog) is sent once more, after the watchdog's verdict."""
    for attempt in (1, 2):
        client = await _connection(held)
        try:
            return client, await _unless_gone(request, send(client), name)
        except EngineRefused:
            if attempt == 2:
                raise _api_error(EngineRefused("the connection was refused twice"), held, client) from None
            held.runtime.connection_broke(client)
        except (UpstreamError, EngineGone, EngineBusy) as exc:
            raise _api_error(exc, held, client) from None
    raise AssertionError("unreachable")


async def _connection(held: Lease) -> RelayClient:
    """The generation's llama-server client; while its watchdog restarts the process, wait for it on the
    event loop (bounded; no worker thread held), then a 503 with Retry-After."""
    runtime = held.runtime
    client = runtime.ready_client()
    if client is not None:
        return client  # the common case, without waiting
    try:
        ready: RelayClient = await runtime.client()
        return ready
    except EngineUnavailable as exc:
        raise APIError(503, str(exc), code="engine_unavailable",
                       headers={"Retry-After": str(exc.retry_after)}) from None


class _Done:
    """What a relayed request records once it ran to its end: tokens, latency and time to first token from
    its arrival, the per-generation request count and the generation's traffic (a canary's gates)."""

    def __init__(self, request: Request, held: Lease, name: str, arrived: float) -> None:
        self.metrics: ServingMetrics = request.app.state.metrics
        self.labels = self.metrics.labels(name, held.gen.number)
        self.gen, self.arrived = held.gen, arrived

    def first_token(self) -> float:
        ttft = time.monotonic() - self.arrived
        self.metrics.time_to_first_token.labels(*self.labels).observe(ttft)
        return ttft

    def finished(self, usage: dict[str, Any] | None, *, ttft: float | None,
                 timings: dict[str, Any] | None = None) -> None:
        if usage:
            self.metrics.prompt_tokens.labels(*self.labels).inc(int(usage.get("prompt_tokens", 0)))
            self.metrics.generation_tokens.labels(*self.labels).inc(int(usage.get("completion_tokens", 0)))
        drafted = (timings or {}).get("draft_n")
        if isinstance(drafted, int) and drafted > 0:  # llama-server's speculative decoding, this request's
            accepted = (timings or {}).get("draft_n_accepted")
            self.metrics.relayed_speculation.add(self.labels, drafted, accepted if isinstance(accepted, int) else 0)
        self.metrics.request_latency.labels(*self.labels).observe(time.monotonic() - self.arrived)
        self.metrics.requests.labels(*self.labels).inc()
        self.gen.traffic.record(ttft=ttft, failed=False)

    def failed(self, ttft: float | None) -> None:
        self.gen.traffic.record(ttft=ttft, failed=True)


async def _events(held: Lease, client: RelayClient, upstream: Upstream, rewrite: Rewriter,
                  done: _Done) -> AsyncIterator[bytes]:
    ttft: float | None = None
    try:
        async for chunk in upstream.chunks():
            out = rewrite.feed(chunk)
            if out:
                if ttft is None:
                    ttft = done.first_token()
                yield out
            if rewrite.ended:
                break
    except (UpstreamError, EngineGone, EngineBusy) as exc:
        done.failed(ttft)
        raise _api_error(exc, held, client) from None
    finally:
        await upstream.aclose()  # closes the upstream connection when the client left early
    done.finished(rewrite.usage, ttft=ttft, timings=rewrite.timings)
    if not rewrite.ended:
        yield b"data: [DONE]\n\n"


async def _unless_gone(request: Request, work: Awaitable[T], name: str) -> T:
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


def _api_error(exc: UpstreamError | EngineGone | EngineBusy, held: Lease, client: RelayClient) -> APIError:
    if isinstance(exc, UpstreamError):
        status = exc.status if 400 <= exc.status < 600 else 500
        return APIError(status, f"llama.cpp: {exc.message}", code="engine_refused" if status < 500 else "engine_error")
    retry = {"Retry-After": str(ENGINE_RETRY_AFTER_SECONDS)}
    if isinstance(exc, EngineBusy):
        return APIError(503, f"the llama.cpp engine is busy: {exc}", code="engine_busy", headers=retry)
    held.runtime.connection_broke(client)  # the watchdog checks the process now; new requests wait for its verdict
    return APIError(503, f"the llama.cpp engine's connection broke during the request ({exc}); its watchdog "
                         "restarts a process that ended or hung", code="engine_unavailable", headers=retry)
