"""Models with sliding-window attention served exactly: tiny real Mistral (every layer windowed), Qwen2
(windowed layers above ``max_window_layers``, full ones below) and Gemma 2 (windowed and full layers
alternating), each with a window of 8 tokens, prompts of 5 to 50 tokens and 24 new tokens, so that prompts
and answers run past the window. Every backend and path of the engine (one padded batch of mixed lengths
with rows joining and leaving, prompts read in chunks, the prefix cache, continuous batching) answers
greedy requests token for token as ``generate`` does alone, with transformers' own sliding-window cache.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from deploykit.engine.batching import Engine, GenerationRequest
from test_batching import CharTokenizer

WINDOW = 8
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", {"num_key_value_heads": 1}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16}),
}
PROMPTS = [tuple((7 * i + 3 * n) % 250 + 4 for i in range(n)) for n in (5, 20, 37, 50, 12, 9)]


@cache
def sliding_model(name: str, directory: Path) -> Any:
    import transformers

    cls, extra = ARCHITECTURES[name]
    config = getattr(transformers, cls)(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, vocab_size=256, max_position_embeddings=256,
                                        sliding_window=WINDOW, **{"num_key_value_heads": 2, **extra})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory / name)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory / name, dtype=torch.float32).eval()
    assert model.config.sliding_window == WINDOW
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return sliding_model(request.param, tmp_path_factory.getbasetemp())


@cache
def generated(model: Any, prompt: tuple[int, ...], max_new: int) -> list[int]:
    """``generate`` alone, greedy, with transformers' own cache (sliding-window layers); once per prompt."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def served(model: Any, requests: list[GenerationRequest], **options: Any) -> list[list[int]]:
    """Half the requests first, the rest once the first streams (they join a running batch)."""
    eng = Engine(model, CharTokenizer(), **options)
    try:
        first = [eng.submit(r) for r in requests[:len(requests) // 2]]
        next(iter(first[0]))
        handles = first + [eng.submit(r) for r in requests[len(first):]]
        results = [h.result(timeout=120) for h in handles]
    finally:
        eng.close(timeout=30)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


@pytest.mark.parametrize("options", [{}, {"prefill_chunk": 16}, {"prefix_cache_bytes": 8 << 20},
                                     pytest.param({"backend": "continuous", "kv_cache_bytes": 64 << 20},
                                                  marks=pytest.mark.continuous)],
                         ids=["padded", "chunks", "prefix-cache", "continuous"])
def test_greedy_equals_generate_past_the_window(model: Any, options: dict[str, Any]) -> None:
    requests = [GenerationRequest(p, max_new_tokens=24) for p in PROMPTS]
    expected = [generated(model, r.prompt_ids, r.max_new_tokens) for r in requests]
    if "prefix_cache_bytes" in options:  # the same prompts again, then extended: their beginnings are cached
        requests += [GenerationRequest(p + (11, 12), max_new_tokens=24) for p in PROMPTS[:4]]
        expected += [generated(model, r.prompt_ids, r.max_new_tokens) for r in requests[len(expected):]]
    assert served(model, requests, **options) == expected
