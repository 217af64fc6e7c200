"""The one admission core of every text engine (in process, pipeline stages, Ray Serve replicas): the
request checks, the bounded waiting queue (``QueueFull`` past ``max_queued``, which the API answers with
429 and ``Retry-After``), requests taken FIFO up to a budget, the running/waiting counts, closing, and
the stop rule (EOS, stop ids, stop strings, length).

It owns no model and no thread: each engine's worker takes requests from it and decides how to run
them. It must never import torch (the replica front end uses it without a model).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DeploykitError
from .types import FinishReason

if TYPE_CHECKING:
    from .requests import GenerationRequest, RequestHandle

__all__ = ["Admission", "EngineClosed", "FinishReason", "QueueFull", "stop_reason"]


class QueueFull(DeploykitError):
    """Raised by an engine's ``submit`` when ``max_queued`` requests are already waiting."""


class EngineClosed(RuntimeError):
    """Raised by ``submit`` once the engine is closing."""


class Admission:
    """Waiting requests of one engine, behind one condition; every method is safe from any thread."""

    def __init__(self, *, max_queued: int, prefix: str = "req") -> None:
        self.max_queued = max_queued
        self.running = 0  # written by the engine's worker(s)
        self.cond = threading.Condition()
        self.closing = threading.Event()
        self._waiting: deque[RequestHandle] = deque()
        self._ids = itertools.count()
        self._prefix = prefix

    def check(self, request: GenerationRequest) -> str:
        """A fresh request id, or why ``request`` cannot be taken (closed engine, empty request)."""
        if self.closing.is_set():
            raise EngineClosed("engine is closed")
        if not request.prompt_ids or request.max_new_tokens < 0:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 0")
        return f"{self._prefix}-{next(self._ids)}"

    def put(self, handle: RequestHandle, *, free_slots: int = 0) -> None:
        """Queue ``handle``; QueueFull when ``max_queued`` (not counting cancelled ones, nor the
        ``free_slots`` requests the engine's worker takes at once) already wait."""
        room = self.max_queued + free_slots
        with self.cond:
            if len(self._waiting) >= room:  # purge cancelled ones before refusing
                self._waiting = deque(w for w in self._waiting if not w.done)
            if len(self._waiting) >= room:
                raise QueueFull(f"{self.max_queued} requests already waiting")
            self._waiting.append(handle)
            self.cond.notify_all()

    def take(self, limit: int, fits: Callable[[list[RequestHandle], RequestHandle], bool] | None = None
             ) -> list[RequestHandle]:
        """Pop up to ``limit`` waiting requests, FIFO, while ``fits(taken, next)`` holds; requests
        cancelled while waiting are dropped on the way."""
        taken: list[RequestHandle] = []
        with self.cond:
            while self._waiting and len(taken) < limit:
                h = self._waiting[0]
                if not h.done and fits is not None and not fits(taken, h):
                    break
                self._waiting.popleft()
                if not h.done:
                    taken.append(h)
        return taken

    def wait_for_work(self, timeout: float, ready: Callable[[], bool] = lambda: True) -> bool:
        """Sleep until a request waits (and ``ready()``) or the engine closes; False once it is closing
        with nothing left waiting (the worker should end)."""
        with self.cond:
            if self.closing.is_set() and not self._waiting:
                return False
            self.cond.wait_for(lambda: (bool(self._waiting) and ready()) or self.closing.is_set(), timeout)
            return not (self.closing.is_set() and not self._waiting)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stats(self) -> dict[str, int]:
        """Requests being decoded and waiting for a slot, now."""
        with self.cond:
            waiting = sum(not h.done for h in self._waiting)
        return {"running": self.running, "waiting": waiting}

    def close(self) -> None:
        """Refuse new requests; workers finish what runs and what waits, then end."""
        self.closing.set()
        self.notify()


def stop_reason(handle: RequestHandle, token: int, *, eos_ids: set[int], tokenizer: Any) -> FinishReason | None:
    """Why ``handle`` ends after ``token`` ("stop": EOS, a stop id, a stop string or the end of its grammar;
    "length"), or None."""
    r = handle.request  # for stop strings, decode only a tail long enough to hold any of them
    tail = _tail(tokenizer, handle.tokens, r.stop_strings)
    if handle.grammar is not None and handle.grammar.terminated:
        return "stop"
    if token in eos_ids or token in r.stop_token_ids or any(s in tail for s in r.stop_strings):
        return "stop"
    return "length" if len(handle.tokens) >= r.max_new_tokens else None


def _tail(tokenizer: Any, tokens: Sequence[int], stop_strings: Sequence[str]) -> str:
    if not stop_strings:
        return ""
    return str(tokenizer.decode(list(tokens[-(max(map(len, stop_strings)) + 8):])))
