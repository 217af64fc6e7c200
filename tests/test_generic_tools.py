"""Tool calls on a model whose chat template renders no tools (``spec.serving.tool_format``): the generic
format describes the tools in a system message and constrains the answer to ``{"content": text}`` or
``{"tool_calls": [...]}``, so ``tool_choice: auto`` is served rather than refused; ``tool_format: template``
keeps the refusal. Against a real `deploykit serve` of the tiny chat model (tests/chatmodel.py; a
byte-level tokenizer, so a logit_bias on one character picks the answer's branch)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from chatmodel import build_chat_model
from deploykit.serve.openai.structured import GenericStream, Structured, described
from servers import Server
from test_serve import chat_manifest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
SERVING = "{max_tokens: 128, default_max_tokens: 16%s}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model", context=1024)  # room for the tools


@pytest.fixture(scope="module")
def server(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("serve")
    (root / "m").mkdir()
    (root / "m" / "generic.yaml").write_text(chat_manifest(chat_model, name="tiny-generic", serving=SERVING % ""))
    (root / "m" / "template.yaml").write_text(chat_manifest(chat_model, name="tiny-template",
                                                            serving=SERVING % ", tool_format: template"))
    with Server(root / "m", root / "state") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def letters(chat_model: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    return {c: tokenizer.convert_tokens_to_ids(c) for c in "ct"}


def ask(client: openai.OpenAI, branch: str, letters: dict[str, int], **fields: Any) -> Any:
    """A greedy "auto" answer pushed to its content ("c") or tool_calls ("t") branch."""
    return client.chat.completions.create(model="tiny-generic", messages=MESSAGES, tools=[WEATHER],  # type: ignore[arg-type]
                                          max_tokens=100, temperature=0, logit_bias={str(letters[branch]): 100},
                                          parallel_tool_calls=False, **fields)


def test_auto_on_a_template_without_tools_answers_calls_in_the_generic_format(client, letters, chat_model):
    from transformers import AutoTokenizer

    answer = ask(client, "t", letters)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content is None, (message, answer.usage)
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)  # the tools were described in a system message
    prompt = described(MESSAGES, Structured(mode="auto", tools=[WEATHER], generic=True))  # one_call: same words
    assert answer.usage.prompt_tokens == len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                                           tokenize=True)["input_ids"])
    chunks = list(client.chat.completions.create(model="tiny-generic", messages=MESSAGES, tools=[WEATHER],
                                                  max_tokens=100, temperature=0, stream=True,
                                                  logit_bias={str(letters["t"]): 100}, parallel_tool_calls=False))
    [streamed] = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert streamed.function.name == "get_weather" and streamed.function.arguments == call.function.arguments


def test_auto_content_streams_as_its_json_string_is_decoded(client, letters):
    answer = ask(client, "c", letters)
    message = answer.choices[0].message
    assert not message.tool_calls and message.content is not None and not message.content.startswith('{"')
    chunks = [c for c in client.chat.completions.create(model="tiny-generic", messages=MESSAGES, tools=[WEATHER],
                                                        max_tokens=100, temperature=0, stream=True,
                                                        logit_bias={str(letters["c"]): 100}) if c.choices]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == message.content
    assert len(pieces) > 1  # as it came, not once at the end (the bias writes "c" up to max_tokens)


def test_tool_format_template_keeps_the_refusal(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny-template", messages=MESSAGES, tools=[WEATHER])  # type: ignore[arg-type]
    assert refused.value.body["code"] == "no_tool_template" and refused.value.body["param"] == "tool_choice"


def test_the_other_faces_get_generic_calls_too(server, client):
    response = client.responses.create(model="tiny-generic", input="Weather in Paris?", max_output_tokens=100,
                                       tools=[{"type": "function", **WEATHER["function"]}])  # type: ignore[list-item]
    assert response.output and all(i.type in ("message", "function_call") for i in response.output)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    message = claude.messages.create(model="tiny-generic", max_tokens=100, messages=MESSAGES,  # type: ignore[arg-type]
                                     tools=[{"name": "get_weather",
                                             "input_schema": WEATHER["function"]["parameters"]}])
    assert message.content and message.stop_reason in ("end_turn", "tool_use", "max_tokens")


def test_a_generic_content_stream_decodes_escapes_split_anywhere() -> None:
    answer = json.dumps({"content": 'a "quoted" line\nand \\ \u00e9'})
    stream = GenericStream()
    sent = "".join(stream.push(c) for c in answer)
    rest, calls = stream.finish()
    assert sent + rest == 'a "quoted" line\nand \\ \u00e9' and calls == []
    cut = GenericStream()
    assert cut.push('{"content": "ab\\') == "ab" and cut.finish() == ("", [])
