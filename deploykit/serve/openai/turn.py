"""One assistant turn, below every API face: the internal request (a ``ChatCompletionRequest``: messages,
sampling, grammar, tools) pinned to a generation, tokenised, checked and started on its engine; and the
turn's stream of events (``Text``, ``CallOpened``, ``CallArguments``, ``Ended``) read from the engine's
deltas as they come.

``/v1/chat/completions``, OpenAI's ``/v1/responses`` and Anthropic's ``/v1/messages`` each parse their own
shape into the internal request and render these events in their own wire format. Admission (429s),
adapters by model name, cancellation when the client goes away and metrics are the engine run's
(``generation.Run``), the same whichever face asked. This module never renders a wire format.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request

from ...engine.requests import GenerationRequest
from ...engine.text import chat_prompt_ids, check_length, template_takes_tools
from ..errors import APIError
from ..served_by import mark
from . import relay
from .choices import start
from .common import Lease, check_adapter, engine_request, find, lease, max_tokens_of, model_parts, prepared
from .generation import Outcome, Run
from .logprobs import TokenTexts
from .protocol import ChatCompletionRequest
from .structured import (RequiredStream, Structured, auto_reader, check_auto, described, generic, new_call, plan_of,
                         tool_calls_of, tool_format)


@dataclass
class Started:
    """A turn on its engine: the lease it holds, its runs (one per choice), what its answer must be."""

    held: Lease
    runs: list[Run]
    plan: Structured
    texts: TokenTexts
    model: str  # the deployment's name (metrics, logs)


async def pinned(body: ChatCompletionRequest, request: Request) -> Lease:
    """The generation serving ``body.model`` (a deployment, or ``<deployment>:<adapter>``), pinned."""
    base, adapter = model_parts(body.model)
    dep = await find(request.app.state.registry, base)
    held = await lease(dep, "text")
    mark(request, held.gen)
    check_adapter(held, body.model, adapter)
    return held


def refuse_relayed(held: Lease, route: str) -> None:
    """A llama.cpp generation computes chat completions only: other faces are refused (lease released)."""
    if relay.is_relayed(held):
        held.release()
        raise APIError(400, f"{route} is not served for llama.cpp deployments (spec.engine.name: llama.cpp); use "
                       "/v1/chat/completions, which llama-server computes", param="model", code="unsupported_engine")


async def started(body: ChatCompletionRequest, request: Request, held: Lease, *,
                  params: Mapping[str, str] | None = None) -> Started:
    """Tokenise and check ``body`` off the loop and submit its runs; a refusal is a 400 whose ``param`` is
    renamed by ``params`` (the internal request's field -> the face's own), a full queue a 429."""
    plans: list[Structured] = []
    adapter = model_parts(body.model)[1]

    def work(runtime: Any) -> list[GenerationRequest]:
        plan, ids = prompt_of(body, runtime)
        if plan.constraint is not None:
            runtime.check_grammar(plan.constraint)  # compiled (cached) off the loop, or a 400 naming the keyword
        max_tokens = max_tokens_of(body.requested_max_tokens(), runtime)
        check_length(len(ids), max_tokens, context_length=runtime.context_length,
                     limit=runtime.limits.max_tokens, prompt_param="messages")
        plans.append(plan)
        return [engine_request(body, ids, max_tokens, runtime, choice=j, logprobs=body.top(),
                               grammar=plan.constraint, adapter=adapter) for j in range(body.n)]

    try:
        held, jobs = await prepared(held, work)
        runs = [Run(held.gen, held.dep.name, job, request, request.app.state.metrics) for job in jobs]
        start(runs, held)  # before the response: a full queue is a 429, not a broken stream
    except APIError as exc:
        raise _renamed(exc, params) from None
    return Started(held, runs, plans[0], TokenTexts(held.runtime.tokenizer), held.dep.name)


def prompt_of(body: ChatCompletionRequest, runtime: Any) -> tuple[Structured, list[int]]:
    """What ``body`` asks of its answer, and its prompt's token ids (the tools rendered by the template when
    it takes them)."""
    plan = plan_of(body)
    takes_tools = template_takes_tools(runtime.tokenizer)
    messages = [m.as_template_message() for m in body.messages]
    setting = runtime.limits.tool_format
    if plan.mode != "none" and tool_format(setting, template_takes_tools=takes_tools, mode=plan.mode) == "generic":
        plan = generic(plan, stop=bool(body.stop_strings()))
        return plan, chat_prompt_ids(runtime.tokenizer, described(messages, plan))
    check_auto(plan, parser=runtime.limits.tool_call_parser, template_takes_tools=takes_tools)
    return plan, chat_prompt_ids(runtime.tokenizer, messages, plan.tools if takes_tools else None)


async def count_prompt(body: ChatCompletionRequest, held: Lease, *, params: Mapping[str, str] | None = None) -> int:
    """The number of tokens of ``body``'s prompt on the pinned generation; the lease is released."""
    try:
        held, ids = await prepared(held, lambda runtime: prompt_of(body, runtime)[1])
    except APIError as exc:
        raise _renamed(exc, params) from None
    held.release()
    return len(ids)


