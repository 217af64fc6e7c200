"""The requests of Anthropic's Messages API (``POST /v1/messages`` and ``/v1/messages/count_tokens``) as
deploykit serves them (pydantic), and their translation into the internal request (``ChatCompletionRequest``).

Every documented field is declared: the ones deploykit implements (``output_config.format``: a JSON schema
the answer follows; ``top_k`` only where it cannot change the answer: with ``temperature: 0``, whose greedy
answer every ``top_k`` keeps; ``temperature``, ``top_p`` and ``top_k``, which newer SDKs no longer send, from
any client that does); ``metadata``, ``service_tier`` and ``cache_control`` accepted; the others (``thinking``, ``mcp_servers``, ``container``, server tools, image
and document blocks, ``top_k`` with sampling...) refused with ``param`` naming them. Any other field is
refused too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..protocol import FieldRefused, TopP


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a block's ``cache_control``, ``citations``: hints only


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Message(_Loose):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class JsonFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: JsonFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None

    @model_validator(mode="after")
    def _refused(self) -> OutputConfig:
        if self.effort is not None:
            raise FieldRefused("output_config.effort", "output_config.effort is not supported: deploykit's models "
                                                       "have no effort setting")
        return self


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    cache_control: Any = None  # accepted: deploykit's prefix cache reads every prompt's cached prefix anyway
    # documented, not implemented: refused when they ask anything
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None

    @model_validator(mode="after")
    def _checked(self) -> CountTokensRequest:
        if self.thinking and self.thinking.get("type") != "disabled":
            raise FieldRefused("thinking", "thinking is not supported: deploykit's models have no thinking budget")
        for name in ("mcp_servers", "context_management"):
            if getattr(self, name):
                raise FieldRefused(name, f"{name} is not supported by deploykit")
        self.tool_list()
        self.chat_messages()
        return self

    def tool_list(self) -> list[Tool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") not in (None, "custom"):
                raise FieldRefused(f"tools[{i}].type", f"tools of type {tool.get('type')!r} are not supported: "
                                                       "deploykit runs no server tools; only custom tools "
                                                       "(name, description, input_schema)")
            try:
                tools.append(Tool.model_validate(tool))
            except ValueError as exc:
                raise FieldRefused(f"tools[{i}]", f"not a custom tool: {exc}") from None
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise FieldRefused("tools", "two tools have the same name")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise FieldRefused("tool_choice", "tool_choice needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise FieldRefused("tool_choice.name", f"tool_choice names {choice.name!r}, which is not among the tools")
        return tools

    def chat_messages(self) -> list[dict[str, Any]]:
        """``system`` and ``messages`` as chat messages (the internal request's)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_blocks(self.system, "system")})
        for i, message in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "assistant":
                out.append(_assistant(message.content, where))
            else:
                out += _user(message.content, where)
        return out

    def internal(self) -> dict[str, Any]:
        """The internal request's fields (a ``ChatCompletionRequest``)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        tools = self.tool_list()
        if tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in tools]
        choice = self.tool_choice
        if tools and choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        fmt = self.output_config.format if self.output_config else None
        if fmt is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        return body


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    container: Any = None

    @model_validator(mode="after")
    def _sampling(self) -> MessagesRequest:
        if self.top_k and self.temperature != 0:
            raise FieldRefused("top_k", "top_k is supported only with temperature 0 (greedy, which every top_k "
                                        "keeps): deploykit samples with temperature and top_p")
        if self.container is not None:
            raise FieldRefused("container", "container is not supported: deploykit runs no code execution")
        return self

    def internal(self) -> dict[str, Any]:
        body = super().internal()
        body["max_tokens"] = self.max_tokens
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldRefused(where, "content must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise FieldRefused(f"{where}[{j}].type", f"blocks of type {kind!r} are not supported here: deploykit's "
                                                     "models take text blocks")
        texts.append(block["text"])
    return "".join(texts)


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_blocks([block], where))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise FieldRefused(f"{where}[{j}]", "a tool_use block needs an id and a name")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise FieldRefused(f"{where}[{j}].type", f"assistant blocks of type {kind!r} are not supported: "
                                                     "deploykit takes text and tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results first (one tool message each, as chat templates take them), then its
    text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_blocks([block], where))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise FieldRefused(f"{where}[{j}].tool_use_id", "a tool_result block needs the tool_use_id it answers")
            content = _text_blocks(block.get("content") or "", f"{where}[{j}].content")
            if block.get("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise FieldRefused(f"{where}[{j}].type", f"user blocks of type {kind!r} are not supported: deploykit's "
                                                     "models take text and tool_result")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])
