"""The request of OpenAI's ``POST /v1/responses`` as deploykit serves it (pydantic), and its translation
into the internal request (``ChatCompletionRequest``) that every face shares.

Every documented field is declared: the ones deploykit implements; the ones that cannot change the answer
(``metadata``, ``user``, ``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``stream_options``)
accepted; the ones it cannot honour (``store: true``, ``previous_response_id``, ``background``,
``conversation``, ``include``, ``prompt``, ``reasoning``, ``truncation: auto``, hosted tools, image and file
inputs...) refused with ``param`` naming them. Any other field is refused too (``extra_forbidden``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..protocol import FieldRefused, Temperature, TopP

_TEXT_PARTS = ("input_text", "output_text")


class _Loose(BaseModel):
    """An input item or part: fields that only echo an earlier output (``id``, ``status``, ``annotations``)
    may come back and are not read."""

    model_config = ConfigDict(extra="ignore")


class JsonSchemaText(_Loose):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainText(_Loose):
    type: Literal["text", "json_object"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: PlainText | JsonSchemaText | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _refused(self) -> TextConfig:
        if self.verbosity not in (None, "medium"):
            raise FieldRefused("text.verbosity", "text.verbosity other than 'medium' is not supported: deploykit's "
                                                 "models have no verbosity control")
        return self


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool | None = None  # deploykit's events carry no obfuscation padding either way


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # documented, not implemented: refused when they ask anything
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    prompt: Any = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="after")
    def _refused(self) -> ResponsesRequest:
        for name, why in _UNSUPPORTED.items():
            if getattr(self, name) not in (None, False, [], {}, 0, "disabled"):
                raise FieldRefused(name, f"{name} is not supported by deploykit: {why}")
        if self.store:
            raise FieldRefused("store", "store: true is not supported: deploykit keeps no responses (every answer is "
                                        "returned and forgotten); send store: false or leave it out, and send the whole "
                                        "conversation in input")
        if self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise FieldRefused("reasoning", "reasoning is not supported: deploykit's models have no reasoning settings")
        self.tool_list()  # refuses what is not a function tool, and a tool_choice naming none of them
        self.chat_messages()  # refuses input items deploykit cannot render
        return self

    def tool_list(self) -> list[FunctionTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise FieldRefused(f"tools[{i}].type", f"tools of type {tool.get('type')!r} are not supported: "
                                                       "deploykit runs no hosted tools; only 'function' tools")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValueError as exc:
                raise FieldRefused(f"tools[{i}]", f"not a function tool: {_first(exc)}") from None
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise FieldRefused("tools", "two tools have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:  # "auto" without tools: OpenAI's default, no tools
            raise FieldRefused("tool_choice", "tool_choice needs tools")
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise FieldRefused("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported: "
                                                  "name a function ({'type': 'function', 'name': ...}) or use "
                                                  "'none', 'auto' or 'required'")
            named = FunctionChoice.model_validate(choice).name
            if named not in names:
                raise FieldRefused("tool_choice", f"tool_choice names {named!r}, which is not among the tools")
        return tools

    def chat_messages(self) -> list[dict[str, Any]]:
        """``instructions`` and ``input`` as chat messages (the internal request's)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        if not self.input:
            raise FieldRefused("input", "input must not be an empty list")
        for i, item in enumerate(self.input):
            _add(messages, item, f"input[{i}]")
        return messages

    def internal(self) -> dict[str, Any]:
        """The internal request's fields (a ``ChatCompletionRequest``)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        tools = self.tool_list()
        if tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                             for t in tools]
        if tools and isinstance(self.tool_choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice["name"]}}
        elif tools and self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if isinstance(fmt, JsonSchemaText):
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return body

    def text_echo(self) -> dict[str, Any]:
        fmt = self.text.format if self.text else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}


_UNSUPPORTED = {
    "previous_response_id": "deploykit keeps no responses; send the whole conversation in input",
    "background": "responses are answered in the request that asks them",
    "conversation": "deploykit keeps no conversations; send the whole conversation in input",
    "include": "deploykit has none of the extra outputs it asks for",
    "max_tool_calls": "the model's calls are not counted against a limit; use tool_choice",
    "prompt": "deploykit has no stored prompts; send instructions and input",
    "prompt_cache_retention": "deploykit's prefix cache is the deployment's own (spec.serving)",
    "top_logprobs": "logprobs are served by /v1/chat/completions",
    "truncation": "deploykit never drops input to fit the context; it refuses a prompt too long",
}


def _first(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}"
    return str(exc)


def _add(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise FieldRefused(where, "an input item must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise FieldRefused(f"{where}.role", f"role {role!r} is not one of user, assistant, system, developer")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _str(item, "call_id", where), "type": "function",
                "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
    else:
        raise FieldRefused(f"{where}.type", f"input items of type {kind!r} are not supported: deploykit takes "
                                            "messages, function_call and function_call_output items")


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldRefused(f"{where}.{key}", f"{key} must be a string")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (images, files and audio are refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldRefused(where, "content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise FieldRefused(f"{where}[{j}].type", f"content parts of type {kind!r} are not supported: deploykit's "
                                                     "models take text (input_text, output_text)")
        texts.append(part["text"])
    return "".join(texts)
