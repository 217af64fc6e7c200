"""The several generations one request asks for (``n`` choices, one per prompt of a completions batch):
started together on the generation's engine, merged into one stream, counted once in ``usage``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from .generation import Delta, Outcome, Run

if TYPE_CHECKING:
    from .common import Lease


def start(runs: Sequence[Run], held: Lease) -> None:
    """Submit every run; when one cannot be (a full queue: 429), end them all and release the lease."""
    try:
        for run in runs:
            run.start()
    except BaseException:
        end(runs, held)
        raise


def end(runs: Sequence[Run], held: Lease) -> None:
    for run in runs:
        run.cancel()
    held.release()


async def merged(runs: Sequence[Run]) -> AsyncIterator[tuple[int, Delta | None]]:
    """(index, delta) of every run as it comes; (index, None) when a run ends. A run that fails ends the
    whole stream with its error."""
    queue: asyncio.Queue[tuple[int, Delta | None] | BaseException] = asyncio.Queue()

    async def pump(index: int, run: Run) -> None:
        try:
            async for delta in run.deltas():
                await queue.put((index, delta))
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


def usage(outcomes: Sequence[Outcome], n: int) -> dict[str, Any]:
    """Outcomes in choice order, ``n`` per prompt: each prompt counted once, every choice's tokens; the
    prompt tokens read from the prefix cache as OpenAI reports them (``prompt_tokens_details``)."""
    prompt = sum(o.prompt_tokens for o in outcomes[::n])
    completion = sum(o.completion_tokens for o in outcomes)
    cached = sum(o.cached_tokens for o in outcomes[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
