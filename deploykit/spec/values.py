"""The values a manifest writes as people do: sizes ('2GiB'), durations ('120s'), keep-alives
('forever'), parsed into numbers for the schema's models (``schema.py``, ``rollout.py``, ``serving.py``),
and the strict base every section model shares."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    PlainSerializer,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from ..units import MAX_DURATION, MAX_SIZE, SIZE_UNITS_TEXT, format_duration, parse_duration, parse_size


def _size(value: object) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise PydanticCustomError("size", str(exc)) from None


def _duration(value: object) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise PydanticCustomError("duration", str(exc)) from None


Size = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema({
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": MAX_SIZE},
            {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGT]i?B|[kK]i?B|B)?\s*$"},
        ],
        "description": f"A size: {SIZE_UNITS_TEXT}.",
    }),
]
Duration = Annotated[
    float,
    BeforeValidator(_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({
        "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DURATION},
                  {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"}],
        "description": "A duration: '500ms', '120s', '2m', '1h', or a number of seconds.",
    }),
]


def _keep_alive(value: object) -> float | None:
    if value is None or value == "forever":
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise PydanticCustomError("keep_alive", f"{exc}, or 'forever'") from None


KeepAlive = Annotated[
    float | None,
    BeforeValidator(_keep_alive),
    PlainSerializer(lambda v: "forever" if v is None else format_duration(v), return_type=str),
    WithJsonSchema({
        "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": MAX_DURATION},
                  {"type": "string", "pattern": r"^\s*(forever|\d+(\.\d+)?\s*(ms|s|m|h)?)\s*$"}],
        "description": "A duration ('30s', '5m', '1h', or a number of seconds), or 'forever'.",
    }),
]


class Strict(BaseModel):
    """A manifest section: unknown fields refused, frozen once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
