"""``LeasedStream`` in process, over plain ASGI callables: each chunk costs no timer of its own (a stream
relaying a llama.cpp answer sends one chunk per token), and a send its client never takes still ends the
stream and releases its lease."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from deploykit.serve.openai.stream import LeasedStream

CHUNKS = 500


class _Lease:
    """What a stream holds of its request's lease: ``release``, counted."""

    def __init__(self) -> None:
        self.released = 0

    def release(self) -> None:
        self.released += 1


class _TimerCountingLoop(asyncio.SelectorEventLoop):
    """asyncio's own loop; it counts the timers armed on it (``call_later`` goes through ``call_at``)."""

    timers = 0

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        self.timers += 1
        return super().call_at(when, callback, *args, context=context)


async def _chunks(n: int) -> AsyncIterator[bytes]:
    for i in range(n):
        yield f"data: {i}\n\n".encode()


def _scope(timeout: float | None = None) -> dict[str, Any]:
    scope: dict[str, Any] = {"type": "http", "asgi": {"spec_version": "2.4"}}
    if timeout is not None:
        scope["app"] = SimpleNamespace(state=SimpleNamespace(stream_send_timeout=timeout))
    return scope


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def test_a_streams_chunks_arm_no_timer_each():
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def stream() -> None:
        lease = _Lease()
        await LeasedStream(_chunks(CHUNKS), lease=lease, runs=[], model="m")(_scope(), _never, send)  # type: ignore[arg-type]
        assert lease.released == 1

    loop = _TimerCountingLoop()
    try:
        loop.run_until_complete(stream())
    finally:
        loop.close()
    assert len(sent) == CHUNKS + 2  # the start, every chunk, the end
    assert loop.timers < 5, loop.timers  # was one cancel scope and timer per send (anyio.fail_after)


def test_a_send_its_client_never_takes_ends_the_stream(caplog: pytest.LogCaptureFixture):
    taken: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        if len(taken) == 3:
            await asyncio.Event().wait()  # the client stopped reading
        taken.append(message)

    async def stream() -> _Lease:
        lease = _Lease()
        await LeasedStream(_chunks(CHUNKS), lease=lease, runs=[], model="m")(_scope(0.2), _never, send)  # type: ignore[arg-type]
        return lease

    with caplog.at_level(logging.WARNING, logger="deploykit.serve.openai.stream"):
        lease = asyncio.run(asyncio.wait_for(stream(), 30))
    assert lease.released == 1 and len(taken) == 3
    assert "read nothing for 0.2 s; the stream is ended" in caplog.text
