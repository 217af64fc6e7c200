"""Every tensor the transformers engine creates is made on the device of the tensor it meets: the model's
input embedding for inputs (ids, positions, masks), the logits for sampling (generators, penalty counts,
bias, grammar masks), each cache layer's own tensors for the KV cache.

A CPU machine cannot show a tensor on the wrong GPU, but it can show a tensor made without an explicit
device: with ``torch.set_default_device("meta")`` every such tensor lands on the meta device and the step
that meets the model's (CPU) tensors fails, while tensors made ``like`` another one or on a named device
are unaffected. The default device is per thread (a ``threading.local`` holding a TorchFunctionMode), so
``meta_everywhere`` sets it in the calling thread and in every thread started meanwhile (the engine's
worker, transformers' continuous-batching thread, the embedder's worker): ``threading.setprofile``
installs a function that runs first in each new thread, sets the default device there and removes itself.

Each path runs twice, on a plain engine and under ``meta_everywhere``, and must answer the same.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from chatmodel import build_chat_model
from deploykit.engine.batching import Engine, GenerationRequest
from deploykit.engine.types import Constraint
from test_batching import CharTokenizer, prompts
from test_grammar import SCHEMA


@contextmanager
def meta_everywhere() -> Iterator[None]:
    """The default device is "meta" in this thread and in every thread started inside the block."""
    def install(*_: Any) -> None:
        sys.setprofile(None)  # once, at the new thread's first call
        torch.set_default_device("meta")

    threading.setprofile(install)
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_meta_everywhere_reaches_threads_started_inside() -> None:
    seen: list[torch.device] = []
    with meta_everywhere():
        t = threading.Thread(target=lambda: seen.append(torch.empty(1).device))
        t.start()
        t.join()
        assert torch.empty(1).device.type == "meta"
    assert seen == [torch.device("meta")] and torch.empty(1).device.type == "cpu"


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[[str], Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = build_chat_model(tmp_path_factory.mktemp("devices") / "chat")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(directory)


def answers(model: Any, tokenizer: Any, requests: list[GenerationRequest], **options: Any) -> list[Any]:
    """Each request's (tokens, finish reason, logprobs, prompt logprobs, cached tokens): half of them
    submitted first, the rest once the first has a token (they join a running batch)."""
    eng = Engine(model, tokenizer, **options)
    try:
        first = [eng.submit(r) for r in requests[: max(1, len(requests) // 2)]]
        next(iter(first[0]), None)  # the batch is running (or the first request already ended)
        handles = first + [eng.submit(r) for r in requests[len(first):]]
        results = [h.result(timeout=120) for h in handles]
    finally:
        eng.close(timeout=30)
    assert all(r.error is None for r in results), [r.error for r in results]
    return [(r.token_ids, r.finish_reason, r.logprobs, r.prompt_logprobs, r.cached_tokens) for r in results]


def rounded(logprobs: Any, near: Callable[[float], Any]) -> Any:
    """Logprobs to compare across two runs: the tokens exact, the values to 1e-4. Whether the later requests
    join the first's batch is a matter of timing, and another batch shape sums in another order, so the
    values may move in their last bits (the tokens, chosen by seeded sampling, do not)."""
    if logprobs is None:
        return None
    return [(t.token, near(t.logprob), {k: near(v) for k, v in t.top}) for t in logprobs]


def both(model: Any, tokenizer: Any, requests: list[GenerationRequest], **options: Any) -> None:
    plain = answers(model, tokenizer, requests, **options)
    with meta_everywhere():
        moved = answers(model, tokenizer, requests, **options)
    for (tokens, reason, logprobs, prompt, cached), want in zip(moved, plain, strict=True):
        assert (tokens, reason, cached) == (want[0], want[1], want[4])
        assert rounded(logprobs, float) == rounded(want[2], lambda v: pytest.approx(v, abs=1e-4))
        assert rounded(prompt, float) == rounded(want[3], lambda v: pytest.approx(v, abs=1e-4))


GREEDY = [GenerationRequest(p, max_new_tokens=12) for p in prompts(6, seed=3)]
LONG = [GenerationRequest(tuple(range(10, 10 + n)), max_new_tokens=6) for n in (40, 70, 5, 33)]


@pytest.mark.parametrize("backend", ["padded", pytest.param("continuous", marks=pytest.mark.continuous)])
def test_greedy_batches_that_grow_and_shrink(llama: Any, backend: str) -> None:
    both(llama, CharTokenizer(), GREEDY, backend=backend, kv_cache_bytes=64 << 20)


def test_prompts_read_in_chunks_beside_decoding_rows(llama: Any) -> None:
    both(llama, CharTokenizer(), LONG, prefill_chunk=8)


def test_the_prefix_cache_keeps_and_serves_prefixes(llama: Any) -> None:
    shared = tuple(range(20, 60))
    requests = [GenerationRequest(shared + tail, max_new_tokens=4) for tail in ((5,), (6, 7), (8,), (9, 9, 9))]
    eng_options = {"prefix_cache_bytes": 8 << 20, "max_batch_size": 1}  # one at a time: later ones hit
    both(llama, CharTokenizer(), requests, **eng_options)
    with meta_everywhere():
        assert any(cached for *_, cached in answers(llama, CharTokenizer(), requests, **eng_options))


def test_sampling_with_seeds_penalties_bias_and_logprobs(llama: Any) -> None:
    ps = prompts(4, seed=5)
    requests = [
        GenerationRequest(ps[0], max_new_tokens=10, temperature=0.9, top_p=0.8, seed=7),
        GenerationRequest(ps[1], max_new_tokens=10, temperature=1.2, seed=11, presence_penalty=0.5,
                          frequency_penalty=0.7, logit_bias=((40, 5.0), (41, -100.0))),
        GenerationRequest(ps[2], max_new_tokens=10, logprobs=3, prompt_logprobs=2, logit_bias=((9, 2.0),)),
        GenerationRequest(ps[3], max_new_tokens=0, prompt_logprobs=1),
    ]
    both(llama, CharTokenizer(), requests)


def test_grammar_masks(chat: tuple[Any, Any]) -> None:
    model, tokenizer = chat
    constraint = Constraint(json.dumps(SCHEMA))
    ids = tuple(tokenizer("Answer in JSON:")["input_ids"])
    requests = [GenerationRequest(ids, max_new_tokens=40, grammar=constraint),
                GenerationRequest(ids, max_new_tokens=40, grammar=constraint, temperature=0.8, seed=3),
                GenerationRequest(ids, max_new_tokens=8)]
    both(model, tokenizer, requests)


def test_golden_scoring(chat: tuple[Any, Any]) -> None:
    from deploykit.engine.loader import LoadedModel
    from deploykit.engine.scoring import score
    from deploykit.spec.golden import GoldenCase

    model, tokenizer = chat
    loaded = LoadedModel(model, None, Path("."), "cpu", False, tokenizer)  # type: ignore[arg-type]
    cases = [GoldenCase("a cat", prompt="Name an animal:"),
             GoldenCase("blue", messages=({"role": "user", "content": "A color?"},))]
    plain = score(loaded, tokenizer, cases)
    with meta_everywhere():
        assert score(loaded, tokenizer, cases) == plain


def test_golden_scoring_keeps_no_kv_cache(chat: tuple[Any, Any]) -> None:
    """Scoring is one forward per case: the model must not build a KV cache it would throw away."""
    from deploykit.engine.loader import LoadedModel
    from deploykit.engine.scoring import score
    from deploykit.spec.golden import GoldenCase

    model, tokenizer = chat
    caches: list[Any] = []
    hook = model.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    try:
        score(LoadedModel(model, None, Path("."), "cpu", False, tokenizer),  # type: ignore[arg-type]
              tokenizer, [GoldenCase("a cat", prompt="Name an animal:")])
    finally:
        hook.remove()
    assert caches == [None]


def test_embeddings(chat: tuple[Any, Any]) -> None:
    from transformers import BertConfig, BertModel

    from deploykit.engine.embeddings import Pooling, embed

    _, tokenizer = chat
    torch.manual_seed(0)
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                vocab_size=len(tokenizer), max_position_embeddings=64)).eval()
    texts = ["a cat", "a much longer sentence than the first"]
    for pooling in (Pooling("mean", True), Pooling("cls"), Pooling("max")):
        plain = embed(bert, tokenizer, texts, pooling=pooling, max_length=64)
        with meta_everywhere():
            assert embed(bert, tokenizer, texts, pooling=pooling, max_length=64) == plain


def test_the_health_check(chat: tuple[Any, Any]) -> None:
    from deploykit.engine.health import check
    from deploykit.engine.loader import LoadedModel

    model, tokenizer = chat
    loaded = LoadedModel(model, None, Path("."), "cpu", False, tokenizer)  # type: ignore[arg-type]
    with meta_everywhere():
        assert "finite" in check(loaded, task="causal-lm", text="Hello there", timeout=60).detail
