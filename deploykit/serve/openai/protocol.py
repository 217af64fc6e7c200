"""The OpenAI API's request and response shapes that deploykit serves (pydantic).

Every field a request may carry is declared here: the ones deploykit implements, with OpenAI's limits;
the ones that cannot change the answer (``user``, ``metadata``, ``store``...: ``IGNORED``), accepted
and ignored; and the ones it cannot honour (``functions``, a schema keyword the engine cannot enforce...),
refused. ``response_format`` and ``tools`` are parsed and checked here (shapes, names); what they ask of the
engine is ``structured.py``'s. Any other field is refused too: a 400 whose ``param`` names it, never an answer to a
different question.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # a 64-bit integer, as torch's generators take

# Fields that never change the answer: accepted and ignored (docs/serving.md lists them).
IGNORED = ("user", "metadata", "store", "service_tier", "prediction", "safety_identifier", "prompt_cache_key")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request body: unknown fields are refused (``extra_forbidden``, named in ``param``)."""

    model_config = ConfigDict(extra="forbid")

    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prediction: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None


class StreamOptions(_Request):
    include_usage: bool = False


class Sampling(_Strict):
    """The fields chat and completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=8)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[int, Bias] | None = None  # JSON keys are strings: pydantic parses them as token ids

    @field_validator("logit_bias")
    @classmethod
    def _at_most_300(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is not None and len(bias) > 300:
            raise ValueError("at most 300 tokens may be biased")
        return bias

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((self.logit_bias or {}).items()))

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class TextPart(_Request):
    type: Literal["text"]
    text: str


class CalledFunction(_Request):
    name: str
    arguments: str = "{}"


class ToolCall(_Request):
    """An assistant message's earlier call, in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message answers this call

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (tool calls with their arguments as an object, as
        transformers' templates expect)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and role == "tool":
            message["name"] = self.name
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets it as the client sent it


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        return self


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None  # the deprecated function-calling fields: refused, use tools
    function_call: Any = None

    @model_validator(mode="after")
    def _refused(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldRefused("top_logprobs", "top_logprobs needs logprobs: true")
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, "none", []):
                raise FieldRefused(name, f"{name} is deprecated and not supported: use tools and tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldRefused("tools", "two tools have the same function name")
        if self.tool_choice not in (None, "none") and not names:
            raise FieldRefused("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise FieldRefused("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                                              "among the tools")
        return self

    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How tools are used: OpenAI's default is "auto" when tools are given, "none" without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def top(self) -> int | None:
        """How many alternatives each token's logprobs list; None when logprobs are off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: the prompt's logprobs alone
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None  # refused unless empty: no fill-in-the-middle
    best_of: int | None = None  # refused unless it equals n

    @model_validator(mode="after")
    def _refused(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise FieldRefused("max_tokens", "max_tokens 0 needs echo: true (the prompt's logprobs alone)")
        if self.suffix:
            raise FieldRefused("suffix", "suffix is not supported: deploykit does not fill in the middle")
        if self.best_of not in (None, self.n):
            raise FieldRefused("best_of", "best_of other than n is not supported")
        return self

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


class FieldRefused(ValueError):
    """A refusal that names the field it is about (``errors._validation`` puts it in ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EmbeddingRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _no_structure(cls, body: Any) -> Any:
        """A vector has no structure to constrain: these chat fields are refused, not ignored."""
        for name in ("response_format", "tools", "tool_choice", "parallel_tool_calls"):
            if isinstance(body, dict) and name in body:
                raise FieldRefused(name, f"{name} is a chat field; embeddings have no output to shape")
        return body

    def texts(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(i, int) for i in self.input):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


# ---- responses -------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # chat and completions; not embeddings


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deploykit"
    # deploykit's own: whether the model is in memory now ("loaded", "unloaded", "loading"); an unloaded
    # one is loaded by its next request (docs/budget.md)
    loaded: bool = True
    state: Literal["loaded", "unloaded", "loading"] = "loaded"
    # a LoRA adapter (``<deployment>:<adapter>``): the deployment serving its base, as vLLM lists adapters
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
