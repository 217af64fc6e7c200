"""``tool_choice: "auto"``: tools rendered by the model's own chat template and calls read back in its
family's format (``spec.serving.tool_call_parser: hermes``). The template is Qwen2.5-Instruct's real one
(tests/data/qwen2.5-instruct.jinja, as llama.cpp ships it) on a tiny random model: its answers are noise,
so the parser is checked on what the real template writes for a call, and the server on what it must do
whatever the model says (the tools in the prompt, history with tool calls and results, refusals)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from chatmodel import build_chat_model
from servers import Server
from test_serve import chat_manifest

from deploykit.serve.openai.structured import hermes_calls

TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-instruct.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY: Any = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C"},
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    directory = build_chat_model(tmp_path_factory.mktemp("qwen") / "model", context=2048)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def test_hermes_parser_reads_what_the_qwen_template_writes(qwen_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in ("Paris", "Rome")]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Let me check.", "tool_calls": calls}],
                                             tools=[WEATHER], tokenize=False)
    answer = rendered.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    content, parsed = hermes_calls(answer, {"get_weather"})
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c["id"] for c in parsed}) == 2
    untouched, none = hermes_calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', {"get_weather"})
    assert none == [] and untouched is not None and "unknown" in untouched


@pytest.fixture(scope="module")
def client(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("serve-tools")
    (root / "manifests").mkdir()
    serving = "{max_tokens: 64, default_max_tokens: 16, tool_call_parser: hermes}"
    (root / "manifests" / "qwen.yaml").write_text(chat_manifest(qwen_dir, name="qwen", serving=serving))
    (root / "manifests" / "plain.yaml").write_text(chat_manifest(qwen_dir, name="plain"))
    with Server(root / "manifests", root / "state") as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_auto_renders_the_tools_and_history_through_the_template(client: openai.OpenAI) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    bare = client.chat.completions.create(model="qwen", messages=ask, max_tokens=8, temperature=0)
    auto = client.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], max_tokens=8, temperature=0)
    assert auto.usage and bare.usage  # a byte-level tokenizer: one token per byte of the tools' JSON, at least
    assert auto.usage.prompt_tokens - bare.usage.prompt_tokens >= len(json.dumps(WEATHER["function"]))
    assert auto.choices[0].finish_reason in ("stop", "length") and not auto.choices[0].message.tool_calls
    streamed = list(client.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], max_tokens=8,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == auto.choices[0].message.content
    none = client.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.usage and none.usage.prompt_tokens == bare.usage.prompt_tokens  # "none": tools left out
    follow = client.chat.completions.create(model="qwen", messages=HISTORY, tools=[WEATHER], max_tokens=4)
    assert follow.usage and follow.usage.prompt_tokens > auto.usage.prompt_tokens + len("18 C24 C<tool_response>")
    forced = client.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], tool_choice="required",
                                            max_tokens=64, temperature=0)
    assert forced.choices[0].finish_reason in ("tool_calls", "length")


def test_auto_without_a_parser_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert refused.value.body["param"] == "tool_choice" and "tool_call_parser" in refused.value.body["message"]


def test_a_streamed_auto_answer_sends_content_then_the_same_calls(qwen_dir: Path) -> None:
    from transformers import AutoTokenizer

    from deploykit.serve.openai.structured import HermesStream

    tokenizer = AutoTokenizer.from_pretrained(qwen_dir)
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "Let me check.", "tool_calls": calls}],
                                             tools=[WEATHER], tokenize=False)
    answer = rendered.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    for size in (1, 3, 7):  # deltas of every size, cut anywhere in the tag
        stream = HermesStream({"get_weather"})
        sent = "".join(stream.push(answer[i:i + size]) for i in range(0, len(answer), size))
        rest, got = stream.finish()
        assert (sent + rest).strip() == "Let me check." and "<tool" not in sent
        assert [json.loads(c["function"]["arguments"]) for c in got] == [{"city": "Paris"}]
    plain = HermesStream({"get_weather"})
    assert plain.push("no call <tool") == "no call " and plain.push("s here") == "<tools here"
    assert plain.finish() == ("", [])
