"""The OpenAI API's request and response shapes that deploykit serves (pydantic).

Requests ignore fields deploykit does not implement (as the API's own servers and vLLM do, so that
clients sending e.g. ``user`` or ``presence_penalty: 0`` keep working) but validate every field it
uses; an invalid value is a 400 that names the field. ``n`` other than 1 is refused rather than
silently answered once.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class Sampling(_Request):
    """The fields chat and completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)

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


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


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
