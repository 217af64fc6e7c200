"""The reference for OpenAI's presence/frequency penalties and ``logit_bias``: a transformers
``LogitsProcessor`` applying the formula to ``generate``'s scores, which deploykit's engine must match
token for token."""

from __future__ import annotations

import torch


class Penalties:
    """logit[t] -= presence * (count[t] > 0) + frequency * count[t] over the generated tokens; then
    logit[t] += bias[t]."""

    def __init__(self, prompt_len: int, presence: float = 0.0, frequency: float = 0.0,
                 bias: dict[int, float] | None = None) -> None:
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias or {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:]):
            counts = torch.bincount(ids, minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= self.presence * (counts > 0).to(scores.dtype) + self.frequency * counts
        for token, bias in self.bias.items():
            scores[:, token] += bias
        return scores
