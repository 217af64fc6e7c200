"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not; ``n``
choices, logprobs, penalties and logit_bias as OpenAI's API defines them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ...engine.batching import GenerationRequest
from ...engine.text import chat_prompt_ids, check_length
from .choices import merged, usage, whole
from .common import engine_request, find, max_tokens_of, prepare, sse
from .generation import Delta, Outcome, Run
from .logprobs import TokenTexts, chat_content
from .protocol import ChatCompletionRequest, new_id, now

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = request.app.state
    dep = find(state.registry, body.model)

    def work(runtime: Any) -> list[GenerationRequest]:
        ids = chat_prompt_ids(runtime.tokenizer, [m.as_template_message() for m in body.messages])
        max_tokens = max_tokens_of(body.requested_max_tokens(), runtime)
        check_length(len(ids), max_tokens, context_length=runtime.context_length,
                     limit=runtime.limits.max_tokens, prompt_param="messages")
        return [engine_request(body, ids, max_tokens, runtime, choice=j, logprobs=body.top())
                for j in range(body.n)]

    stack, gen, jobs = await prepare(dep, "text", work)
    runs = [Run(gen, dep.name, job, request, state.metrics) for job in jobs]
    texts = TokenTexts(gen.runtime.tokenizer)  # type: ignore[union-attr]  # pinned: a text runtime
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": dep.name}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(stack, runs, meta, include_usage, body.n, texts),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    async with stack:
        outcomes = await asyncio.gather(*(whole(run) for run in runs))
    return {**meta, "object": "chat.completion",
            "choices": [{"index": i, "message": {"role": "assistant", "content": o.text},
                         "logprobs": _logprobs(o.logprobs, texts), "finish_reason": o.finish_reason}
                        for i, o in enumerate(outcomes)],
            "usage": usage(outcomes, body.n)}


def _logprobs(lps: Any, texts: TokenTexts) -> dict[str, Any] | None:
    return None if lps is None else {"content": chat_content(lps, texts), "refusal": None}


async def _stream(stack: AsyncExitStack, runs: list[Run], meta: dict[str, Any], include_usage: bool, n: int,
                  texts: TokenTexts) -> AsyncIterator[bytes]:
    async with stack:  # the pin ends with the stream, however it ends
        chunk = {**meta, "object": "chat.completion.chunk"}

        def choice(index: int, content: dict[str, str], logprobs: Any = None, finish: str | None = None) -> bytes:
            return sse({**chunk, "choices": [{"index": index, "delta": content, "logprobs": logprobs,
                                              "finish_reason": finish}]})

        for index in range(len(runs)):
            yield choice(index, {"role": "assistant", "content": ""})
        async for index, delta in merged(runs):
            if delta is not None:
                yield choice(index, {"content": delta.text}, _delta_logprobs(runs[index], delta, texts))
            else:
                outcome = runs[index].outcome
                assert outcome is not None
                yield choice(index, {}, finish=outcome.finish_reason)
        if include_usage:
            outcomes: list[Outcome] = [r.outcome for r in runs if r.outcome]
            yield sse({**chunk, "choices": [], "usage": usage(outcomes, n)})
        yield sse("[DONE]")


def _delta_logprobs(run: Run, delta: Delta, texts: TokenTexts) -> dict[str, Any] | None:
    return _logprobs(delta.logprobs, texts) if run.request.logprobs is not None else None
