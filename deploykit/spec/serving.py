"""The manifest's ``spec.serving``, ``spec.lifecycle`` and ``spec.engine`` sections: request limits,
batching, the prefix cache and chunked prefill; keep-alive and loading; which engine runs the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .values import KeepAlive, Size, Strict

MAX_CONTEXT = 1 << 20  # tokens of context, and of one answer
MAX_QUEUED = 4096  # requests waiting beyond the running ones, per deployment
MAX_INPUT_ITEMS = 4096  # prompts or embedding inputs in one request
MAX_PRIORITY = 1_000_000


class PrefixCache(Strict):
    """The KV cache of finished requests' token sequences, kept to serve later requests that share their
    beginning (a shared system prompt, a conversation's earlier turns, a document sent again)."""

    enabled: bool = Field(True, description="Keep and reuse prompt prefixes where the engine keeps them: "
                                            "padded batching of a causal LM in one process or Ray Serve "
                                            "replica (elsewhere the plan counts no bytes for it). false: "
                                            "none kept, no bytes planned.")
    max_bytes: Size | None = Field(
        None, description="Most bytes the kept KV may hold, spread as the model's KV is (each layer's on the "
                          "device that runs it); least recently used evicted first. Part of the plan's bytes "
                          "(and of the host budget). Default: a quarter of the KV room the plan leaves beside "
                          "the weights and LoRA adapters on the devices holding the KV (on the CPU also bounded "
                          "by the machine's memory and a serve --budget's cpu tier), at most 1 GiB, in whole "
                          "MiB (1 GiB where nothing bounds them; 0, none kept, where a quarter is under 1 MiB). A value "
                          "that leaves the running batch less than 64 MiB of KV is a plan error.")


class Serving(Strict):
    """Limits of the inference API for this model (``deploykit serve``, ``Deployment.generate``)."""

    context_length: int | None = Field(
        None, ge=8, le=MAX_CONTEXT, strict=True,
        description="Longest prompt plus generated tokens; default: the model's max_position_embeddings, at most "
                    "8192.")
    max_tokens: int = Field(
        512, ge=1, le=MAX_CONTEXT, strict=True,
        description="Most tokens one request may generate; a request asking for more is refused (400).")
    default_max_tokens: int = Field(
        256, ge=1, le=MAX_CONTEXT, strict=True,
        description="Tokens generated when a request names no max_tokens (capped by max_tokens).")
    max_concurrent: int = Field(16, ge=1, le=1024, strict=True, description="Requests decoded together in one batch.")
    max_queued: int = Field(
        64, ge=0, le=MAX_QUEUED, strict=True,
        description=f"Requests waiting for a batch slot beyond max_concurrent (at most {MAX_QUEUED}); more are "
                    "refused (429 with Retry-After). They wait in deploykit, never in an engine's threads.")
    max_input_items: int = Field(
        256, ge=1, le=MAX_INPUT_ITEMS, strict=True,
        description="Most prompts or embedding inputs in one request.")
    batching: Literal["padded", "continuous"] = Field(
        "padded", description="padded: deploykit's batch loop (per-request sampling); continuous: "
                              "transformers' continuous batching (greedy requests only).")
    tool_call_parser: Literal["hermes"] | None = Field(
        None, description="How this model family writes tool calls, read from answers to tool_choice 'auto' "
                          "(hermes: <tool_call>{json}</tool_call>, Hermes and Qwen2/2.5/3); unset: 'auto' is "
                          "refused (400) and only forced calls (required, a named function) are served.")
    tool_format: Literal["template", "generic"] | None = Field(
        None, description="How a request's tools reach the model: template (the chat template renders them, and "
                          "'auto' calls are read with tool_call_parser) or generic (a system message describes "
                          "them and the grammar shapes the answer: {\"content\": text} or {\"tool_calls\": "
                          "[...]}, on any model); unset: template, except tool_choice 'auto' on a chat template "
                          "that renders no tools, which is generic.")
    prefix_cache: PrefixCache = Field(default_factory=PrefixCache,
                                      description="Reuse of prompt prefixes across requests (padded batching).")
    prefill_chunk: int = Field(256, ge=16, le=65536, strict=True,
                               description="The most prompt tokens read in one step (padded batching): a "
                                           "longer prompt is read in chunks between the decode steps of the "
                                           "running requests, each sized to take about 1.5 of their steps "
                                           "(at most this many tokens; this many when nothing else runs).")

    @field_validator("prefix_cache")
    @classmethod
    def _padded_only(cls, cache: PrefixCache, info: ValidationInfo) -> PrefixCache:
        if cache != PrefixCache() and cache.enabled and info.data.get("batching") == "continuous":
            raise PydanticCustomError(
                "prefix_cache_continuous", "the prefix cache needs batching: padded (transformers' continuous "
                                           "batching keeps no prefixes here); remove prefix_cache or set its enabled: false", {})
        return cache

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.prefix_cache == PrefixCache():  # manifests that never name them keep their digest
            data.pop("prefix_cache", None)
        if self.prefill_chunk == 256:
            data.pop("prefill_chunk", None)
        if self.tool_call_parser is None:
            data.pop("tool_call_parser", None)
        if self.tool_format is None:
            data.pop("tool_format", None)
        return data

    @field_validator("max_tokens")
    @classmethod
    def _room_for_a_prompt(cls, max_tokens: int, info: ValidationInfo) -> int:
        context = info.data.get("context_length")
        if context is not None and max_tokens >= context:
            raise PydanticCustomError(
                "max_tokens_context", "max_tokens {m} leaves no room for a prompt in context_length {c}; "
                                      "make it smaller than context_length", {"m": max_tokens, "c": context})
        return max_tokens


class Lifecycle(Strict):
    """When ``deploykit serve`` holds this model in memory, under its budget (docs/budget.md)."""

    keep_alive: KeepAlive = Field(None, description="Unload after being idle this long (counted from the end "
                                                    "of the last request); 'forever' never unloads when idle.")
    load: Literal["eager", "on-demand"] = Field(
        "eager", description="eager: loaded when served or applied; on-demand: loaded at its first request.")
    priority: int = Field(
        0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, strict=True,
        description="Making room for a deployment unloads idle ones of this priority or lower (lowest first, then "
                    "least recently used).")


class Engine(Strict):
    """What computes the model: deploykit's own transformers engine, in process, or llama.cpp: one
    ``llama-server`` process per generation that deploykit starts, checks, routes to and stops
    (docs/engines.md). The llama.cpp fields are llama-server's options that change what it serves."""

    name: Literal["transformers", "llama.cpp"] = Field(
        "transformers", description="transformers (default): safetensors checkpoints and GGUF imports, in "
                                    "process. llama.cpp: a GGUF file served by a llama-server process.")
    binary: Path | None = Field(
        None, description="llama.cpp: the llama-server executable (relative to the manifest). Default: "
                          "$DEPLOYKIT_LLAMA_SERVER, else the one the deploykit[llamacpp] extra installed, else "
                          "llama-server on PATH.")
    slots: int = Field(4, ge=1, le=256, strict=True, description="llama.cpp: requests decoded together (llama-server "
                                                    "--parallel); more wait in deploykit's queue "
                                                    "(spec.serving.max_queued).")
    context: int = Field(
        4096, ge=64, le=MAX_CONTEXT, strict=True,
        description="llama.cpp: tokens of context per slot (prompt plus generated); the KV cache holds slots x "
                    "context.")
    threads: int | None = Field(None, ge=1, le=1024, strict=True, description="llama.cpp: CPU threads for generation "
                                                                 "(--threads); default: llama-server's choice.")
    batch_size: int = Field(
        512, ge=1, le=1 << 16, strict=True,
        description="llama.cpp: prompt tokens evaluated per step (--batch-size and --ubatch-size).")

    @model_validator(mode="after")
    def _llama_fields_need_llama(self) -> Engine:
        if self.name == "transformers":
            named = sorted(self.model_fields_set - {"name"})
            if named:
                raise PydanticCustomError(
                    "engine_field", "{f} is an option of the llama.cpp engine; set engine.name: llama.cpp or "
                    "remove it", {"f": named[0], "at": named[0]})
        return self
