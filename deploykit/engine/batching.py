"""The batching engine of one loaded causal LM: many concurrent requests decoded together.

Two backends, one interface (``submit`` -> ``RequestHandle``, ``cancel``, ``close``, ``stats``):

- ``"padded"`` (default, ``padded.py``): deploykit's own decode loop on one worker thread; waiting
  requests join the running batch at step boundaries, finished or cancelled rows leave it at once, and
  every request chooses its tokens on its own (why deploykit has its own loop, its measured figures and
  its limits are there).
- ``"continuous"`` (``continuous.py``): transformers' ``ContinuousBatchingManager`` (paged KV cache),
  sized explicitly from ``kv_cache_bytes`` and started with one token before it serves. Plain greedy only:
  no grammar either (``grammars`` is None there, and the API refuses ``response_format``/``tools``).

Greedy outputs of both equal ``generate`` token for token (tests).

Model work never runs on the caller's thread: ``submit`` only queues. A ``listener`` given to
``submit`` receives each new token id and then the final ``GenerationResult``, from the engine's
thread (an asyncio server forwards them with ``call_soon_threadsafe``).

The request types (``requests.py``) are re-exported here with the engine that serves them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, Protocol

from .adapters import Adapters, UnknownAdapter
from .admission import Admission, FinishReason, QueueFull
from .types import Limits, Speculation, context_length as context_of, eos_set
from .continuous import ContinuousBackend
from .grammar import Grammars
from .padded import PaddedBackend
from .requests import GenerationRequest, GenerationResult, RequestHandle
from .sampling import TokenLogprobs, request_generator

__all__ = ["Engine", "FinishReason", "GenerationRequest", "GenerationResult", "QueueFull", "RequestHandle",
           "TokenLogprobs"]


class Backend(Protocol):
    """What the engine delegates to: ``run`` is its one worker thread."""

    def submit(self, h: RequestHandle) -> RequestHandle: ...

    def cancel(self, handle: RequestHandle) -> None: ...

    def stats(self) -> dict[str, int]: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def run(self) -> None: ...


class Engine:
    """One engine per loaded model generation.  Every public method is safe from any thread."""

    def __init__(self, model: Any, tokenizer: Any, *, backend: Literal["padded", "continuous"] = "padded",
                 max_batch_size: int = 16, max_queued: int = 64, kv_cache_bytes: int = 256 << 20,
                 forward_lock: threading.Lock | None = None, cb_page_size: int = 64, prefix_cache_bytes: int = 0,
                 prefill_chunk: int = 256, context_length: int | None = None,
                 adapters: Adapters | None = None, speculative: Speculation | None = None, draft_model: Any = None,
                 speculative_error: str | None = None) -> None:
        if forward_lock is not None:
            backend = "padded"  # offload hooks: deploykit's loop takes the lock around each forward
        self.model, self.tokenizer, self.backend = model.eval(), tokenizer, backend
        self.max_batch_size, self.max_queued, self.kv_cache_bytes = max_batch_size, max_queued, kv_cache_bytes
        self.eos_ids: set[int] = _eos_ids(model)
        self.kv_bytes_per_token = _kv_bytes_per_token(model)
        self.prefix_cache_bytes, self.prefill_chunk = prefix_cache_bytes, prefill_chunk
        self.context_length = context_length or context_of(model.config, Limits())  # the longest request
        self.adapters = adapters  # LoRA adapters: the padded loop computes each row with its own
        self.speculative = speculative  # spec.speculative: drafts verified by the padded loop (speculative.py)
        self.draft_model = draft_model  # method draft: the model that drafts (drafting.py)
        # why the engine does not speculate as spec.speculative asks (a draft model that failed to load)
        self.speculative_error = speculative_error
        if speculative is not None and speculative.method == "draft" and draft_model is None:
            self.speculative_error = speculative_error or "method draft without a draft model"
        if speculative is not None and backend == "continuous":
            raise ValueError("spec.speculative: transformers' continuous batching has no speculative decoding; "
                             "use spec.serving.batching: padded")
        self._queue = Admission(max_queued=max_queued)  # request ids and closing; padded: the waiting requests
        self._batcher: Backend = self._start_backend(backend, forward_lock, cb_page_size)
        self.grammars = None if backend == "continuous" else grammars_for(model, tokenizer, self.eos_ids)
        self._thread = threading.Thread(target=self._batcher.run, name=f"deploykit-engine-{backend}", daemon=True)
        self._thread.start()

    def _start_backend(self, backend: str, forward_lock: threading.Lock | None, cb_page_size: int) -> Backend:
        if backend == "continuous":
            return ContinuousBackend(self.model, self.tokenizer, self._queue.closing, eos_ids=self.eos_ids,
                                     max_batch_size=self.max_batch_size, max_queued=self.max_queued,
                                     kv_cache_bytes=self.kv_cache_bytes, context_length=self.context_length,
                                     page_size=cb_page_size)
        return PaddedBackend(self.model, self.tokenizer, self._queue, eos_ids=self.eos_ids,
                             max_batch_size=self.max_batch_size, kv_cache_bytes=self.kv_cache_bytes,
                             kv_bytes_per_token=self.kv_bytes_per_token, forward_lock=forward_lock,
                             prefix_cache_bytes=self.prefix_cache_bytes, prefill_chunk=self.prefill_chunk,
                             adapters=self.adapters, draft_model=self.draft_model,
                             speculative=self.speculative if self.speculative_error is None else None)

    def resize_kv_cache(self, kv_cache_bytes: int) -> bool:
        """Admit new requests against ``kv_cache_bytes`` from now (the plan's KV room changed: a live adapter
        change). False where the cache cannot change size (continuous batching's paged cache is allocated
        once: it keeps its size until the next generation)."""
        resize = getattr(self._batcher, "resize_kv", None)
        if resize is None:
            return False
        resize(kv_cache_bytes)
        self.kv_cache_bytes = kv_cache_bytes
        return True

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        """Queue ``request``; QueueFull when ``max_queued`` already wait. ``listener`` gets every token
        id, then the result."""
        grammar = None
        if request.grammar is not None:
            if self.grammars is None:
                raise ValueError("the continuous batching backend does not enforce response_format or tools; "
                                 "use spec.serving.batching: padded")
            grammar = self.grammars.matcher(request.grammar)
        check = self._queue.check(request)
        request, on_finish = self._hold_adapter(request)
        h = RequestHandle(request, check, rng=request_generator(request), listener=listener,
                          grammar=grammar, on_finish=on_finish)
        try:
            return self._batcher.submit(h)
        except BaseException:
            if h.on_finish is not None:
                h.on_finish()
            raise

    def _hold_adapter(self, request: GenerationRequest) -> tuple[GenerationRequest, Callable[[], None] | None]:
        """Count the request on its adapter's current version until it ends, and the request computing with
        that version (its slot) throughout; UnknownAdapter when it is not loaded, or where the backend cannot
        compute rows with adapters (continuous)."""
        name = request.adapter
        if name is None:
            return request, None
        if self.adapters is None or self.backend == "continuous":
            raise UnknownAdapter(name)
        adapters = self.adapters
        slot = adapters.hold(name)
        return replace(request, adapter=slot), lambda: adapters.release(slot)

    def cancel(self, handle: RequestHandle) -> None:
        """Free the request's slot; its handle ends at once with finish_reason 'cancelled'."""
        self._batcher.cancel(handle)

    def stats(self) -> dict[str, int]:
        """Requests being decoded and waiting for a slot, now; the prefix cache's counters when it has one."""
        return self._batcher.stats()

    @property
    def mixed_steps(self) -> int:
        """Forwards that held the running rows' next tokens and a chunk of a prompt together (``mixed.py``)."""
        return int(getattr(self._batcher, "mixed_steps", 0))

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests, let in-flight and waiting ones finish, stop the worker."""
        self._queue.close()
        self._batcher.stop(timeout)
        self._thread.join(timeout)


def grammars_for(model: Any, tokenizer: Any, eos_ids: set[int]) -> Grammars:
    """The grammar compiler of a model's tokenizer, its masks as wide as the model's logits."""
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    return Grammars(tokenizer, vocab_size=vocab, stop_ids=sorted(eos_ids))


def _eos_ids(model: Any) -> set[int]:
    """What ``runtime.eos_ids_of`` reads for the other runtimes: transformers loaded it into
    ``generation_config`` (generation_config.json, else config.json)."""
    return eos_set(model.generation_config.eos_token_id)


def _kv_bytes_per_token(model: Any) -> int:
    """K and V of every layer for one cached token."""
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
