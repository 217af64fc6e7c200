"""The OpenAI API's request and response shapes that deploykit serves (pydantic).

Every field a request may carry is declared here: the ones deploykit implements, with OpenAI's limits;
the ones that cannot change the answer (``user``, ``metadata``, ``store``...: ``IGNORED``), accepted
and ignored; and the ones it cannot honour (``tools``, a ``response_format`` other than text...),
refused. Any other field is refused too: a 400 whose ``param`` names it, never an answer to a
different question.
"""

from __future__ import annotations

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
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction", "safety_identifier",
           "prompt_cache_key")


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    """A request body: unknown fields are refused (``extra_forbidden``, named in ``param``)."""

    model_config = ConfigDict(extra="forbid")

    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    parallel_tool_calls: Any = None
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


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ResponseFormat(_Request):
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(f"{kind!r} is not supported, only 'text': deploykit has no constrained decoding")
        return kind


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: Any = None  # refused unless empty: deploykit does not call tools
    tool_choice: Any = None  # refused unless "none"
    functions: Any = None
    function_call: Any = None

    @model_validator(mode="after")
    def _refused(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldRefused("top_logprobs", "top_logprobs needs logprobs: true")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise FieldRefused(name, f"{name} are not supported: deploykit does not call tools")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise FieldRefused(name, f"{name} is not supported: deploykit does not call tools")
        return self

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


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
