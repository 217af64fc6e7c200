"""Every body and stream event `deploykit serve` sends on the agent-facing APIs, checked against the
published shapes: OpenAI's Responses API (``Response``, the ``ResponseStreamEvent`` union), chat completions
(``ChatCompletion``, ``ChatCompletionChunk``), completions (``Completion``), the models list (``Model``), errors
(``ErrorObject``) and Anthropic's Messages API (``Message``, the ``RawMessageStreamEvent`` union, ``ErrorResponse``). The types are the official SDKs' own: `openai`'s are generated from
OpenAI's published OpenAPI document and `anthropic`'s from Anthropic's API spec, so validating with them
checks the published shapes without vendoring the documents.

Each body is validated strictly (JSON types as the spec says, no coercion), and every object in it,
however deep, must carry only fields its type declares (the SDK types allow extras, so an unknown or
misspelt field would pass ``model_validate`` alone) and every field its type requires. Not checked: a
field the spec requires but allows to be null, which the SDKs type as optional.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, get_args

import anthropic.types
import httpx
import openai.types.chat
import openai.types.responses
import pydantic
import pytest

from agent_apis import MODEL, chat_server
from servers import Server

KEY = "sk-conformance-test-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
          "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"],
          "additionalProperties": False}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": PARAMS}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                              "parameters": PARAMS}}
# fields beyond the published types: OpenAI's own API sends ``store`` (its documented example responses carry
# it); a model's ``parent``, ``state`` and ``loaded`` are deploykit's (docs/serving.md), as vLLM adds its own
UNPUBLISHED = {"Response": {"store"}, "Model": {"parent", "state", "loaded"}}
MESSAGES_TOOL = {"name": "get_weather", "description": "The weather.", "input_schema": PARAMS}

RESPONSES: dict[str, dict[str, Any]] = {  # POST /v1/responses bodies beyond model and input
    "text": {"instructions": "Be brief.", "max_output_tokens": 6, "metadata": {"k": "v"}, "user": "u1"},
    "long": {"max_output_tokens": 16, "temperature": 0},
    "json_schema": {"text": {"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}},
                    "max_output_tokens": 30},
    "required_tool": {"tools": [RESPONSES_TOOL], "tool_choice": "required", "max_output_tokens": 40},
    "named_tool": {"tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
                   "max_output_tokens": 40},
}
CHAT: dict[str, dict[str, Any]] = {  # POST /v1/chat/completions bodies beyond model and messages
    "text": {"max_tokens": 6, "logprobs": True, "top_logprobs": 2},
    "stop": {"max_tokens": 8, "stop": ["e"], "n": 2},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "pet", "schema": SCHEMA, "strict": True}}, "max_tokens": 30},
    "required_tool": {"tools": [CHAT_TOOL], "tool_choice": "required", "max_tokens": 40},
}
MESSAGES: dict[str, dict[str, Any]] = {  # POST /v1/messages bodies beyond model and messages
    "text": {"max_tokens": 6, "system": "Be brief."},
    "stop": {"max_tokens": 8, "stop_sequences": ["e"]},
    "named_tool": {"tools": [MESSAGES_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                   "max_tokens": 40},
    "any_tool": {"tools": [MESSAGES_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 40},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with chat_server(tmp_path_factory, "--api-key", KEY) as s:
        yield s


def by_type(union: Any) -> dict[str, type[pydantic.BaseModel]]:
    """The members of an SDK event union by their ``type`` literal."""
    members = get_args(get_args(union)[0])
    return {get_args(m.model_fields["type"].annotation)[0]: m for m in members}


RESPONSE_EVENTS = by_type(openai.types.responses.ResponseStreamEvent)
MESSAGE_EVENTS = by_type(anthropic.types.RawMessageStreamEvent)


def conform(model: type[pydantic.BaseModel], raw: dict[str, Any]) -> pydantic.BaseModel:
    """``raw`` validated strictly as ``model``, with no field, however deep, that its type does not declare."""
    parsed = model.model_validate_json(json.dumps(raw), strict=True)
    assert_declared(parsed, raw, model.__name__)
    return parsed


def assert_declared(value: Any, raw: Any, where: str) -> None:
    if isinstance(value, pydantic.BaseModel):
        assert isinstance(raw, dict), f"{where}: {raw!r} is not an object"
        extra = set(value.model_extra or ()) - UNPUBLISHED.get(type(value).__name__, set())
        assert not extra, f"{where}: fields the published type lacks: {sorted(extra)}"
        assert value.model_dump(exclude_unset=True, by_alias=True).keys() == raw.keys(), where
        for name, field in type(value).model_fields.items():
            key = field.alias or name
            if key in raw:
                assert_declared(getattr(value, name), raw[key], f"{where}.{key}")
    elif isinstance(value, list):
        for i, (item, raw_item) in enumerate(zip(value, raw, strict=True)):
            assert_declared(item, raw_item, f"{where}[{i}]")
    elif isinstance(value, dict) and isinstance(raw, dict):
        for key, item in value.items():
            assert_declared(item, raw[key], f"{where}.{key}")


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}{path}", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(server: Server, path: str, body: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """The server-sent events of a streamed POST: (the ``event:`` name, the JSON data), ``[DONE]`` left out."""
    seen: list[tuple[str | None, dict[str, Any]]] = []
    name: str | None = None
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                seen.append((name, json.loads(line[len("data: "):])))
                name = None
    assert seen
    return seen


@pytest.mark.parametrize("case", list(RESPONSES))
def test_a_response_is_openais_response(server: Server, case: str) -> None:
    body = post(server, "/v1/responses", {"model": MODEL, "input": "Weather in Paris?", **RESPONSES[case]})
    response = conform(openai.types.responses.Response, body)
    assert isinstance(response, openai.types.responses.Response) and response.output


@pytest.mark.parametrize("case", list(RESPONSES))
def test_each_response_stream_event_is_one_of_openais(server: Server, case: str) -> None:
    seen = events(server, "/v1/responses", {"model": MODEL, "input": "Weather in Paris?", **RESPONSES[case]})
    for i, (name, data) in enumerate(seen):
        assert name == data["type"], (i, name, data)
        assert data["type"] in RESPONSE_EVENTS, f"event {i}: {data['type']} is not one of OpenAI's"
        conform(RESPONSE_EVENTS[data["type"]], data)
    assert seen[-1][1]["type"] in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("case", list(CHAT))
def test_a_chat_completion_is_openais(server: Server, case: str) -> None:
    body = post(server, "/v1/chat/completions",
                {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], **CHAT[case]})
    conform(openai.types.chat.ChatCompletion, body)


@pytest.mark.parametrize("case", list(CHAT))
def test_each_chat_chunk_is_openais(server: Server, case: str) -> None:
    seen = events(server, "/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                   "stream_options": {"include_usage": True}, **CHAT[case]})
    for _, data in seen:
        conform(openai.types.chat.ChatCompletionChunk, data)
    assert seen[-1][1]["usage"] is not None


@pytest.mark.parametrize("case", list(MESSAGES))
def test_a_message_is_anthropics(server: Server, case: str) -> None:
    body = post(server, "/v1/messages",
                {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], **MESSAGES[case]})
    conform(anthropic.types.Message, body)


@pytest.mark.parametrize("case", list(MESSAGES))
def test_each_message_stream_event_is_one_of_anthropics(server: Server, case: str) -> None:
    seen = events(server, "/v1/messages",
                  {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], **MESSAGES[case]})
    for i, (name, data) in enumerate(seen):
        assert name == data["type"], (i, name, data)
        if data["type"] == "ping":  # in Anthropic's stream, outside the union: the SDK skips it
            assert data == {"type": "ping"}
            continue
        assert data["type"] in MESSAGE_EVENTS, f"event {i}: {data['type']} is not one of Anthropic's"
        conform(MESSAGE_EVENTS[data["type"]], data)
    assert seen[-1][1]["type"] == "message_stop"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "chunks"])
def test_a_completion_is_openais(server: Server, stream: bool) -> None:
    body = {"model": MODEL, "prompt": ["Weather in", "Paris is"], "max_tokens": 4, "n": 2, "logprobs": 2}
    if not stream:
        conform(openai.types.Completion, post(server, "/v1/completions", body))
        return
    for _, data in events(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}}):
        # a streamed completion is a ``Completion`` whose choices have no finish_reason until their last chunk
        # (OpenAI's API sends null there too); the SDK's type, made for whole bodies, requires one
        whole = {**data, "choices": [{**c, "finish_reason": c["finish_reason"] or "length"} for c in data["choices"]]}
        conform(openai.types.Completion, whole)


def test_the_models_list_is_openais(server: Server) -> None:
    r = httpx.get(f"{server.url}/v1/models", headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    listed = r.json()
    assert listed["object"] == "list" and listed["data"]
    for model in listed["data"]:
        conform(openai.types.Model, model)


def test_an_error_is_openais_on_openai_routes_and_anthropics_on_messages(server: Server) -> None:
    wrong = httpx.post(f"{server.url}/v1/chat/completions", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})
    assert wrong.status_code == 400
    error = wrong.json()["error"]
    conform(openai.types.ErrorObject, error)
    assert error["param"] == "max_tokens"
    wrong = httpx.post(f"{server.url}/v1/messages", headers=HEADERS, timeout=60,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # no max_tokens
    assert wrong.status_code == 400
    conform(anthropic.types.ErrorResponse, wrong.json())
