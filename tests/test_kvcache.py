"""The padded loop's in-place KV cache (deploykit.engine.kvcache) on the tiny real Llama: the same logits
as transformers' own DynamicCache, and no copy of the cache per decode step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from deploykit.engine.kvcache import HEADROOM, GrowingLayer, growing_cache


def test_a_growing_cache_gives_dynamic_cache_logits_without_a_copy_per_step(tiny_model: Callable[[str], Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    ids = torch.randint(4, 256, (3, 9), generator=torch.Generator().manual_seed(0))
    runs = []
    for cache in (DynamicCache(config=model.config), growing_cache(model.config)):
        logits, buffers = [], set()
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            for _ in range(HEADROOM - 5):
                logits.append(out.logits[:, -1])
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                buffers.add(cache.layers[0].keys.data_ptr())
        runs.append((torch.stack(logits), buffers, cache))
    (expected, copies, _), (got, in_place, cache) = runs
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert torch.allclose(got, expected, atol=1e-5)
    assert len(in_place) == 1 < len(copies)  # one buffer for every step; concatenation makes a new tensor each
