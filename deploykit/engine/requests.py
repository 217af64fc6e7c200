"""What a text engine is asked and answers: ``GenerationRequest`` (a prompt and how to continue it),
``GenerationResult`` (the generated ids, why they ended, usage and timing), and ``RequestHandle``, which
carries one request between the caller and the engine's thread: new token ids as they come, then the
result. Every text engine (in process, pipeline stages, Ray Serve replicas) speaks these.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .types import Constraint, FinishReason
from .sampling import RequestRng, TokenLogprobs

if TYPE_CHECKING:
    from .grammar import RowGrammar

__all__ = ["GenerationRequest", "GenerationResult", "RequestHandle", "MIN_TEMPERATURE"]
_FINISH_LOCK = threading.Lock()
# Below this a temperature is greedy: logits / 1e-38 overflow float32 to inf and sampling would fail on
# NaN probabilities, while any temperature this small picks the most likely token anyway (vLLM's floor).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 => greedy, as is anything below MIN_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None  # None => random
    stop_token_ids: Sequence[int] = ()  # in addition to the model's EOS ids
    stop_strings: Sequence[str] = ()
    logprobs: int | None = None  # None: none; k: each generated token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    presence_penalty: float = 0.0  # OpenAI's penalties over the tokens generated so far (sampling.py)
    frequency_penalty: float = 0.0
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias added to its logit)
    grammar: Constraint | None = None  # what the output must follow (grammar.py); None: free text
    adapter: str | None = None  # the LoRA adapter this request computes with (adapters.py); None: the base

    def __post_init__(self) -> None:
        if self.temperature < MIN_TEMPERATURE:  # every engine then reads it as greedy (0)
            object.__setattr__(self, "temperature", 0.0)

    def is_plain(self) -> bool:
        """Nothing beyond greedy / temperature / top_p: what every backend can serve."""
        return (self.logprobs is None and self.prompt_logprobs is None and not self.presence_penalty
                and not self.frequency_penalty and not self.logit_bias and self.grammar is None)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # every generated token, the stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float | None  # seconds since submit
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token after the first
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(eq=False)
class RequestHandle:
    """Yields new token ids as they are produced, then ends with a :class:`GenerationResult`."""

    request: GenerationRequest
    id: str
    rng: RequestRng | None = None  # private sampling RNG
    grammar: RowGrammar | None = None  # this request's own matcher, when it has a constraint
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)  # written by the engine thread only
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when requested
    prompt_logprobs: list[TokenLogprobs] | None = None  # set before the first token is pushed
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (set before the first token)
    done: bool = False  # set (under _FINISH_LOCK) just before the final result
    finished: threading.Event = field(default_factory=threading.Event)
    listener: Callable[[int | GenerationResult], None] | None = None  # called from the engine's thread
    on_finish: Callable[[], None] | None = None  # called once when it ends (the engine releases what it held)
    _final: GenerationResult | None = None
    _q: queue.Queue[int | GenerationResult] = field(default_factory=queue.Queue)

    # push and finish are the engine side of a handle (deploykit's engines call them; callers read).
    def push(self, tok: int, logprobs: TokenLogprobs | None = None) -> None:
        self.first_token_at = self.first_token_at or time.monotonic()
        if logprobs is not None:  # before the listener hears of the token: it may read them at once
            self.logprobs.append(logprobs)
        self.tokens.append(tok)
        self._q.put(tok)
        if self.listener is not None:
            self.listener(tok)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        with _FINISH_LOCK:  # the first final wins (client cancel vs. engine end race)
            if self.done:
                return
            self.done = True
        if self.on_finish is not None:
            self.on_finish()
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted
        n, m = len(self.request.prompt_ids), len(self.tokens)
        lps = list(self.logprobs) if self.request.logprobs is not None else None
        self._final = GenerationResult(list(self.tokens), reason, n, m, ttft, error, lps, self.prompt_logprobs,
                                       cached_tokens=self.cached_tokens)
        self.finished.set()
        self._q.put(self._final)
        if self.listener is not None:
            self.listener(self._final)

    def __iter__(self) -> Iterator[int]:
        """Blocking iteration over new token ids (asyncio: ``iterate_in_threadpool(handle)``)."""
        while not isinstance(item := self._q.get(), GenerationResult):
            yield item

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self.finished.wait(timeout) or self._final is None:
            raise TimeoutError(f"request {self.id} still running")
        return self._final
