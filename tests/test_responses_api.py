"""OpenAI's Responses API (``POST /v1/responses``) through the official `openai` client against a real
`deploykit serve` of the tiny chat model (tests/chatmodel.py): the same turn as /v1/chat/completions, whole
or streamed (OpenAI's typed events in order), JSON schema output, a two-turn function-tool loop, and every
field deploykit refuses; and chat's ``refusal: null``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from agent_apis import MODEL, chat_server
from servers import Server

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with chat_server(tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, str]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                            temperature=0)
    return answer.choices[0].message.content or "", answer.choices[0].finish_reason


def test_a_chat_completion_message_says_refusal_null(server: Server) -> None:
    """OpenAI's ChatCompletionMessage requires ``refusal`` (null when the model did not refuse)."""
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None


def test_text_is_the_chat_turn_with_instructions_as_system(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Tell me about the sea.",
                                       max_output_tokens=12, temperature=0, metadata={"case": "text"}, user="u1")
    text, finish = chat_text(client, [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Tell me about the sea."}], 12)
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == text
    assert response.status == ("incomplete" if finish == "length" else "completed")
    if finish == "length":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.metadata == {"case": "text"} and response.user == "u1" and response.store is False
    usage = response.usage
    assert usage is not None and usage.output_tokens <= 12 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_input_items_are_the_chat_messages(client: openai.OpenAI) -> None:
    items: Any = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                  {"role": "user", "content": "And the sea?"}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    text, _ = chat_text(client, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                 {"role": "user", "content": "And the sea?"}], 8)
    assert response.output_text == text


def test_a_stream_sends_openais_events_in_order(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=10,
                                    temperature=0)
    with client.responses.stream(model=MODEL, input="Tell me about the sea.", max_output_tokens=10,
                                 temperature=0) as stream:
        seen = list(stream)
    kinds = [e.type for e in seen]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * deltas +
                     ["response.output_text.done", "response.content_part.done", "response.output_item.done", last])
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = seen[-1]
    assert done.response.status == whole.status and done.response.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_output_follows_the_schema(client: openai.OpenAI) -> None:
    import jsonschema

    fmt: Any = {"format": {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}}
    response = client.responses.create(model=MODEL, input="A pet, as JSON.", text=fmt, max_output_tokens=40)
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input="A pet, as JSON.", text=fmt, max_output_tokens=40) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


def test_a_function_tool_loop_through_function_call_output(client: openai.OpenAI) -> None:
    """Turn one asks for a call (forced: the tiny model's template renders no tools); turn two sends the
    call and its output back and gets text: the same turn as chat's with the tool messages."""
    question: Any = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=64)  # the call, byte by byte
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert call.call_id.startswith("call_") and first.status == "completed"
    second_input = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(model=MODEL, input=second_input, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    text, _ = chat_text(client, [{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [{
                                     "id": call.call_id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": call.arguments}}]},
                                 {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}], 8)
    assert second.output_text == text and not [i for i in second.output if i.type == "function_call"]


def test_a_streamed_named_call_sends_its_arguments_as_they_come(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40) as stream:
        seen = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in seen]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    pieces = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert call.type == "function_call" and call.arguments == pieces and json.loads(pieces)["city"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "text.format"),
    ({"max_output_tokens": 10_000}, "max_output_tokens"),
])
def test_what_deploykit_cannot_honour_is_refused_with_its_param(server: Server, fields: dict[str, Any],
                                                                  param: str) -> None:
    body = {"model": MODEL, "input": "hi", **fields}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_stored_responses_are_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_123")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_123")


def test_an_unknown_model_and_adapter_are_404s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=f"{MODEL}:nope", input="hi")
