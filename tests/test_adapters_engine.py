"""The adapter registry of one engine (engine/adapters.py) on a real tiny model and real PEFT adapters: a removed
adapter stops taking requests at once but finishes the ones it serves with itself (never with the base), and is
then deleted; rows of one batch use their own adapters; the base is the base without adapters."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploykit.engine.adapters import Adapters, AdapterSource, UnknownAdapter
from deploykit.engine.batching import Engine, GenerationRequest
from helpers import Hold, wait_until
from lora import altered_copy, chat_ids, peft_reference

TOKENS = 40


@pytest.fixture
def engine(lora: Any) -> Any:
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    adapters.load(AdapterSource("polite", str(lora.polite)))
    eng = Engine(model, AutoTokenizer.from_pretrained(lora.base), adapters=adapters)
    yield eng
    eng.close(30)


def _until_eos(ids: list[int], eos: set[int]) -> list[int]:
    return next((ids[:i] for i, t in enumerate(ids) if t in eos), ids)


def test_a_removed_adapter_finishes_its_requests_with_itself_then_goes(engine: Any, lora: Any) -> None:
    prompt = chat_ids(lora.base, "hi")
    first = threading.Event()
    handle = engine.submit(GenerationRequest(prompt, max_new_tokens=TOKENS, adapter="pirate"),
                           listener=lambda event: first.set())
    assert first.wait(60)
    removing = threading.Thread(target=engine.adapters.remove, args=("pirate",), kwargs={"timeout": 120})
    removing.start()
    wait_until(lambda: "pirate" not in engine.adapters.names(), what="pirate stops taking requests")
    with pytest.raises(UnknownAdapter):
        engine.submit(GenerationRequest(prompt, max_new_tokens=4, adapter="pirate"))
    result = handle.result(120)
    removing.join(120)
    assert not removing.is_alive()
    tokenizer = AutoTokenizer.from_pretrained(lora.base)
    text = tokenizer.decode(_until_eos(result.token_ids, engine.eos_ids), skip_special_tokens=True)
    assert text == peft_reference(lora.base, lora.pirate, prompt, TOKENS)  # all of it with the adapter
    lora_a = engine.model.model.layers[0].self_attn.q_proj.lora_A
    assert set(lora_a) == engine.adapters.slots() and len(lora_a) == 1  # its matrices are gone: polite's remain


def test_removing_the_last_adapter_gives_back_plain_linear_layers(engine: Any, lora: Any) -> None:
    engine.adapters.remove("pirate")
    engine.adapters.remove("polite")
    assert type(engine.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    prompt = chat_ids(lora.base, "hello")
    result = engine.submit(GenerationRequest(prompt, max_new_tokens=12)).result(120)
    tokenizer = AutoTokenizer.from_pretrained(lora.base)
    assert (tokenizer.decode(_until_eos(result.token_ids, engine.eos_ids), skip_special_tokens=True)
            == peft_reference(lora.base, None, prompt, 12))


def test_a_removal_is_final_at_once_and_its_running_request_keeps_its_version(lora: Any) -> None:
    """A removal never comes back (the revision that removed it is what serves): the adapter takes no new
    request at once, the request it holds still computes with it, and it is deleted when that one ends."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    ids = torch.tensor([chat_ids(lora.base, "hi")])
    slot = adapters.hold("pirate")  # a request that runs on
    before = _logits(adapters, ids, slot)
    stop = threading.Event()
    stop.set()
    assert adapters.remove("pirate", timeout=60, stop=stop) is False  # interrupted: its request still runs
    assert adapters.names() == []
    with pytest.raises(UnknownAdapter):
        adapters.hold("pirate")
    assert torch.equal(_logits(adapters, ids, slot), before)  # the running request computes with it still
    adapters.release(slot)
    assert adapters.wait_deleted(slot, timeout=60) and adapters.slots() == set()
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def _logits(adapters: Adapters, ids: torch.Tensor, slot: str | None = None) -> torch.Tensor:
    with torch.inference_mode(), adapters.rows([slot]):
        return adapters.model(input_ids=ids).logits[0, -1].clone()


