"""The OpenAI fields that change the answer, through the official `openai` client against a real
`deploykit serve`: logprobs (chat and legacy completions, echo with max_tokens 0), n, presence and
frequency penalties, logit_bias, each against plain transformers; and every field deploykit refuses.

The tiny random Llama of tests/chatmodel.py serves (a byte-level tokenizer: every byte one token).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from deploykit.serve.openai.protocol import IGNORED
from chatmodel import build_chat_model
from penalties import Penalties
from servers import Server
from test_serve import chat_ids, chat_manifest

TOL = 2e-3
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def client(chat_model, tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("serve")
    (root / "chat.yaml").write_text(chat_manifest(chat_model))
    with Server(root / "chat.yaml", root / "state") as s:
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(chat_model) -> Any:
    """Plain transformers: the model, its tokenizer, greedy ``generate`` and log-softmax of the logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class Ref:
        model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(chat_model)

        def generate(self, ids: list[int], max_new: int, **kwargs: Any) -> list[int]:
            """Greedy ids, cut at EOS (the API's text and logprobs end before it)."""
            with torch.inference_mode():
                out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                          max_new_tokens=max_new, do_sample=False, **kwargs)
            new = out[0, len(ids):].tolist()
            eos = self.tokenizer.eos_token_id
            return new[:new.index(eos)] if eos in new else new

        def logprobs(self, ids: list[int]) -> torch.Tensor:
            """[len(ids), vocab]: row i is the distribution of the token after ids[:i + 1]."""
            with torch.inference_mode():
                return torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)

        def raw(self, token: int) -> bytes:
            """This tokenizer's pieces are single bytes in GPT-2's byte-level alphabet (or specials)."""
            from tokenizers import pre_tokenizers

            alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # chatmodel.py: id i is alphabet[i]
            if token >= len(alphabet):
                return str(self.tokenizer.decode([token])).encode()
            from transformers.convert_slow_tokenizer import bytes_to_unicode
            return bytes([{c: b for b, c in bytes_to_unicode().items()}[alphabet[token]]])

        def text(self, token: int) -> str:
            """OpenAI's notation: the text, or bytes:\\xNN for a byte that is not UTF-8 alone."""
            raw = self.raw(token)
            return raw.decode() if raw.isascii() else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    return Ref()


# ---- logprobs ------------------------------------------------------------------------------------------

def check_chat_logprobs(content: list[Any], ref: Any, prompt: list[int], new: list[int], top: int) -> None:
    logp = ref.logprobs(prompt + new)
    assert [c.token for c in content] == [ref.text(t) for t in new]
    for step, (item, token) in enumerate(zip(content, new)):
        row = logp[len(prompt) - 1 + step]
        assert abs(item.logprob - float(row[token])) < TOL
        assert item.bytes == list(ref.raw(token))
        best = row.topk(top)
        assert [t.token for t in item.top_logprobs] == [ref.text(int(i)) for i in best.indices]
        assert max(abs(t.logprob - float(v)) for t, v in zip(item.top_logprobs, best.values)) < TOL


def test_chat_logprobs_are_the_models_own_streamed_or_not(client, ref, chat_model):
    prompt = chat_ids(chat_model, MESSAGES[0]["content"])
    new = ref.generate(prompt, 16)
    whole = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=16, temperature=0,
                                           logprobs=True, top_logprobs=5)
    check_chat_logprobs(whole.choices[0].logprobs.content, ref, prompt, new, 5)
    assert whole.choices[0].message.content == ref.tokenizer.decode(new)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 logprobs=True, top_logprobs=5, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    # the second request reads the prompt's KV from the prefix cache: the same tokens, logprobs within TOL
    assert [s.token for s in streamed] == [w.token for w in whole.choices[0].logprobs.content]
    check_chat_logprobs(streamed, ref, prompt, new, 5)
    plain = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True)
    assert all(item.top_logprobs == [] for item in zero.choices[0].logprobs.content)


