"""``POST /v1/responses``: OpenAI's Responses API parsed into the internal request (``turn``), its events
rendered as a ``response`` object or as the typed stream events (``render``). Responses are not stored:
``store: true``, ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` are refused (an absent
``store`` means not stored, although OpenAI's own default is to store).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from ...errors import APIError
from ..choices import end
from ..protocol import ChatCompletionRequest
from ..stream import LeasedStream
from ..turn import events, pinned, refuse_relayed, started, typed_sse, typed_stream
from .protocol import ResponsesRequest
from .render import Rendering

router = APIRouter()
ROUTE = "/v1/responses"
# the internal request's fields as this face names them (in the ``param`` of a refusal)
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
          "stop": "text.format"}


def internal(body: ResponsesRequest) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body.internal())
    except ValidationError as exc:  # what the shared checks refuse (a tool's schema, say)
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        param = PARAMS.get(where.split(".")[0], where.split(".")[0] or None)
        raise APIError(400, f"{param}: {first.get('msg')}", param=param, code="invalid_value") from None


@router.post(ROUTE, response_model=None)
async def create(body: ResponsesRequest, request: Request) -> Any:
    chat = internal(body)
    held = await pinned(chat, request)
    refuse_relayed(held, ROUTE)
    turn = await started(chat, request, held, params=PARAMS)
    rendering = Rendering(body)
    if body.stream:
        return LeasedStream(typed_stream(turn, rendering), lease=turn.held, runs=turn.runs, model=turn.model,
                            failure=lambda error: [typed_sse(e) for e in rendering.failed(error)])
    try:
        async for event in events(turn.runs[0], turn.plan):
            rendering.push(event)
    finally:
        end(turn.runs, turn.held)
    return rendering.response()


@router.get(ROUTE + "/{response_id}", response_model=None)
async def retrieve(response_id: str) -> Any:
    raise _not_stored(response_id)


@router.delete(ROUTE + "/{response_id}", response_model=None)
async def delete(response_id: str) -> Any:
    raise _not_stored(response_id)


def _not_stored(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r}: deploykit stores no responses (store is not supported)",
                    param="response_id", code="not_found")


