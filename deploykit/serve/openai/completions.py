"""``POST /v1/completions``: one or more prompts (text or token ids), streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from ...engine.batching import GenerationRequest
from ...engine.text import RequestError, check_length, completion_prompt_ids
from ..errors import APIError
from .common import Lease, engine_request, find, max_tokens_of, prepare, sse
from .generation import Outcome, Run, whole
from .protocol import CompletionRequest, new_id, now
from .stream import LeasedStream

router = APIRouter()


def _usage(outcomes: list[Outcome]) -> dict[str, int]:
    prompt = sum(o.prompt_tokens for o in outcomes)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _jobs(body: CompletionRequest, runtime: Any) -> list[GenerationRequest]:
    prompts = body.prompts()
    if len(prompts) > runtime.limits.max_input_items:
        raise RequestError(f"{len(prompts)} prompts in one request; this model takes at most "
                           f"{runtime.limits.max_input_items} (spec.serving.max_input_items)", param="prompt")
    max_tokens = max_tokens_of(body.max_tokens, runtime)
    jobs = []
    for prompt in prompts:
        ids = completion_prompt_ids(runtime.tokenizer, prompt)
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        check_length(len(ids), max_tokens, context_length=runtime.context_length, limit=runtime.limits.max_tokens)
        jobs.append(engine_request(body, ids, max_tokens, runtime))
    return jobs


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = request.app.state
    dep = find(state.registry, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported")
    held, jobs = await prepare(dep, "text", lambda runtime: _jobs(body, runtime))
    runs = [Run(held.gen, dep.name, job, request, state.metrics) for job in jobs]
    try:
        for run in runs:
            run.start()  # before the response: a full queue is a 429, not a broken stream
    except BaseException:
        _end(runs, held)
        raise
    meta = {"id": new_id("cmpl"), "created": now(), "model": dep.name, "object": "text_completion"}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return LeasedStream(_stream(runs, meta, include_usage), lease=held, runs=runs, model=dep.name)
    try:
        outcomes = await asyncio.gather(*(whole(run) for run in runs))
    finally:
        _end(runs, held)
    return {**meta, "choices": [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                                for i, o in enumerate(outcomes)], "usage": _usage(list(outcomes))}


def _end(runs: list[Run], held: Lease) -> None:
    for run in runs:
        run.cancel()
    held.release()


async def _merged(runs: list[Run]) -> AsyncIterator[tuple[int, str | None]]:
    """(index, text delta) of every run as it comes; (index, None) when a run ends."""
    queue: asyncio.Queue[tuple[int, str | None] | BaseException] = asyncio.Queue()

    async def pump(index: int, run: Run) -> None:
        try:
            async for text in run.deltas():
                await queue.put((index, text))
            await queue.put((index, None))
        except BaseException as exc:  # surfaced to the stream below
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        for _ in range(len(runs)):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item[1] is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(runs: list[Run], meta: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    async for index, text in _merged(runs):
        if text is not None:
            yield sse({**meta, "choices": [{"index": index, "text": text, "logprobs": None,
                                            "finish_reason": None}]})
        else:
            outcome = runs[index].outcome
            assert outcome is not None
            yield sse({**meta, "choices": [{"index": index, "text": "", "logprobs": None,
                                            "finish_reason": outcome.finish_reason}]})
    if include_usage:
        yield sse({**meta, "choices": [], "usage": _usage([r.outcome for r in runs if r.outcome])})
    yield sse("[DONE]")
