"""What one loaded generation serves requests with: its batching engine (text) or its embedder.

Each generation owns one runtime, built when it is installed and closed when it is freed: requests
that started on a generation finish on it while newer requests go to the next. Model work runs on the
runtime's own threads, never on the caller's event loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..names import Task
from ..threads import release_openmp_threads
from .embeddings import Pooling, embed, pooling_of
from .text import RequestError, TextStream, check_length
from .types import Constraint, Limits, context_length, eos_set

if TYPE_CHECKING:
    from .adapters import AdapterSource, Adapters
    from .loader import LoadedModel
    from .serving import TextEngine
    from .types import Speculation

log = logging.getLogger(__name__)
def eos_ids_of(checkpoint: Any, config: Any) -> set[int]:
    """The end-of-sequence ids of a checkpoint: its generation_config.json's, else its config's (what
    ``from_pretrained`` gives an in-process model as ``generation_config``). Every runtime asks here."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    return eos_set(eos)


@dataclass(frozen=True)
class Sampling:
    """How to generate: ``Deployment.generate`` / ``chat`` take these as keyword arguments."""

    max_tokens: int | None = None  # None: spec.serving.default_max_tokens
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


class TextRuntime:
    """A causal LM's text engine plus what requests need of its tokenizer and limits: composed from those
    parts, whatever runs the model (in process: ``in_process``; pipeline stages, tensor-parallel ranks and
    replicas build their engine and hand it here)."""

    kind = "text"

    def __init__(self, engine: TextEngine, tokenizer: Any, limits: Limits, *, context_length: int,
                 loaded: LoadedModel | None = None) -> None:
        if tokenizer is None:
            raise RequestError("this model ships no tokenizer: it cannot serve text", code="no_tokenizer")
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.context_length = context_length
        self.loaded = loaded  # the in-process model, if any

    @classmethod
    def in_process(cls, loaded: LoadedModel, limits: Limits, *, kv_cache_bytes: int,
                   forward_lock: threading.Lock | None, adapters: Sequence[AdapterSource] = (),
                   speculative: Speculation | None = None) -> TextRuntime:
        """The batching engine over a model loaded in this process, with ``adapters`` loaded (the padded
        loop serves LoRA adapters, and takes more while it serves: ``TextRuntime.adapters``)."""
        from .adapters import Adapters
        from .batching import Engine

        if loaded.tokenizer is None:
            raise RequestError("this model ships no tokenizer: it cannot serve text", code="no_tokenizer")
        padded = limits.batching != "continuous"
        registry = Adapters(loaded.model) if padded else None
        for source in adapters:
            if registry is None:
                raise RequestError("LoRA adapters are served by the padded batch loop only", code="unsupported")
            registry.load(source)
        length = context_length(loaded.model.config, limits)
        draft, error = draft_of(loaded, speculative) if padded else (None, None)
        engine = Engine(loaded.model, loaded.tokenizer, max_batch_size=limits.max_concurrent,
                        max_queued=limits.max_queued, kv_cache_bytes=kv_cache_bytes, forward_lock=forward_lock,
                        backend="padded" if padded else "continuous",
                        prefix_cache_bytes=loaded.plan.prefix_cache_bytes, prefill_chunk=limits.prefill_chunk,
                        context_length=length, adapters=registry, speculative=speculative, draft_model=draft,
                        speculative_error=error)
        return cls(engine, loaded.tokenizer, limits, context_length=length, loaded=loaded)

    @property
    def adapters(self) -> Adapters | None:
        """The LoRA adapters this runtime serves beside the base (None: it serves none)."""
        return getattr(self.engine, "adapters", None)

    def check_grammar(self, constraint: Constraint) -> None:
        """Compile ``constraint`` now (off the engine's thread; cached for its requests), or RequestError:
        an engine without grammars, or a schema it cannot enforce."""
        grammars = getattr(self.engine, "grammars", None)
        if grammars is None:
            raise RequestError(f"{constraint.param} needs grammar-constrained decoding, which this deployment's engine "
                               "does not do (spec.serving.batching: continuous, or spec.replicas); use batching: "
                               "padded in one process, pipeline stages or tensor-parallel ranks",
                               param=constraint.param, code="unsupported")
        grammars.compile(constraint)

    @property
    def eos_ids(self) -> set[int]:
        return set(self.engine.eos_ids)

    def complete(self, prompt_ids: list[int], options: Sampling, *, prompt_param: str = "prompt") -> Completion:
        """Generate to the end on this thread's behalf (the engine's thread does the work)."""
        from .requests import GenerationRequest

        max_tokens = options.max_tokens or min(self.limits.default_max_tokens, self.limits.max_tokens)
        check_length(len(prompt_ids), max_tokens, context_length=self.context_length,
                     limit=self.limits.max_tokens, prompt_param=prompt_param)
        request = GenerationRequest(prompt_ids=prompt_ids, max_new_tokens=max_tokens,
                                    temperature=options.temperature, top_p=options.top_p, seed=options.seed,
                                    stop_strings=tuple(options.stop))
        text = TextStream(self.tokenizer, stop=options.stop, skip_ids=sorted(self.eos_ids))
        handle = self.engine.submit(request)
        parts = []
        for token in handle:
            parts.append(text.push(token))
            if text.stopped:
                self.engine.cancel(handle)
        result = handle.result()
        if result.finish_reason == "error":
            raise RequestError(f"generation failed: {result.error}")
        parts.append(text.finish())
        reason = "stop" if text.stopped_by_string or result.finish_reason == "stop" else "length"
        return Completion("".join(parts), reason, result.prompt_tokens, len(result.token_ids))

    def close(self, timeout: float | None = 30.0) -> None:
        self.engine.close(timeout)


