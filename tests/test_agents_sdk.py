"""The OpenAI Agents SDK (`openai-agents`) with its default model provider, the Responses API, pointed at a
real `deploykit serve` of the tiny chat model: an agent with one function tool runs to an answer and the
tool is called on the way. The point is the wire protocol end to end (the SDK's request fields, the
function call, its output sent back, the answer), not the answer, so the tiny model's random weights are
steered: the first turn forces the call (``tool_choice="required"``, which the SDK resets after it), and
the second answers in a JSON schema, since a random model never ends a free answer and the SDK takes a cut
one (``incomplete``) for an error. deploykit shapes an answer with tools or a schema, not both at once, so
the tool is offered until it has run and the schema set once it has.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pydantic
import pytest
from agents import (Agent, AgentHooks, ModelSettings, OpenAIProvider, RunConfig, RunContextWrapper, Runner, Tool,
                    function_tool, set_tracing_disabled)

from agent_apis import MODEL, chat_server
from servers import Server

set_tracing_disabled(True)  # nothing goes to OpenAI's trace endpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with chat_server(tmp_path_factory) as s:
        yield s


class Weather(pydantic.BaseModel):
    sky: Literal["sunny", "rainy"]


class AnswerInSchema(AgentHooks[Any]):
    """Once the tool has run, the agent answers as ``Weather``."""

    async def on_tool_end(self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool,
                          result: object) -> None:
        agent.output_type = Weather


def test_an_agent_calls_its_tool_and_answers(server: Server) -> None:
    calls: list[str] = []

    @function_tool(is_enabled=lambda context, agent: not calls)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64)
    agent = Agent(name="weather", instructions="Answer with the weather.", model=MODEL, tools=[get_weather],
                  hooks=AnswerInSchema(), model_settings=settings)
    provider = OpenAIProvider(base_url=f"{server.url}/v1", api_key="none")
    result = Runner.run_sync(agent, "Weather in Paris?", max_turns=3,
                             run_config=RunConfig(model_provider=provider, tracing_disabled=True))
    assert calls in (["Paris"], ["Rome"])
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
    assert isinstance(result.final_output, Weather)
    assert [(r.response_id or "")[:4] for r in result.raw_responses] == ["resp", "resp"]  # /v1/responses
