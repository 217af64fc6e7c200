"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API parsed into the
internal request (``turn``), its events rendered as a message or as Anthropic's stream events
(``render``); errors reshaped to Anthropic's by ``wire.AnthropicWire``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ...errors import APIError
from ..choices import end
from ..protocol import ChatCompletionRequest
from ..stream import LeasedStream
from ..turn import count_prompt, events, pinned, refuse_relayed, started, typed_sse, typed_stream
from .protocol import CountTokensRequest, MessagesRequest
from .render import Rendering
from .wire import anthropic_error

router = APIRouter()
ROUTE = "/v1/messages"
# the internal request's fields as this face names them (in the ``param`` of a refusal)
PARAMS = {"stop": "stop_sequences", "tool_choice": "tool_choice", "parallel_tool_calls":
          "tool_choice.disable_parallel_tool_use", "response_format": "output_config.format"}


def internal(body: CountTokensRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.internal())
    except ValidationError as exc:  # what the shared checks refuse (five stop sequences, say)
        first = exc.errors()[0]
        name = str(first.get("loc", ("messages",))[0])
        param = PARAMS.get(name, name)
        raise APIError(400, f"{param}: {first.get('msg')}", param=param, code="invalid_value") from None


@router.post(ROUTE, response_model=None)
async def create(body: MessagesRequest, request: Request) -> Any:
    chat = internal(body)
    held = await pinned(chat, request)
    refuse_relayed(held, ROUTE)
    turn = await started(chat, request, held, params=PARAMS)
    rendering = Rendering(body.model, len(turn.runs[0].request.prompt_ids))
    if body.stream:
        return LeasedStream(typed_stream(turn, rendering), lease=turn.held, runs=turn.runs, model=turn.model,
                            failure=lambda error: [typed_sse(anthropic_error(_status(error), error))])
    try:
        async for event in events(turn.runs[0], turn.plan):
            rendering.push(event)
    finally:
        end(turn.runs, turn.held)
    return rendering.message()


@router.post(ROUTE + "/count_tokens", response_model=None)
async def count_tokens(body: CountTokensRequest, request: Request) -> Any:
    chat = internal(body)
    held = await pinned(chat, request)
    refuse_relayed(held, ROUTE + "/count_tokens")
    return {"input_tokens": await count_prompt(chat, held, params=PARAMS)}


def _status(error: dict[str, Any]) -> int:
    """The status a failure mid-stream would have had (its code says it; a generation failure is a 500)."""
    return {"queue_full": 429, "model_not_ready": 503}.get(str(error.get("error", {}).get("code")), 500)


