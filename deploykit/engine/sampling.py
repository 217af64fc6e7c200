"""How one request turns the model's next-token logits into a token: OpenAI's presence and frequency
penalties and ``logit_bias``, then greedy or temperature + top_p sampling with the request's own RNG;
and the log-probabilities a request asked for. A request with a grammar (``grammar.RowGrammar``) has its
row masked to the tokens the grammar allows after penalties and bias, and the grammar accepts the token.

Log-probabilities are the log-softmax of the model's own logits, before penalties, bias and temperature
(what a client computing a likelihood needs), also under a grammar: the raw logprobs, not the masked
ones (as vLLM reports by default); a token the grammar forced can thus show a low logprob. The penalties follow OpenAI's formula, over the tokens
generated so far in this request: ``logit[t] -= presence * (count[t] > 0) + frequency * count[t]``.

Written here rather than with transformers' ``LogitsProcessor`` classes: transformers has no
presence/frequency penalty (its ``RepetitionPenaltyLogitsProcessor`` is multiplicative and counts the
prompt too) and its ``SequenceBiasLogitsProcessor`` is built for one whole batch, where every row of a
deploykit batch has its own settings, its own seed and its own tokens so far.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class SamplingRequest(Protocol):
    """The fields of ``requests.GenerationRequest`` that choosing a token reads."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def logit_bias(self) -> Sequence[tuple[int, float]]: ...
    @property
    def grammar(self) -> Any: ...


@dataclass(frozen=True)
class TokenLogprobs:
    """One token's log-probability and the ``top`` most likely tokens at its position, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestRng:
    """A sampling request's private RNG (torch.seed() would reseed the global one): its seed is fixed when
    the request is submitted, its ``torch.Generator`` made on the device of the first logits it samples
    (``multinomial`` takes a generator on the device of its tensor: a CPU one fails on a GPU's logits)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gen: torch.Generator | None = None

    def on(self, device: torch.device) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator(device=device).manual_seed(self.seed)
        return self._gen


def request_generator(r: SamplingRequest) -> RequestRng | None:
    """The request's own RNG when it samples (None when greedy)."""
    seed = r.seed if r.seed is not None else random.SystemRandom().getrandbits(63)
    return RequestRng(seed) if r.temperature > 0 else None


def is_plain_greedy(r: SamplingRequest) -> bool:
    """Greedy with nothing that changes or reports the logits: argmax of the batch is enough."""
    return (r.temperature <= 0 and r.logprobs is None and not r.logit_bias and not r.presence_penalty
            and not r.frequency_penalty and r.grammar is None)


def adjusted(logits: torch.Tensor, r: SamplingRequest, generated: Sequence[int]) -> torch.Tensor:
    """``logits`` (one row, float32) after the request's penalties and bias (the same tensor when none)."""
    if (r.presence_penalty or r.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, device=logits.device), minlength=logits.shape[-1])[: logits.shape[-1]]
        counts = counts.to(logits.dtype)
        logits = logits - r.presence_penalty * (counts > 0).to(logits.dtype) - r.frequency_penalty * counts
    if r.logit_bias:
        ids = torch.tensor([t for t, _ in r.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in r.logit_bias], dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(0, ids, bias)
    return logits


def sample_token(logits: torch.Tensor, r: SamplingRequest, gen: RequestRng | None) -> int:
    """Greedy when temperature == 0, else temperature + nucleus (top_p) sampling."""
    if r.temperature <= 0 or gen is None:
        return int(logits.argmax())
    probs = torch.softmax(logits / r.temperature, -1)
    if r.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        sp[sp.cumsum(0) - sp > r.top_p] = 0  # keep the smallest prefix with mass >= top_p
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs, 1, generator=gen.on(probs.device)))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under ``logits`` (one row) and the ``top`` best alternatives."""
    return _of(torch.log_softmax(logits.float(), -1), token, top)


def _of(logp: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    best = torch.topk(logp, top) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprobs(token, float(logp[token]), pairs)


def next_token(logits: torch.Tensor, r: SamplingRequest, generated: Sequence[int],
               gen: RequestRng | None, grammar: Any = None) -> tuple[int, TokenLogprobs | None]:
    """The request's next token after ``generated``, and its logprobs when the request asked for them;
    ``grammar`` (the request's ``RowGrammar``) masks the row first and accepts the token chosen."""
    chosen = adjusted(logits, r, generated)
    if grammar is not None:
        chosen = grammar.mask(chosen)
    token = sample_token(chosen, r, gen)
    if grammar is not None:
        grammar.accept(token)
    return token, token_logprobs(logits, token, r.logprobs) if r.logprobs is not None else None


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Each prompt token's logprobs given the tokens before it, from the logits of a forward of the whole
    prompt (``logits[i]`` predicts ``prompt[i + 1]``); the first token has none."""
    logp = torch.log_softmax(logits[: len(prompt) - 1].float(), -1)
    return [_of(logp[i], int(prompt[i + 1]), top) for i in range(len(prompt) - 1)]
