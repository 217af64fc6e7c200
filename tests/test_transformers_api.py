"""deploykit calls transformers' API as the installed version has it: no FutureWarning or DeprecationWarning
from its calls, in process (every path of the engine) or in a ``deploykit serve`` log. transformers renamed
its models' ``past_key_values`` argument and output to ``cache`` (the old name warns, and goes in 5.40); the
engine passes and reads whichever name the model's forward has (``kvcache.with_cache``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chatmodel import build_chat_model
from deploykit.engine.batching import Engine, GenerationRequest
from deploykit.engine.kvcache import growing_cache, returned_cache, with_cache
from servers import Server
from test_batching import CharTokenizer, prompts
from test_serve import chat_manifest

DEPRECATED = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def test_the_engine_paths_warn_of_nothing(tiny_model: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    requests = [GenerationRequest(p, max_new_tokens=6) for p in prompts(4, seed=1)]
    requests += [GenerationRequest(tuple(range(10, 60)), max_new_tokens=4, temperature=0.7, seed=1)] * 2
    with warnings.catch_warnings(record=True) as seen:  # process-wide: the engine's thread's warnings too
        warnings.simplefilter("always")
        for options in ({}, {"prefill_chunk": 8, "prefix_cache_bytes": 8 << 20, "max_batch_size": 2}):
            eng = Engine(model, CharTokenizer(), **options)
            try:
                results = [h.result(timeout=120) for h in [eng.submit(r) for r in requests]]
            finally:
                eng.close(timeout=30)
            assert all(r.error is None for r in results)
    assert [str(w.message) for w in seen if issubclass(w.category, DEPRECATED)] == []


def test_the_cache_goes_in_and_comes_out_under_the_forwards_own_name(tiny_model: Callable[[str], Path]) -> None:
    import inspect

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    [name] = with_cache(model, None)
    assert name in inspect.signature(type(model).forward).parameters
    past = growing_cache(model.config)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=True, **with_cache(model, past))
    assert returned_cache(out) is past and past.get_seq_length() == 3


def test_a_serve_log_has_no_deprecation_warning(tmp_path: Path) -> None:
    from openai import OpenAI

    model = build_chat_model(tmp_path / "model")
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "chat.yaml").write_text(
        chat_manifest(model, serving="{max_tokens: 64, default_max_tokens: 16, prefix_cache: {enabled: true}}"))
    # transformers' own logger at warning level too (its renamed-name notices are logged, not warned)
    with Server(tmp_path / "manifests", tmp_path / "state",
                env={"TRANSFORMERS_VERBOSITY": "warning", "PYTHONWARNINGS": "default"}) as s:
        client = OpenAI(base_url=f"{s.url}/v1", api_key="none")
        for _ in range(2):
            client.completions.create(model="tiny-chat", prompt="Once upon a time " * 4, max_tokens=8)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}})
    assert "Uvicorn running" in s.stderr or "127.0.0.1" in s.stderr  # the log was read
    assert not [line for line in s.stderr.splitlines()
                if any(word in line for word in ("FutureWarning", "DeprecationWarning", "deprecated"))], s.stderr