def test_echo_with_max_tokens_zero_gives_each_prompts_logprobs_in_order(client, ref):
    prompts: list[Any] = ["The quick brown fox", "a", "Once upon a time"]
    ids = [ref.tokenizer(p)["input_ids"] for p in prompts]
    for given in (prompts, ids):  # strings, then token-id lists
        got = client.completions.create(model="tiny-chat", prompt=given, max_tokens=0, echo=True, logprobs=2,
                                        temperature=0)
        assert [c.index for c in got.choices] == [0, 1, 2]
        for choice, prompt, pids in zip(got.choices, prompts, ids):
            lp, logp = choice.logprobs, ref.logprobs(pids)
            assert choice.text == prompt and choice.finish_reason == "length"
            assert lp.tokens == [ref.text(t) for t in pids]
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert all(abs(lp.token_logprobs[i] - float(logp[i - 1, t])) < TOL for i, t in enumerate(pids) if i)
            for i in range(1, len(pids)):
                best = logp[i - 1].topk(2)
                assert list(lp.top_logprobs[i]) == [ref.text(int(t)) for t in best.indices]
            assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(pids))]
        assert got.usage.completion_tokens == 0 and got.usage.prompt_tokens == sum(map(len, ids))


def test_completion_logprobs_with_echo_streamed_equal_the_whole(client, ref):
    pids = ref.tokenizer("Hello there")["input_ids"]
    new = ref.generate(pids, 10)
    args = dict(model="tiny-chat", prompt="Hello there", max_tokens=10, temperature=0, logprobs=3, echo=True)
    whole = client.completions.create(**args).choices[0]
    logp = ref.logprobs(pids + new)
    assert whole.text == "Hello there" + ref.tokenizer.decode(new)
    assert whole.logprobs.tokens == [ref.text(t) for t in pids + new]
    assert all(abs(whole.logprobs.token_logprobs[i] - float(logp[i - 1, t])) < TOL
               for i, t in enumerate(pids + new) if i)
    pieces = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(p.text for p in pieces) == whole.text
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in pieces if p.logprobs for v in getattr(p.logprobs, key)] == getattr(whole.logprobs, key)


# ---- n, penalties, logit_bias --------------------------------------------------------------------------

def test_n_choices_are_indexed_reproducible_with_a_seed_and_counted(client):
    args = dict(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=3, n=4)
    first = client.chat.completions.create(**args)
    again = client.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1
    single = client.chat.completions.create(**{**args, "n": 1})
    assert single.choices[0].message.content == texts[0]  # choice j samples with seed + j
    assert first.usage.prompt_tokens == single.usage.prompt_tokens
    assert first.usage.completion_tokens == sum(
        client.chat.completions.create(**{**args, "n": 1, "seed": 3 + j}).usage.completion_tokens for j in range(4))
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(4)] == texts
    batch = client.completions.create(model="tiny-chat", prompt=["ab", "cd"], max_tokens=6, temperature=1.0,
                                      seed=9, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model="tiny-chat", prompt="cd", max_tokens=6, temperature=1.0, seed=10)
    assert batch.choices[3].text == alone.choices[0].text  # prompt 1, choice 1


@pytest.mark.parametrize("presence, frequency, bias", [
    (1.5, 0.0, {}), (0.0, 2.0, {}), (-1.0, 0.5, {}), (0.0, 0.0, {65: 100.0}), (0.8, 0.3, {101: -100.0, 32: 7.5}),
])
def test_penalties_and_logit_bias_token_for_token(client, ref, chat_model, presence, frequency, bias):
    prompt = chat_ids(chat_model, MESSAGES[0]["content"])
    expected = ref.generate(prompt, 20, logits_processor=[Penalties(len(prompt), presence, frequency, bias)])
    assert expected != ref.generate(prompt, 20)  # the setting changes the answer
    got = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=20, temperature=0,
                                         presence_penalty=presence, frequency_penalty=frequency,
                                         logit_bias={str(k): v for k, v in bias.items()}, logprobs=True)
    assert [bytes(item.bytes) for item in got.choices[0].logprobs.content] == [ref.raw(t) for t in expected]
    assert got.choices[0].message.content == ref.tokenizer.decode(expected)


# ---- refused, or ignored -------------------------------------------------------------------------------

