"""Plain data every engine module shares, below all behaviour (so no two engine modules import each
other for a type): why a request finished, the serving limits of a generation and the context they
allow, and end-of-sequence ids as a set, and what a request's output must follow (``Constraint``). No torch."""

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
    tool_call_parser: str | None = None  # how tool calls are read from an answer (``tool_choice: auto``)
    prefill_chunk: int = 256  # prompt tokens read per step while other requests decode
    tool_format: str | None = None  # "template" | "generic" | None: how tools reach the model (serve/openai/structured)


@dataclass(frozen=True)
class Speculation:
    """``spec.speculative`` as the padded loop serves it (``speculative.py``): drafts of at most ``num_tokens``
    tokens, looked up after the last ``ngram_max`` .. ``ngram_min`` tokens of the prompt and output so far
    (method ngram), or chosen by a draft model (method draft, ``drafting.py``): ``draft_path`` (a checkpoint
    directory, resolved) or ``draft_quantized`` (int8 | int4: the serving checkpoint quantized); ``hold``: the
    batch-level back-off (``Speculator.verified``)."""

    method: str = "ngram"
    num_tokens: int = 8
    ngram_min: int = 1
    ngram_max: int = 4
    draft_path: str | None = None
    draft_quantized: str | None = None
    hold: bool = True  # the batch holds its drafts while verification pays less than decoding (off: every step
    #                    drafts what the rows' paces allow; the engine's tests of verification itself)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must follow: a JSON schema (as JSON text, so it hashes and caches), from
    the request field ``param`` ("response_format" or "tools"). ``strict``: properties the schema does not
    name are not allowed (how a json_schema is enforced); False for ``json_object`` (any object)."""

    schema: str
    param: str = "response_format"
    strict: bool = True


def eos_set(value: Any) -> set[int]:
    """An ``eos_token_id`` as transformers stores it (an int, a list, or None) as a set."""
    return set(value if isinstance(value, list) else [] if value is None else [value])


MAX_DEFAULT_CONTEXT = 8192


def context_length(config: Any, limits: Limits) -> int:
    """The context a request may use: the manifest's, else the model's own (at most 8192). ``config``: the
    model's transformers config (its text config counts for a multimodal one). Every runtime asks here."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    own = getattr(text, "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
    return int(limits.context_length or min(own, MAX_DEFAULT_CONTEXT))
