"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not; ``n``
choices, logprobs, penalties and logit_bias as OpenAI's API defines them; ``response_format`` and
``tools`` (``structured.py``: what they ask; the engine enforces the schema). The request is pinned,
tokenised and started by ``turn.py``, below this face and the Responses and Messages faces alike.

Tool calls are answered as ``message.tool_calls`` with finish_reason ``"tool_calls"`` for
``tool_choice: "required"`` and ``"auto"``, and ``"stop"`` for a named function (as OpenAI answers it); a
cut answer (``max_tokens``) ends with ``"length"`` whatever it held; a forced call is never content (a
cut ``"required"`` answer holds the calls as far as they were written). Streamed, a named function's
arguments and each ``"required"`` call (its id and name, then its arguments) come as they are generated
(OpenAI's tool-call deltas); the calls of ``"auto"`` come whole once the answer ended (they are read from
the whole answer), its content as it comes up to the first call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from . import relay
from .choices import end, merged, usage
from .common import sse
from .generation import Outcome, Run, whole
from .logprobs import TokenTexts, chat_content
from .protocol import ChatCompletionRequest, new_id, now
from .stream import LeasedStream
from .structured import GenericStream, HermesStream, RequiredStream, Structured, auto_reader, new_call
from .turn import answer_of, pinned, started

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    held = await pinned(body, request)
    if relay.is_relayed(held):  # llama.cpp: llama-server computes the validated request
        return await relay.chat(body, request, held, held.dep.name)
    turn = await started(body, request, held)
    held, runs, texts, plan = turn.held, turn.runs, turn.texts, turn.plan
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": body.model}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return LeasedStream(_stream(runs, meta, include_usage, body.n, texts, plan), lease=held, runs=runs,
                            model=turn.model)
    try:
        outcomes = await asyncio.gather(*(whole(run) for run in runs))
    finally:
        end(runs, held)
    return {**meta, "object": "chat.completion",
            "choices": [{"index": i, **_message(o, plan), "logprobs": _logprobs(o.logprobs, texts)}
                        for i, o in enumerate(outcomes)],
            "usage": usage(outcomes, body.n)}


def _message(outcome: Outcome, plan: Structured) -> dict[str, Any]:
    """A choice's message and finish_reason: its text, or the tool calls read from it (``refusal`` null:
    deploykit's models never answer with OpenAI's refusal, and its API requires the field)."""
    message: dict[str, Any] = {"role": "assistant", "content": outcome.text, "refusal": None}
    content, calls = answer_of(outcome, plan)
    if not calls:  # a forced answer cut before its first call is still no content (``answer_of``: None)
        return {"message": {**message, "content": content}, "finish_reason": outcome.finish_reason}
    finish = outcome.finish_reason if outcome.finish_reason == "length" or plan.mode == "named" else "tool_calls"
    return {"message": {**message, "content": content, "tool_calls": calls}, "finish_reason": finish}


def _logprobs(lps: Any, texts: TokenTexts) -> dict[str, Any] | None:
    return None if lps is None else {"content": chat_content(lps, texts), "refusal": None}


async def _stream(runs: list[Run], meta: dict[str, Any], include_usage: bool, n: int,
                  texts: TokenTexts, plan: Structured) -> AsyncIterator[bytes]:
    chunk = {**meta, "object": "chat.completion.chunk"}

    def choice(index: int, content: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> bytes:
        return sse({**chunk, "choices": [{"index": index, "delta": content, "logprobs": logprobs,
                                          "finish_reason": finish}]})

    autos = [auto_reader(plan) for _ in runs]
    forced = [RequiredStream() for _ in runs]
    for index in range(len(runs)):
        if plan.mode == "named":  # the call first; its arguments stream as they are generated
            assert plan.function is not None
            call = {"index": 0, **new_call(plan.function, "")}
            yield choice(index, {"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            yield choice(index, {"role": "assistant", "content": ""})
    async for index, delta in merged(runs):
        lps = _logprobs(delta.logprobs, texts) if delta and runs[index].request.logprobs is not None else None
        if delta is not None and plan.mode == "named":
            yield choice(index, {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}, lps)
        elif delta is not None and plan.mode == "none":
            yield choice(index, {"content": delta.text}, lps)
        elif delta is not None and plan.mode == "auto":
            yield choice(index, {"content": autos[index].push(delta.text)}, lps)
        elif delta is not None:  # "required": each call's id and name, then its arguments as they come
            calls = forced[index].push(delta.text)
            if calls or lps is not None:
                yield choice(index, {"tool_calls": calls} if calls else {}, lps)
        else:
            outcome = runs[index].outcome
            assert outcome is not None
            for part in _ending(outcome, plan, autos[index]):
                yield choice(index, part)
            yield choice(index, {}, finish=_message(outcome, plan)["finish_reason"])
    if include_usage:
        outcomes: list[Outcome] = [r.outcome for r in runs if r.outcome]
        yield sse({**chunk, "choices": [], "usage": usage(outcomes, n)})
    yield sse("[DONE]")


def _ending(outcome: Outcome, plan: Structured, auto: HermesStream | GenericStream) -> list[dict[str, Any]]:
    """What an "auto" answer sends once it ended: its content not sent yet, then each call (the others
    streamed theirs as they came)."""
    if plan.mode != "auto":
        return []
    content, calls = auto.finish()
    parts: list[dict[str, Any]] = [{"content": content}] if content else []
    return parts + [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]
