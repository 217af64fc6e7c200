"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not; ``n``
choices, logprobs, penalties and logit_bias as OpenAI's API defines them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from ...engine.requests import GenerationRequest
from ...engine.text import chat_prompt_ids, check_length
from ..served_by import mark
from .choices import end, merged, start, usage
from .common import engine_request, find, max_tokens_of, prepare, sse
from .generation import Outcome, Run, whole
from .logprobs import TokenTexts, chat_content
from .protocol import ChatCompletionRequest, new_id, now
from .stream import LeasedStream

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = request.app.state
    dep = await find(state.registry, body.model)

    def work(runtime: Any) -> list[GenerationRequest]:
        ids = chat_prompt_ids(runtime.tokenizer, [m.as_template_message() for m in body.messages])
        max_tokens = max_tokens_of(body.requested_max_tokens(), runtime)
        check_length(len(ids), max_tokens, context_length=runtime.context_length,
                     limit=runtime.limits.max_tokens, prompt_param="messages")
        return [engine_request(body, ids, max_tokens, runtime, choice=j, logprobs=body.top())
                for j in range(body.n)]

    held, jobs = await prepare(dep, "text", work)
    mark(request, held.gen)
    runs = [Run(held.gen, dep.name, job, request, state.metrics) for job in jobs]
    start(runs, held)  # before the response: a full queue is a 429, not a broken stream
    texts = TokenTexts(held.runtime.tokenizer)
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": dep.name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return LeasedStream(_stream(runs, meta, include_usage, body.n, texts), lease=held, runs=runs,
                            model=dep.name)
    try:
        outcomes = await asyncio.gather(*(whole(run) for run in runs))
    finally:
        end(runs, held)
    return {**meta, "object": "chat.completion",
            "choices": [{"index": i, "message": {"role": "assistant", "content": o.text},
                         "logprobs": _logprobs(o.logprobs, texts), "finish_reason": o.finish_reason}
                        for i, o in enumerate(outcomes)],
            "usage": usage(outcomes, body.n)}


def _logprobs(lps: Any, texts: TokenTexts) -> dict[str, Any] | None:
    return None if lps is None else {"content": chat_content(lps, texts), "refusal": None}


async def _stream(runs: list[Run], meta: dict[str, Any], include_usage: bool, n: int,
                  texts: TokenTexts) -> AsyncIterator[bytes]:
    chunk = {**meta, "object": "chat.completion.chunk"}

    def choice(index: int, content: dict[str, str], logprobs: Any = None, finish: str | None = None) -> bytes:
        return sse({**chunk, "choices": [{"index": index, "delta": content, "logprobs": logprobs,
                                          "finish_reason": finish}]})

    for index in range(len(runs)):
        yield choice(index, {"role": "assistant", "content": ""})
    async for index, delta in merged(runs):
        if delta is not None:
            wants = runs[index].request.logprobs is not None
            yield choice(index, {"content": delta.text}, _logprobs(delta.logprobs, texts) if wants else None)
        else:
            outcome = runs[index].outcome
            assert outcome is not None
            yield choice(index, {}, finish=outcome.finish_reason)
    if include_usage:
        outcomes: list[Outcome] = [r.outcome for r in runs if r.outcome]
        yield sse({**chunk, "choices": [], "usage": usage(outcomes, n)})
    yield sse("[DONE]")