def _pirate_logits(adapters: Adapters, ids: torch.Tensor) -> torch.Tensor:
    slot = adapters.hold("pirate")
    try:
        return _logits(adapters, ids, slot)
    finally:
        adapters.release(slot)


@pytest.mark.parametrize("change", [{"r": 8, "init_lora_weights": False},  # random B: a leftover would show
                                    {"target_modules": "all-linear", "init_lora_weights": False},
                                    {"init_lora_weights": "pissa"}, "truncated"])
def test_a_failed_load_leaves_the_base_and_the_loaded_adapters_bit_identical(lora: Any, tmp_path: Path,
                                                                             change: Any) -> None:
    """A first adapter, a second one and a new version of a served one, each failing at load (a rank that is
    not the tensors', a target with no tensors, an init that rewrites the base, a cut weights file): the base's
    logits and the served adapter's are bit for bit what they were, and nothing of the failed one is left."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    ids = torch.tensor([chat_ids(lora.base, "hi")])
    plain = _logits(adapters, ids)
    broken = (altered_copy(lora.pirate, tmp_path / "broken", truncate=True) if change == "truncated"
              else altered_copy(lora.pirate, tmp_path / "broken", config=change))
    with pytest.raises(Exception):
        adapters.load(AdapterSource("first", str(broken)))  # the first adapter: peft wraps the layers for it
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear and adapters.slots() == set()
    assert torch.equal(_logits(adapters, ids), plain)

    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    pirate = _pirate_logits(adapters, ids)
    assert not torch.equal(pirate, plain)
    with_pirate = _logits(adapters, ids)
    for name in ("other", "pirate"):  # another adapter beside it, and a new version of it
        with pytest.raises(Exception):
            adapters.load(AdapterSource(name, str(broken)))
        assert adapters.names() == ["pirate"] and len(adapters.slots()) == 1
        assert torch.equal(_logits(adapters, ids), with_pirate)
        assert torch.equal(_logits(adapters, ids), plain)
        assert torch.equal(_pirate_logits(adapters, ids), pirate)


def test_a_new_version_serves_new_requests_while_running_ones_finish_with_the_old(lora: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    ids = torch.tensor([chat_ids(lora.base, "hi")])
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    old = adapters.hold("pirate")  # a request in flight
    pirate = _logits(adapters, ids, old)
    adapters.load(AdapterSource("pirate", str(lora.polite)))  # the manifest points pirate elsewhere
    polite = _pirate_logits(adapters, ids)
    assert not torch.equal(polite, pirate)
    assert torch.equal(_logits(adapters, ids, old), pirate)  # the request in flight keeps its version
    adapters.load(AdapterSource("polite", str(lora.polite)))
    assert torch.equal(_logits(adapters, ids, adapters.hold("polite")), polite)
    adapters.release(old)
    assert adapters.wait_deleted(old, timeout=60)
    assert len(adapters.slots()) == 2 and old not in adapters.slots()


def test_adapter_names_with_dots_load(lora: Any) -> None:
    """peft's module dictionaries take no '.' in a key; a served name may hold one."""
    adapters = Adapters(AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32))
    adapters.load(AdapterSource("pirate.v2", str(lora.pirate)))
    assert adapters.names() == ["pirate.v2"]


def test_every_adapter_computes_at_the_base_dtype_the_first_too(lora: Any) -> None:
    """peft's LoraModel upcasts the first adapter of a bfloat16 base to float32 unless told otherwise; every
    slot, first or later, holds its matrices at the base's dtype (as the plan sizes them)."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.bfloat16)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    adapters.load(AdapterSource("polite", str(lora.polite)))
    dtypes = {(name.split(".lora_")[1].split(".")[1], p.dtype) for name, p in model.named_parameters()
              if ".lora_" in name}
    assert {slot for slot, _ in dtypes} == adapters.slots()
    assert {dtype for _, dtype in dtypes} == {torch.bfloat16}


def _alone(lora: Any, requests: list[GenerationRequest]) -> list[list[int]]:
    """Each request's greedy tokens, run alone on an engine of its own (no batch, no prefix cache)."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    adapters.load(AdapterSource("polite", str(lora.polite)))
    eng = Engine(model, AutoTokenizer.from_pretrained(lora.base), adapters=adapters)
    try:
        return [eng.submit(r).result(120).token_ids for r in requests]
    finally:
        eng.close(30)