def _renamed(exc: APIError, params: Mapping[str, str] | None) -> APIError:
    face = params.get(exc.param) if params and exc.param else None
    if face is not None and exc.param is not None:
        exc.message = exc.message.replace(exc.param, face, 1)
        exc.param = face
    return exc


def answer_of(outcome: Outcome, plan: Structured) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's content and the tool calls read from it (OpenAI's chat shape)."""
    if plan.mode == "none":
        return outcome.text, []
    if plan.mode == "auto" and plan.generic:  # whole or cut: its content as far as it went, or its calls
        reader = auto_reader(plan)
        head = reader.push(outcome.text)
        rest, calls = reader.finish()
        return (None if calls else head + rest), calls
    try:
        return tool_calls_of(plan, outcome.text)
    except (ValueError, KeyError, TypeError):  # a cut answer ("length") is not a whole JSON array
        if plan.mode == "required":  # a forced call is never content: the calls as far as they were written
            cut = RequiredStream()
            cut.push(outcome.text)
            return None, cut.calls
        return outcome.text, []


# ---- the turn's events ------------------------------------------------------------------------------

@dataclass
class Text:
    text: str


@dataclass
class CallOpened:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    text: str


@dataclass
class Ended:
    """The turn's end: ``finish`` is "stop", "length" or "tool_calls" (a cut answer is "length" whatever
    it held; a named function's call ends "stop", as OpenAI's chat answers it)."""

    outcome: Outcome
    finish: str
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI chat-shaped, as streamed


Event = Text | CallOpened | CallArguments | Ended


async def events(run: Run, plan: Structured) -> AsyncIterator[Event]:
    """One run's answer as it is generated: its text, or its tool calls (a named or ``"required"`` call's
    arguments as they come; ``"auto"`` calls whole once the answer ended, its text up to the first call
    as it comes)."""
    calls: list[dict[str, Any]] = []
    auto = auto_reader(plan)
    forced = RequiredStream()
    if plan.mode == "named":
        assert plan.function is not None
        calls.append(new_call(plan.function, ""))
        yield CallOpened(0, calls[0]["id"], plan.function)
    async for delta in run.deltas():
        if plan.mode == "none" and delta.text:
            yield Text(delta.text)
        elif plan.mode == "auto":
            if text := auto.push(delta.text):
                yield Text(text)
        elif plan.mode == "named" and delta.text:
            calls[0]["function"]["arguments"] += delta.text
            yield CallArguments(0, delta.text)
        elif plan.mode == "required":
            for piece in forced.push(delta.text):
                if "id" in piece:
                    yield CallOpened(piece["index"], piece["id"], piece["function"]["name"])
                elif piece["function"]["arguments"]:
                    yield CallArguments(piece["index"], piece["function"]["arguments"])
    outcome = run.outcome
    assert outcome is not None
    if plan.mode == "auto":
        rest, calls = auto.finish()
        if rest:
            yield Text(rest)
        for i, call in enumerate(calls):
            yield CallOpened(i, call["id"], call["function"]["name"])
            yield CallArguments(i, call["function"]["arguments"])
    elif plan.mode == "required":
        calls = forced.calls
    yield Ended(outcome, _finish(outcome, plan, bool(calls)), calls)


def _finish(outcome: Outcome, plan: Structured, called: bool) -> str:
    if outcome.finish_reason == "length" or not called or plan.mode == "named":
        return outcome.finish_reason
    return "tool_calls"


def arguments_object(text: str) -> Any:
    """A call's arguments as an object (Anthropic's ``input``): {} for a cut or empty answer."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


class Rendering(Protocol):
    """A face's wire format for one turn's events (``responses.render``, ``messages.render``)."""

    def opening(self) -> list[dict[str, Any]]: ...

    def push(self, event: Event) -> list[dict[str, Any]]: ...


async def typed_stream(turn: Started, rendering: Rendering) -> AsyncIterator[bytes]:
    """The SSE bytes of a face whose events are typed (``event: TYPE`` then its JSON), as the Responses and
    Messages APIs send them: the opening events, then each engine event rendered."""
    for event in rendering.opening():
        yield typed_sse(event)
    async for step in events(turn.runs[0], turn.plan):
        for event in rendering.push(step):
            yield typed_sse(event)


def typed_sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
