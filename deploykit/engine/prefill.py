"""One prompt prefilled alone, in chunks, into a KV cache of its own, before it joins the padded loop's batch.

The padded loop (``padded.py``) gives a prompt this path when the prefix cache holds its beginning (only
the rest is computed, after the cached keys and values) or when it is longer than one chunk: the loop then
runs one chunk of it between two decode steps of the running rows, so that they keep producing tokens
while it is read, and the prompt pads nobody while it is read (its cache joins the batch's only once it is
whole). The cache is transformers' ``DynamicCache`` with ``kvcache.GrowingLayer``s, as the batch's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from .kvcache import growing_cache
from .prefixcache import Hit
from .requests import RequestHandle


class Prefill:
    """The prompt of ``handle`` being read: ``done`` of its tokens are in ``cache`` (a cached prefix first)."""

    def __init__(self, handle: RequestHandle, config: Any, hit: Hit | None) -> None:
        self.handle = handle
        self.cache = growing_cache(config)
        self.done = 0
        if hit is not None:
            for layer, (keys, values) in enumerate(zip(hit.keys, hit.values)):
                self.cache.update(keys, values, layer)  # copied into the layer's own growing buffer
            self.done = hit.tokens
        handle.cached_tokens = self.done

    @property
    def prompt(self) -> list[int]:
        return list(self.handle.request.prompt_ids)

    def step(self, model: Any, lock: AbstractContextManager[Any], budget: int) -> torch.Tensor | None:
        """Read up to ``budget`` more prompt tokens; the next-token logits (one row) once all are read."""
        prompt = self.prompt
        end = min(len(prompt), self.done + budget)
        with lock:
            out = model(input_ids=torch.tensor([prompt[self.done:end]]),
                        attention_mask=torch.ones(1, end, dtype=torch.long),
                        position_ids=torch.arange(self.done, end)[None], past_key_values=self.cache,
                        use_cache=True, logits_to_keep=1)
        self.done = end
        return out.logits[:, -1].float() if end == len(prompt) else None
