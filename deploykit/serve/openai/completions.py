"""``POST /v1/completions``: one or more prompts (text or token ids), streamed or not; ``n`` choices per
prompt (choice ``p * n + j`` is prompt p's j-th), legacy logprobs, and ``echo`` (with ``max_tokens: 0``
and ``logprobs``: the prompt's own log-likelihood, as evaluation harnesses ask)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from ...engine.requests import GenerationRequest
from ...engine.text import RequestError, check_length, completion_prompt_ids
from ..served_by import mark
from .choices import end, merged, start, usage
from . import relay
from .common import check_adapter, engine_request, find, lease, max_tokens_of, model_parts, prepared, sse
from .generation import Outcome, Run, whole
from .logprobs import LegacyLogprobs, TokenTexts
from .protocol import CompletionRequest, new_id, now
from .stream import LeasedStream

router = APIRouter()


@dataclass
class Choice:
    """One choice's engine request and, when echoed, its prompt's text."""

    job: GenerationRequest
    echo: str | None


def _choices(body: CompletionRequest, runtime: Any, adapter: str | None) -> list[Choice]:
    prompts = body.prompts()
    if len(prompts) * body.n > runtime.limits.max_input_items:
        raise RequestError(f"{len(prompts)} prompts x n={body.n} in one request; this model takes at most "
                           f"{runtime.limits.max_input_items} (spec.serving.max_input_items)", param="prompt")
    max_tokens = max_tokens_of(body.max_tokens, runtime)
    prompt_logprobs = body.logprobs if body.echo else None
    choices = []
    for prompt in prompts:
        ids = completion_prompt_ids(runtime.tokenizer, prompt)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        check_length(len(ids), max_tokens, context_length=runtime.context_length, limit=runtime.limits.max_tokens)
        echo = (prompt if isinstance(prompt, str) else str(runtime.tokenizer.decode(ids))) if body.echo else None
        choices += [Choice(engine_request(body, ids, max_tokens, runtime, choice=j, logprobs=body.logprobs,
                                          prompt_logprobs=prompt_logprobs, adapter=adapter), echo)
                    for j in range(body.n)]
    return choices


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = request.app.state
    base, adapter = model_parts(body.model)
    dep = await find(state.registry, base)
    held = await lease(dep, "text")
    mark(request, held.gen)
    check_adapter(held, body.model, adapter)
    if relay.is_relayed(held):  # llama.cpp: llama-server computes the validated request
        return await relay.completions(body, request, held, dep.name)
    held, choices = await prepared(held, lambda runtime: _choices(body, runtime, adapter))
    runs = [Run(held.gen, dep.name, c.job, request, state.metrics) for c in choices]
    start(runs, held)  # before the response: a full queue is a 429, not a broken stream
    texts = TokenTexts(held.runtime.tokenizer)
    meta = {"id": new_id("cmpl"), "created": now(), "model": body.model, "object": "text_completion"}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return LeasedStream(_stream(runs, choices, meta, include_usage, body.n, texts), lease=held, runs=runs,
                            model=dep.name)
    try:
        outcomes = await asyncio.gather(*(whole(run) for run in runs))
    finally:
        end(runs, held)
    return {**meta, "choices": [_choice(i, c, o, texts) for i, (c, o) in enumerate(zip(choices, outcomes))],
            "usage": usage(outcomes, body.n)}


def _choice(index: int, choice: Choice, outcome: Outcome, texts: TokenTexts) -> dict[str, Any]:
    logprobs = None
    if choice.job.logprobs is not None:
        legacy = LegacyLogprobs(texts)
        head = {} if choice.echo is None else legacy.echo(choice.job.prompt_ids, outcome.prompt_logprobs or [])
        tail = legacy.piece(outcome.logprobs or [])
        logprobs = {key: head.get(key, []) + tail[key] for key in tail}
    return {"index": index, "text": (choice.echo or "") + outcome.text, "logprobs": logprobs,
            "finish_reason": outcome.finish_reason}


async def _stream(runs: list[Run], choices: list[Choice], meta: dict[str, Any], include_usage: bool, n: int,
                  texts: TokenTexts) -> AsyncIterator[bytes]:
    legacy = [LegacyLogprobs(texts) for _ in runs]
    echoed: set[int] = set()

    def chunk(index: int, text: str, logprobs: Any, finish: str | None = None) -> bytes:
        return sse({**meta, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    async for index, delta in merged(runs):
        run, choice = runs[index], choices[index]
        wants = run.request.logprobs is not None
        if choice.echo is not None and index not in echoed:  # the prompt first (its logprobs are known now)
            echoed.add(index)
            prompt_lps = run.handle.prompt_logprobs if run.handle is not None else None
            yield chunk(index, choice.echo, legacy[index].echo(run.request.prompt_ids, prompt_lps or [])
                        if wants else None)
        if delta is not None:
            yield chunk(index, delta.text, legacy[index].piece(delta.logprobs) if wants else None)
        else:
            outcome = run.outcome
            assert outcome is not None
            yield chunk(index, "", None, outcome.finish_reason)
    if include_usage:
        yield sse({**meta, "choices": [], "usage": usage([r.outcome for r in runs if r.outcome], n)})
    yield sse("[DONE]")
