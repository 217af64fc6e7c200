"""The adapter registry of one engine (engine/adapters.py) on a real tiny model and real PEFT adapters: a removed
adapter stops taking requests at once but finishes the ones it serves with itself (never with the base), and is
then deleted; rows of one batch use their own adapters; the base is the base without adapters."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploykit.engine.adapters import Adapters, AdapterSource, UnknownAdapter
from deploykit.engine.batching import Engine, GenerationRequest
from helpers import wait_until
from lora import chat_ids, peft_reference

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
    assert set(lora_a) == {"polite"}  # its matrices are gone


def test_removing_the_last_adapter_gives_back_plain_linear_layers(engine: Any, lora: Any) -> None:
    engine.adapters.remove("pirate")
    engine.adapters.remove("polite")
    assert type(engine.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    prompt = chat_ids(lora.base, "hello")
    result = engine.submit(GenerationRequest(prompt, max_new_tokens=12)).result(120)
    tokenizer = AutoTokenizer.from_pretrained(lora.base)
    assert (tokenizer.decode(_until_eos(result.token_ids, engine.eos_ids), skip_special_tokens=True)
            == peft_reference(lora.base, None, prompt, 12))


def test_a_removal_that_times_out_leaves_the_adapter_serving(lora: Any) -> None:
    """The removal gave up (its requests ran past the timeout): the adapter is kept, and takes requests again,
    as the failed change says ("it keeps serving")."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    adapters.hold("pirate")  # a request that runs on
    assert adapters.remove("pirate", timeout=0.05) is False
    assert adapters.names() == ["pirate"]
    adapters.hold("pirate")  # a new request is taken
    adapters.release("pirate")
    adapters.release("pirate")
    assert adapters.remove("pirate", timeout=5) is True and adapters.names() == []
