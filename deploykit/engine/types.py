"""Plain data every engine module shares, below all behaviour (so no two engine modules import each
other for a type): why a request finished, the serving limits of a generation, and end-of-sequence ids
as a set. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Limits:
    """``spec.serving`` of the manifest the generation was loaded from."""

    context_length: int | None = None
    max_tokens: int = 512
    default_max_tokens: int = 256
    max_concurrent: int = 16
    max_queued: int = 64
    max_input_items: int = 256
    batching: str = "padded"
    prefix_cache_bytes: int = 0  # spec.serving.prefix_cache: 0 = none
    prefill_chunk: int = 256  # prompt tokens read per step while other requests decode


def eos_set(value: Any) -> set[int]:
    """An ``eos_token_id`` as transformers stores it (an int, a list, or None) as a set."""
    return set(value if isinstance(value, list) else [] if value is None else [value])