def chat(**kwargs: Any) -> Any:
    return lambda c: c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4, **kwargs)


def completion(**kwargs: Any) -> Any:
    return lambda c: c.completions.create(model="tiny-chat", prompt="hi", **kwargs)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("call, param", [
    (chat(tools=[TOOL], stop="x"), "stop"),  # auto in the generic tool format (this template renders no tools)
    (chat(tool_choice="required"), "tool_choice"),  # no tools
    (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (chat(extra_body={"functions": [TOOL["function"]]}), "functions"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
     "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(?<=a)b"}}}}}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "email", "pattern": "^a"}}}), "response_format"),
    (chat(response_format={"type": "json_object"}, stop=["}"]), "stop"),  # it would cut the JSON
    (chat(tools=[TOOL], tool_choice="required", stop="x"), "stop"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(n=9), "n"),
    (chat(presence_penalty=2.5), "presence_penalty"),
    (chat(frequency_penalty=-2.1), "frequency_penalty"),
    (chat(logit_bias={"65": 101}), "logit_bias.65"),
    (chat(logit_bias={"99999": 1}), "logit_bias"),
    (chat(extra_body={"guided_json": {}}), "guided_json"),
    (completion(logprobs=6), "logprobs"),
    (completion(max_tokens=0), "max_tokens"),
    (completion(suffix="end"), "suffix"),
    (completion(best_of=3), "best_of"),
    (completion(extra_body={"top_k": 5}), "top_k"),
])
def test_fields_deploykit_cannot_honour_are_refused(client, call, param):
    with pytest.raises(openai.BadRequestError) as caught:
        call(client)
    assert caught.value.body["param"] == param and caught.value.body["message"]


def test_fields_that_do_not_change_the_answer_are_accepted(client):
    base = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0)
    with_extras = client.chat.completions.create(
        model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", parallel_tool_calls=False, response_format={"type": "text"}, tool_choice="none",
        presence_penalty=0, frequency_penalty=0, logit_bias={}, extra_body={name: {"x": 1} for name in IGNORED})
    assert with_extras.choices[0].message.content == base.choices[0].message.content
    text = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=4, temperature=0, user="u1",
                                     extra_body={name: "x" for name in IGNORED})
    assert text.choices[0].text == client.completions.create(model="tiny-chat", prompt="hi", max_tokens=4,
                                                             temperature=0).choices[0].text


REF_TOOL = {"type": "function", "function": {"name": "place", "parameters": {
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "required": ["at"],
    "additionalProperties": False}}}


def test_forced_calls_to_tools_whose_parameters_use_defs(client):
    import jsonschema

    for choice in ("required", {"type": "function", "function": {"name": "place"}}):
        answer = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=60, temperature=0,
                                                tools=[REF_TOOL, TOOL], tool_choice=choice, parallel_tool_calls=False)
        message = answer.choices[0].message
        assert message.content is None and message.tool_calls, answer
        if answer.choices[0].finish_reason == "tool_calls":  # whole: the arguments follow the $ref'd schema
            for call in message.tool_calls:
                if call.function.name == "place":
                    jsonschema.validate(json.loads(call.function.arguments), REF_TOOL["function"]["parameters"])


@pytest.mark.parametrize("max_tokens", [64, 40])  # whole, and cut inside the first call's arguments
def test_required_calls_stream_as_tool_call_deltas_as_they_are_generated(client, max_tokens):
    args = dict(model="tiny-chat", messages=MESSAGES, max_tokens=max_tokens, temperature=0, tools=[REF_TOOL],
                tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**args)
    deltas = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    assert not any(d.delta.content for d in deltas)  # never content
    calls = [t for d in deltas for t in d.delta.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "place" and len(calls) > 2  # then argument pieces
    arguments = "".join(t.function.arguments or "" for t in calls)
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].message.content is None and arguments == call.function.arguments
    finish = "tool_calls" if max_tokens == 64 else "length"
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason == finish
    if finish == "length":
        assert not arguments.endswith("}}")  # partial, as OpenAI's
    else:
        json.loads(arguments)
