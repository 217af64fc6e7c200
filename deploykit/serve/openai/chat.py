"""``POST /v1/chat/completions``: messages through the model's chat template, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from ...engine.batching import GenerationRequest
from ...engine.text import chat_prompt_ids, check_length
from .common import engine_request, find, max_tokens_of, prepare, sse
from .generation import Outcome, Run, whole
from .protocol import ChatCompletionRequest, new_id, now
from .stream import LeasedStream

router = APIRouter()


def _usage(outcome: Outcome) -> dict[str, int]:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = request.app.state
    dep = find(state.registry, body.model)

    def work(runtime: Any) -> GenerationRequest:
        ids = chat_prompt_ids(runtime.tokenizer, [m.as_template_message() for m in body.messages])
        max_tokens = max_tokens_of(body.requested_max_tokens(), runtime)
        check_length(len(ids), max_tokens, context_length=runtime.context_length,
                     limit=runtime.limits.max_tokens, prompt_param="messages")
        return engine_request(body, ids, max_tokens, runtime)

    held, job = await prepare(dep, "text", work)
    meta = {"id": new_id("chatcmpl"), "created": now(), "model": dep.name}
    run = Run(held.gen, dep.name, job, request, state.metrics)
    try:
        run.start()  # before the response: a full queue is a 429, not a broken stream
    except BaseException:
        held.release()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return LeasedStream(_stream(run, meta, include_usage), lease=held, runs=[run], model=dep.name)
    try:
        outcome = await whole(run)
    finally:
        run.cancel()
        held.release()
    return {**meta, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": outcome.text},
                         "logprobs": None, "finish_reason": outcome.finish_reason}],
            "usage": _usage(outcome)}


async def _stream(run: Run, meta: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    chunk = {**meta, "object": "chat.completion.chunk"}

    def delta(content: dict[str, str], finish: str | None = None) -> bytes:
        return sse({**chunk, "choices": [{"index": 0, "delta": content, "logprobs": None,
                                          "finish_reason": finish}]})

    yield delta({"role": "assistant", "content": ""})
    async for text in run.deltas():
        yield delta({"content": text})
    assert run.outcome is not None
    yield delta({}, run.outcome.finish_reason)
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": _usage(run.outcome)})
    yield sse("[DONE]")
