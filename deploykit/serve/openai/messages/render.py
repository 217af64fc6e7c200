"""A turn's events (``turn.Event``) as Anthropic's Messages API renders them: content blocks (``text``,
``tool_use``), ``stop_reason``, usage, and the stream's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` or ``input_json_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``, ``ping``). One ``Rendering`` folds a turn's events whether it is
streamed or not, so both answers are the same message.

Usage as Anthropic counts it: ``input_tokens`` are the prompt tokens not read from the prefix cache,
``cache_read_input_tokens`` those that were (deploykit's prefix cache is automatic: nothing is ever
written on request, ``cache_creation_input_tokens`` is 0).
"""

from __future__ import annotations

import json
from typing import Any

from ..generation import Outcome
from ..protocol import new_id
from ..turn import CallArguments, CallOpened, Ended, Event, Text, arguments_object

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def tool_use_id(call_id: str) -> str:
    """Anthropic's tool_use ids: ``toolu_...`` for the turn's ``call_...``."""
    return "toolu_" + call_id.removeprefix("call_")


class Rendering:
    """The message of one turn as its events come: ``push`` returns the stream events each one makes."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.id, self.model = new_id("msg").replace("-", "_"), model
        self.prompt_tokens = prompt_tokens
        self.content: list[dict[str, Any]] = []
        self._arguments: dict[int, str] = {}  # the open tool_use blocks' JSON, by block index
        self._text: dict[str, Any] | None = None  # the open text block
        self._blocks: dict[int, int] = {}  # a call's index -> its block's index
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {"input_tokens": prompt_tokens, "output_tokens": 0,
                                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": self.usage}

    def opening(self) -> list[dict[str, Any]]:
        return [{"type": "message_start", "message": {**self.message(), "content": []}}, {"type": "ping"}]

    def push(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, Text):
            return self._text_delta(event.text)
        if isinstance(event, CallOpened):
            return self._close_text() + self._open_call(event)
        if isinstance(event, CallArguments):
            index = self._blocks[event.index]
            self._arguments[index] += event.text
            return [{"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": event.text}}]
        return self._end(event)

    @staticmethod
    def failed(error: dict[str, Any]) -> list[dict[str, Any]]:
        return [error]

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._text is None:
            self._text = {"type": "text", "text": ""}
            self.content.append(self._text)
            events.append({"type": "content_block_start", "index": len(self.content) - 1,
                           "content_block": {"type": "text", "text": ""}})
        self._text["text"] += text
        return events + [{"type": "content_block_delta", "index": len(self.content) - 1,
                          "delta": {"type": "text_delta", "text": text}}]

    def _close_text(self) -> list[dict[str, Any]]:
        if self._text is None:
            return []
        self._text = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _open_call(self, event: CallOpened) -> list[dict[str, Any]]:
        block = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}}
        self.content.append(block)
        index = len(self.content) - 1
        self._blocks[event.index], self._arguments[index] = index, ""
        return [{"type": "content_block_start", "index": index, "content_block": json.loads(json.dumps(block))}]

    def _end(self, ended: Ended) -> list[dict[str, Any]]:
        events = self._close_text()
        for index in sorted(self._arguments):
            self.content[index]["input"] = arguments_object(self._arguments.pop(index))
            events.append({"type": "content_block_stop", "index": index})
        outcome: Outcome = ended.outcome
        self.stop_sequence = outcome.stop_sequence
        called = bool(ended.calls) and ended.finish != "length"  # a forced tool's call too (chat's "stop")
        self.stop_reason = ("stop_sequence" if outcome.stop_sequence else "tool_use" if called
                            else STOP_REASONS.get(ended.finish, "end_turn"))
        self.usage = {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
                      "output_tokens": outcome.completion_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": outcome.cached_tokens}
        return events + [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason,
                                                             "stop_sequence": self.stop_sequence},
                          "usage": self.usage},
                         {"type": "message_stop"}]
