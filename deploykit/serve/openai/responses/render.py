"""A turn's events (``turn.Event``) as OpenAI's Responses API renders them: the output items (an assistant
``message`` with one ``output_text`` part, and ``function_call`` items), the ``response`` object, and the
typed stream events in OpenAI's order, each with its ``sequence_number``.

One ``Rendering`` folds the events of a turn whether it is streamed or not, so a streamed answer and a
whole one are the same response.
"""

from __future__ import annotations

import json
from typing import Any

from ..generation import Outcome
from ..protocol import new_id, now
from ..turn import CallArguments, CallOpened, Ended, Event, Text
from .protocol import ResponsesRequest


def usage(outcome: Outcome) -> dict[str, Any]:
    # cache_write_tokens (required by OpenAI's Response): 0, as Messages' cache_creation_input_tokens: the
    # prefix cache keeps what it reads for itself, no prompt is written to a cache on request
    return {"input_tokens": outcome.prompt_tokens,
            "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": outcome.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


class Rendering:
    """The response of one turn as its events come: ``push`` returns the stream events each one makes."""

    def __init__(self, body: ResponsesRequest) -> None:
        self.body = body
        self.id, self.created = new_id("resp"), now()
        self.output: list[dict[str, Any]] = []
        self.sequence = 0
        self._message: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # the open function_call items, by call index
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    def response(self) -> dict[str, Any]:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "error": self.error, "incomplete_details": self.incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": body.model, "output": self.output,
                "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": 1.0 if body.temperature is None else body.temperature, "text": body.text_echo(),
                "tool_choice": body.tool_choice or "auto" if body.tools else body.tool_choice or "none",
                "tools": [t.model_dump(exclude_none=True) for t in body.tool_list()],
                "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
                "usage": self.usage, "user": body.user, "metadata": body.metadata or {}}

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def push(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, Text):
            return self._text(event.text)
        if isinstance(event, CallOpened):
            return self._close_message() + self._open_call(event)
        if isinstance(event, CallArguments):
            item = self._calls[event.index]
            item["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.output.index(item), delta=event.text)]
        return self._end(event)

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that end a stream whose turn failed (``error``: OpenAI's error body)."""
        self.status = "failed"
        self.error = {"code": error["error"].get("code") or "server_error", "message": error["error"]["message"]}
        return [self._event("response.failed", response=self.response())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = [] if self._message is not None else self._open_message()
        assert self._message is not None
        self._message["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=self._message["id"], output_index=
                                     self.output.index(self._message), content_index=0, delta=text, logprobs=[])]

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.output.append(self._message)
        index = len(self.output) - 1
        added = {**self._message, "content": []}
        return [self._event("response.output_item.added", output_index=index, item=added),
                self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                            content_index=0, part={**self._message["content"][0]})]

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._message
        if item is None:
            return []
        self._message = None
        item["status"] = status
        index, part = self.output.index(item), item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=json.loads(json.dumps(part))),
                self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def _open_call(self, event: CallOpened) -> list[dict[str, Any]]:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                "name": event.name, "arguments": ""}
        self._calls[event.index] = item
        self.output.append(item)
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item={**item})]

    def _close_call(self, item: dict[str, Any], status: str) -> list[dict[str, Any]]:
        item["status"] = status
        index = self.output.index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item={**item})]

    def _end(self, ended: Ended) -> list[dict[str, Any]]:
        cut = ended.finish == "length"
        status = "incomplete" if cut else "completed"
        events = [] if self.output else self._open_message()  # an empty answer is still one (empty) message
        events += self._close_message(status)
        for index in sorted(self._calls):
            events += self._close_call(self._calls.pop(index), status)
        self.usage = usage(ended.outcome)
        self.status = status
        if cut:
            self.incomplete = {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self.response())]
        return events + [self._event("response.completed", response=self.response())]