@pytest.fixture
def cached(lora: Any) -> Any:
    """An engine with a prefix cache whose prompts longer than 16 new tokens are read in chunks beside the
    running rows (mixed steps), serving pirate and polite."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    adapters.load(AdapterSource("polite", str(lora.polite)))
    eng = Engine(model, AutoTokenizer.from_pretrained(lora.base), adapters=adapters, prefix_cache_bytes=8 << 20,
                 prefill_chunk=16, max_batch_size=8)
    yield eng
    eng.close(30)


def test_adapter_rows_in_mixed_steps_beside_base_rows_and_from_the_prefix_cache_answer_as_alone(
        cached: Any, lora: Any) -> None:
    """Rows on two adapters and the base decode while a long prompt on an adapter is read in chunks beside
    them (one packed forward per step, each token with its row's adapter), and an adapter's request starts
    from the prefix its own adapter cached: every answer equals that request's alone."""
    story = "tell me a long story about the sea, the ships, the wind and the old sailors of the harbour"
    first = GenerationRequest(chat_ids(lora.base, story), max_new_tokens=8, adapter="pirate")
    assert cached.submit(first).result(120).token_ids  # its prompt's KV is kept under pirate
    hold = Hold()
    rows = [GenerationRequest(chat_ids(lora.base, "hi"), max_new_tokens=TOKENS, adapter=a)
            for a in ("pirate", None, "polite")]
    again = GenerationRequest(chat_ids(lora.base, story + ", and then more"), max_new_tokens=8, adapter="pirate")
    long = GenerationRequest(chat_ids(lora.base, story * 3), max_new_tokens=8, adapter="polite")
    running = [cached.submit(r, listener=hold if i == 0 else None) for i, r in enumerate(rows)]
    hold.wait()  # a token came out: the rows decode
    later = [cached.submit(again), cached.submit(long)]
    hold.release()
    results = [h.result(120) for h in running + later]
    assert [r.token_ids for r in results] == _alone(lora, rows + [again, long])
    assert results[3].cached_tokens > 0  # pirate's own cached beginning
    assert results[4].cached_tokens == 0
    assert cached.mixed_steps >= 1


def test_a_prefix_cached_under_an_adapter_serves_that_adapter_version_only(cached: Any, lora: Any) -> None:
    """A prompt's KV kept under pirate is never read by polite, by the base, nor by pirate's next version
    (the same name loaded again from other files); each of them answers as alone."""
    prompt = chat_ids(lora.base, "tell me about the sea and the ships of the old harbour, please")
    assert cached.submit(GenerationRequest(prompt, max_new_tokens=4, adapter="pirate")).result(120).token_ids
    again = cached.submit(GenerationRequest(prompt, max_new_tokens=TOKENS, adapter="pirate")).result(120)
    assert again.cached_tokens > 0  # kept, and found by its own adapter
    others = [GenerationRequest(prompt, max_new_tokens=TOKENS, adapter=a) for a in ("polite", None)]
    results = [cached.submit(r).result(120) for r in others]
    assert [r.cached_tokens for r in results] == [0, 0]
    cached.adapters.load(AdapterSource("pirate", str(lora.polite)))  # pirate's next version
    replaced = cached.submit(GenerationRequest(prompt, max_new_tokens=TOKENS, adapter="pirate")).result(120)
    assert replaced.cached_tokens == 0
    alone = _alone(lora, [GenerationRequest(prompt, max_new_tokens=TOKENS, adapter=a)
                          for a in ("pirate", "polite", None, "polite")])
    assert [again.token_ids, *(r.token_ids for r in results), replaced.token_ids] == alone
