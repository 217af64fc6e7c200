"""One prompt prefilled alone, in chunks, into a KV cache of its own, before it joins the padded loop's batch.

The padded loop (``padded.py``; ``intake.py`` routes new prompts) gives a prompt this path when what is left
to compute of it is longer than one chunk (after the beginning the prefix cache holds, if any: only the rest
is computed, after the cached keys and values; a shorter rest joins the batch in one padded prefill, with
its cached beginning): the loop then reads one chunk of it in the same forward as each decode step of the running
rows (``mixed.py``; or between two of them where the forward cannot be mixed), so that they keep producing
tokens while it is read (``ChunkSizer``: a chunk adds about 1.5 of their decode steps), and the prompt pads
nobody while it is read (its cache joins the batch's only once it is whole). The cache is transformers'
``DynamicCache`` with ``kvcache.GrowingLayer``s, as the batch's.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

import torch

from .devices import input_device
from .kvcache import growing_cache, with_cache
from .prefixcache import Hit
from .requests import RequestHandle


class ChunkSizer:
    """How many prompt tokens the next chunk reads. Alone (no row decoding), ``largest``. While rows
    decode, a chunk sized to take about ``ratio`` decode steps, from what the last steps and chunks took
    (moving averages): a running stream then waits about ``1 + ratio`` steps between two tokens while a
    long prompt is read, whatever the model, the machine and the batch (a fixed chunk of 256 tokens made
    SmolLM2's streams wait 5-7 steps on 2 cores). Never fewer than ``smallest`` tokens, so that a prompt
    is read at a useful pace even when decoding is very fast. Then rounded up so that the forward's rows
    (the chunk and the ``rows`` beside it) fill whole blocks of ``ROW_BLOCK``: torch's int8 and int4 CPU
    kernels read and convert every weight once per 4 rows, so 2 running rows and 18 prompt tokens cost
    what 2 and 16 do (SmolLM2's 30 MLPs: 9.2 ms for 16 rows, 10.9 ms for 18 and 20)."""

    ROW_BLOCK = 4

    def __init__(self, largest: int, *, ratio: float = 1.5, smallest: int = 16, weight: float = 0.3) -> None:
        self.largest, self.ratio, self.smallest, self.weight = largest, ratio, min(smallest, largest), weight
        self.step_seconds: float | None = None  # a decode step of the running rows
        self.token_seconds: float | None = None  # one prompt token of a chunk

    def decoded(self, seconds: float) -> None:
        self.step_seconds = self._mean(self.step_seconds, seconds)

    def read(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.token_seconds = self._mean(self.token_seconds, seconds / tokens)

    def next(self, decoding: bool, rows: int = 0) -> int:
        """The next chunk's size; ``rows``: the running rows computed in the same forward."""
        if not decoding:
            return self.largest
        if self.step_seconds is None or self.token_seconds is None:
            tokens = max(self.smallest, min(self.largest, 32))  # a first measurement
        else:
            tokens = max(self.smallest, min(self.largest, int(self.ratio * self.step_seconds / self.token_seconds)))
        aligned = tokens + (-(rows + tokens)) % self.ROW_BLOCK
        return aligned if aligned <= self.largest else tokens

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new


class Prefill:
    """The prompt of ``handle`` being read: ``done`` of its tokens are in ``cache`` (a cached prefix first)."""

    def __init__(self, handle: RequestHandle, config: Any, hit: Hit | None) -> None:
        self.handle = handle
        self.cache = growing_cache(config)
        self.done = 0
        self.mixes = True  # its chunks may share the running rows' forwards (False once such a forward failed)
        if hit is not None:
            for layer, (keys, values) in enumerate(zip(hit.keys, hit.values)):
                self.cache.update(keys, values, layer)  # copied into the layer's own growing buffer
            self.done = hit.tokens
        handle.cached_tokens = self.done

    @property
    def prompt(self) -> list[int]:
        return list(self.handle.request.prompt_ids)

    def next_chunk(self, budget: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The ids ``[1, n]`` and positions ``[n]`` of the next up to ``budget`` prompt tokens, and where they
        end (a mixed step reads them: ``mixed.py``)."""
        end = min(len(self.handle.request.prompt_ids), self.done + budget)
        ids = torch.tensor([self.prompt[self.done:end]], device=device)
        return ids, torch.arange(self.done, end, device=device), end

    def step(self, model: Any, lock: AbstractContextManager[Any], budget: int,
             sizer: ChunkSizer | None = None) -> torch.Tensor | None:
        """Read up to ``budget`` more prompt tokens; the next-token logits (one row) once all are read.
        ``sizer`` learns how long the chunk took."""
        prompt, device = self.prompt, input_device(model)
        end = min(len(prompt), self.done + budget)
        start = time.perf_counter()
        with lock:
            out = model(input_ids=torch.tensor([prompt[self.done:end]], device=device),
                        attention_mask=torch.ones(1, end, dtype=torch.long, device=device),
                        position_ids=torch.arange(self.done, end, device=device)[None], use_cache=True,
                        logits_to_keep=1, **with_cache(model, self.cache))
        if sizer is not None:
            sizer.read(end - self.done, time.perf_counter() - start)
        self.done = end
        return out.logits[:, -1].float() if end == len(prompt) else None
