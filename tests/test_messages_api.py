"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the official
`anthropic` SDK against a real `deploykit serve` of the tiny chat model (tests/chatmodel.py), with an API
key sent as ``x-api-key``: the same turn as /v1/chat/completions, whole or streamed (Anthropic's events in
order), stop sequences, a tool-use loop with tool_result, token counting, and errors in Anthropic's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from agent_apis import MODEL, chat_server
from servers import Server

KEY = "sk-messages-test-key-0123456789"
GREEDY = {"temperature": 0}  # newer SDKs no longer take temperature as an argument; the API does
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with chat_server(tmp_path_factory, "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat_answer(chat: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int, **fields: Any) -> Any:
    return chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                        temperature=0, **fields).choices[0]


def test_a_message_is_the_chat_turn_with_system(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    message = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Be brief.",
                                     messages=[{"role": "user", "content": "Tell me about the sea."}],
                                     metadata={"user_id": "u1"})
    reference = chat_answer(chat, [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Tell me about the sea."}], 12)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == reference.message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reference.finish_reason]
    assert message.usage.output_tokens <= 12 and message.usage.input_tokens > 0
    assert message.usage.cache_creation_input_tokens == 0


def test_system_blocks_and_a_stream_send_anthropics_events_in_order(client: anthropic.Anthropic) -> None:
    fields: Any = {"model": MODEL, "max_tokens": 10, "extra_body": GREEDY, "system": [{"type": "text", "text": "Hi."}],
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "The sea?"}]}]}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in seen]
    deltas = [e for e in seen if e.type == "content_block_delta"]
    assert [k for k in kinds if k not in ("text",)] == (
        ["message_start", "content_block_start"] + ["content_block_delta"] * len(deltas) +
        ["content_block_stop", "message_delta", "message_stop"])
    assert "".join(e.delta.text for e in deltas) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_a_stream_starts_with_a_ping_after_message_start(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60, headers={
            "x-api-key": KEY, "anthropic-version": "2023-06-01"}, json={
            "model": MODEL, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200
        names = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_a_stop_sequence_says_which(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    prompt = [{"role": "user", "content": "Tell me about the sea."}]
    free = chat_answer(chat, prompt, 20).message.content
    stop = free[4:6]  # two characters the greedy answer holds
    message = client.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, messages=prompt,  # type: ignore[arg-type]
                                     stop_sequences=["\x00never", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == free[:free.index(stop)]


def test_a_tool_use_loop_with_tool_result(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    """Turn one is forced to the tool (the tiny model's template renders no tools); turn two sends the
    tool_use and its tool_result back and gets text: the same turn as chat's with the tool messages."""
    question: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=64, messages=question, tools=[WEATHER],  # type: ignore[list-item]
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=GREEDY)
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input["city"] in ("Paris", "Rome")  # type: ignore[index]
    history = question + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": "sunny"}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=history,
                                    tools=[WEATHER], tool_choice={"type": "none"})  # type: ignore[list-item]
    reference = chat_answer(chat, [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": None, "tool_calls": [{
                                       "id": use.id, "type": "function", "function": {
                                           "name": "get_weather", "arguments": json.dumps(use.input)}}]},
                                   {"role": "tool", "tool_call_id": use.id, "content": "sunny"}], 8)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text == reference.message.content


def test_a_streamed_named_tool_sends_input_json_deltas(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=64, tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        seen = list(stream)
        final = stream.get_final_message()
    pieces = "".join(e.delta.partial_json for e in seen
                     if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    [use] = final.content
    assert use.type == "tool_use" and use.input == json.loads(pieces) and final.stop_reason == "tool_use"


def test_output_config_format_is_a_schema_the_answer_follows(client: anthropic.Anthropic) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False}
    message = client.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A pet?"}],
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn", message
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


def test_count_tokens_is_the_prompt_a_message_reads(client: anthropic.Anthropic) -> None:
    fields: Any = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "The sea?"}]}
    counted = client.messages.count_tokens(**fields)
    message = client.messages.create(max_tokens=1, **fields)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


@pytest.mark.parametrize(("fields", "status", "kind", "param"), [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"top_k": 5}, 400, "invalid_request_error", "top_k"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].type"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error", "stop_sequences"),
    ({"max_tokens": 10_000}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "nope"}, 404, "not_found_error", "model"),
    ({"surprise": 1}, 400, "invalid_request_error", "surprise"),
    ({"output_config": {"effort": "high"}}, 400, "invalid_request_error", "output_config.effort"),
])
def test_errors_come_in_anthropics_shape(server: Server, fields: dict[str, Any], status: int, kind: str,
                                         param: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(f"{server.url}/v1/messages", json={k: v for k, v in body.items() if v is not None},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind, error
    assert error["error"]["message"].startswith(param), error


def test_the_key_in_x_api_key_or_authorization(server: Server, client: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    bearer = httpx.post(f"{server.url}/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert bearer.status_code == 200, bearer.text
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=server.url, api_key="wrong-key", max_retries=0).messages.create(**body)
    assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"
    elsewhere = httpx.post(f"{server.url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                           json={"model": MODEL, "messages": body["messages"], "max_tokens": 1})
    assert elsewhere.status_code == 401 and elsewhere.json()["error"]["code"] == "invalid_api_key"  # OpenAI's