def draft_of(loaded: LoadedModel, speculative: Speculation | None) -> tuple[Any, str | None]:
    """The draft model of ``spec.speculative.method: draft`` (``drafting.py``), on the device of the model's
    first layers at its dtype, or why it could not be loaded: the model then serves without speculation, and
    the status shows the error (``speculative.error``)."""
    if speculative is None or speculative.method != "draft":
        return None, None
    from .devices import input_device
    from .drafting import load_draft

    try:
        draft = load_draft(checkpoint=loaded.source, path=speculative.draft_path,
                           quantized=speculative.draft_quantized, dtype=loaded.model.dtype,
                           device=input_device(loaded.model))
    except Exception as exc:  # a draft is an optimisation: the model serves without it
        where = speculative.draft_path or f"{loaded.source} quantized {speculative.draft_quantized}"
        error = f"the draft model ({where}) failed to load: {str(exc).strip().splitlines()[0] if str(exc) else repr(exc)}"
        log.warning("%s; serving without speculative decoding", error)
        return None, error
    return draft, None


class EmbeddingRuntime:
    """A feature-extraction model: one worker thread runs each request's batch."""

    kind = "embedding"

    def __init__(self, loaded: LoadedModel, limits: Limits) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.limits = limits
        self.context_length = context_length(loaded.model.config, limits)
        self.pooling: Pooling = pooling_of(loaded.source)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deploykit-embed")

    def submit(self, texts: list[str]) -> Future[tuple[list[list[float]], int]]:
        if self.tokenizer is None:
            raise RequestError("this model ships no tokenizer: it cannot embed text", code="no_tokenizer")
        return self._worker.submit(_embed_apart, self.loaded.model, self.tokenizer, texts, pooling=self.pooling,
                                   max_length=self.context_length, device=self.loaded.input_device)

    def close(self, timeout: float | None = 30.0) -> None:
        self._worker.shutdown(wait=True)


Runtime = TextRuntime | EmbeddingRuntime


def build_runtime(loaded: LoadedModel, limits: Limits, *, task: str, kv_cache_bytes: int,
                  forward_lock: threading.Lock | None, adapters: Sequence[AdapterSource] = (),
                  speculative: Speculation | None = None) -> Runtime | None:
    """The runtime for ``task``; None when the model cannot serve requests (no tokenizer, or a task
    the API does not offer): ``acquire()`` still works."""
    if loaded.tokenizer is None:
        log.info("%s ships no tokenizer: the inference API will not serve it", loaded.source)
        return None
    if task == Task.CAUSAL_LM:
        return TextRuntime.in_process(loaded, limits, kv_cache_bytes=kv_cache_bytes, forward_lock=forward_lock,
                                      adapters=adapters, speculative=speculative)
    if task == Task.FEATURE_EXTRACTION:
        return EmbeddingRuntime(loaded, limits)
    return None


def _embed_apart(*args: Any, **kwargs: Any) -> tuple[list[list[float]], int]:
    """``embed``, then the worker's OpenMP threads handed back: an idle embedding model must not slow
    the other engines of the process (``deploykit.threads.release_openmp_threads``)."""
    try:
        return embed(*args, **kwargs)
    finally:
        release_openmp_threads()
