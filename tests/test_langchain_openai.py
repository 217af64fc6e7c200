"""langchain-openai's ``ChatOpenAI`` pointed at a real `deploykit serve` of the tiny chat model, on the
Responses API (``use_responses_api=True``) and on chat completions: a plain ``invoke`` answers, and with
``bind_tools`` and the default ``tool_choice`` (auto; the tiny model's template renders no tools, so
deploykit's generic tool format) the answer is a tool call or text, never an error. The tiny model's words
are random: what is checked is the wire protocol, not the answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from agent_apis import MODEL, chat_server
from servers import Server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with chat_server(tmp_path_factory, context=1024) as s:  # the generic tool format's prompt: ~430 bytes
        yield s


@tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


def chat(server: Server, responses: bool) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=MODEL,
                      use_responses_api=responses, temperature=0, max_tokens=12, max_retries=0, timeout=60)


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat"])
def test_invoke_answers(server: Server, responses: bool) -> None:
    answer = chat(server, responses).invoke("Tell me about the sea.")
    assert isinstance(answer, AIMessage) and answer.text and not answer.tool_calls
    assert answer.usage_metadata is not None and 0 < answer.usage_metadata["output_tokens"] <= 12
    if responses:
        assert answer.response_metadata["id"].startswith("resp")


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat"])
def test_bound_tools_answer_with_a_call_or_text(server: Server, responses: bool) -> None:
    answer = chat(server, responses).bind_tools([get_weather]).invoke("Weather in Paris?")
    assert isinstance(answer, AIMessage) and not answer.invalid_tool_calls
    assert answer.tool_calls or answer.text
    for call in answer.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"], dict)
