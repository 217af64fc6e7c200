"""Teacher-forced scoring of golden references on a loaded generation, and the comparison of two.

A rollout's golden gates ask how much a new generation moves the model's answers, without sampling:
each reference (prompt or chat, then its completion) runs through the model in one forward, and the
logits at the completion's positions give the per-token negative log-likelihood of the completion and the
model's most likely token at each position. Two generations' scores then give the NLL increase, as the
mean of the per-case paired differences with its confidence interval, and the share of positions where
their most likely tokens agree (``compare``, pure).

Only an in-process model can be scored (its ``LoadedModel.model``); a runtime whose model runs elsewhere
(Ray stages, replicas) is refused at the manifest field before anything loads.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..threads import release_openmp_threads
from .text import RequestError, chat_prompt_ids, completion_prompt_ids

if TYPE_CHECKING:
    from ..spec.golden import GoldenCase
    from .loader import LoadedModel


@dataclass(frozen=True)
class CaseScore:
    """One reference scored by one generation: the completion's token ids, the NLL of each (nats), and the
    model's most likely token at each of those positions."""

    reference: tuple[int, ...]
    nll: tuple[float, ...]
    top1: tuple[int, ...]


CONFIDENCE = 0.95  # of the interval around the mean paired NLL difference


@dataclass(frozen=True)
class GoldenComparison:
    """What the new generation changes on the golden set, case by case.

    Each case's NLL is its mean per completion token, so that a long completion does not outweigh the rest;
    ``differences`` are the paired per-case differences (new minus serving, nats per token), ``serving_nll``
    and ``new_nll`` the means of the cases' NLLs, and ``interval`` the 95% confidence interval of the mean
    difference (Student's t over the cases; infinite with one case). ``top1_agreement`` is the share of all
    completion positions where both generations pick the same token."""

    serving_nll: float
    new_nll: float
    top1_agreement: float
    positions: int
    cases: int
    differences: tuple[float, ...] = ()
    interval: tuple[float, float] = (-math.inf, math.inf)

    @property
    def nll_increase(self) -> float:
        return self.new_nll - self.serving_nll


def case_ids(tokenizer: Any, case: GoldenCase) -> tuple[list[int], list[int]]:
    """The prompt's ids (a chat through the model's chat template, with the generation prompt) and the
    completion's ids (no special tokens: it continues the prompt)."""
    if case.messages is not None:
        prompt = chat_prompt_ids(tokenizer, list(case.messages))
    else:
        prompt = completion_prompt_ids(tokenizer, case.prompt or "")
    completion = [int(i) for i in tokenizer(case.completion, add_special_tokens=False)["input_ids"]]
    if not prompt or not completion:
        raise RequestError("a golden case tokenizes to an empty prompt or completion")
    return prompt, completion


def score(loaded: LoadedModel, tokenizer: Any, cases: Sequence[GoldenCase], *,
          forward_lock: threading.Lock | None = None) -> list[CaseScore]:
    """Each case's ``CaseScore`` on ``loaded``'s model: one forward per case, no sampling."""
    if loaded.model is None:
        raise RequestError("this generation's model runs outside this process: it cannot be scored")
    try:
        return [_score_case(loaded, tokenizer, case, forward_lock) for case in cases]
    finally:  # the serving engines run faster without this thread's OpenMP team (deploykit.threads)
        release_openmp_threads()


def _score_case(loaded: LoadedModel, tokenizer: Any, case: GoldenCase,
                forward_lock: threading.Lock | None) -> CaseScore:
    import torch

    prompt, completion = case_ids(tokenizer, case)
    ids = torch.tensor([prompt + completion], device=loaded.input_device)
    with torch.no_grad(), (forward_lock or nullcontext()):
        logits = loaded.model(input_ids=ids, use_cache=False).logits[0]  # one forward: no cache to keep
    # the logits at position i predict token i + 1: the completion is predicted from len(prompt) - 1 on
    at = logits[len(prompt) - 1: len(prompt) - 1 + len(completion)].float()
    target = torch.tensor(completion, device=at.device)
    nll = -torch.log_softmax(at, dim=-1).gather(1, target[:, None])[:, 0]
    return CaseScore(tuple(completion), tuple(nll.tolist()), tuple(at.argmax(dim=-1).tolist()))


def reference_tokens(tokenizer: Any, cases: Sequence[GoldenCase]) -> int:
    """How many completion tokens ``cases`` hold for ``tokenizer``: the evidence the golden gates score."""
    return sum(len(case_ids(tokenizer, case)[1]) for case in cases)


def compare(serving: Sequence[CaseScore], new: Sequence[CaseScore]) -> GoldenComparison:
    """The new generation against the serving one on the same cases. Where the two tokenize a completion
    differently (a changed tokenizer), none of its positions counts as agreeing."""
    if len(serving) != len(new) or not serving:
        raise ValueError("compare needs the same, non-empty list of cases scored by both generations")
    old_means = [statistics.fmean(s.nll) for s in serving]
    new_means = [statistics.fmean(n.nll) for n in new]
    differences = tuple(b - a for a, b in zip(old_means, new_means))
    new_n = sum(len(n.nll) for n in new)
    agree = sum(sum(a == b for a, b in zip(o.top1, n.top1)) for o, n in zip(serving, new)
                if o.reference == n.reference)
    return GoldenComparison(statistics.fmean(old_means), statistics.fmean(new_means), agree / new_n, new_n,
                            len(new), differences, mean_interval(differences))


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The ``confidence`` interval of the mean of ``values`` (Student's t, scipy's quantile): the mean
    alone when they are all equal, unbounded with fewer than two."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return -math.inf, math.inf
    spread = statistics.stdev(values)
    if spread == 0:
        return mean, mean
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, len(values) - 1)) * spread / math.sqrt(len(values))
    return mean - half, mean + half
