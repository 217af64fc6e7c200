"""The ``"continuous"`` backend of the batching engine: transformers' ``ContinuousBatchingManager``
(paged KV cache), sized explicitly from ``kv_cache_bytes``, on the CPU at most ``CB_CACHE_BYTES`` (its default
takes ~60% of host RAM), by transformers' own footprint arithmetic (``paged_cache``), and started with one token before it serves; a request longer than its cache is
refused at submit (it would end the manager's thread). Plain greedy only: transformers reads
``do_sample`` and the seed once per manager (why deploykit's own loop is the default: ``padded.py``).

The manager runs its own thread; the engine's worker thread here only routes the manager's shared output
queue to the requests' handles.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .admission import FinishReason, QueueFull, stop_reason
from .paged_cache import PagedCacheSize, paged_cache_size
from .requests import RequestHandle

CB_CACHE_BYTES = 1 << 30  # the continuous backend's paged cache is allocated up front: at most this much
# the first transformers whose paged-cache memory arithmetic ``paged_cache`` sizes the cache with (older
# versions lay the cache out differently: the padded loop serves them, ``make test-lowest`` runs it on 5.17)
CONTINUOUS_TRANSFORMERS = (5, 24)


def continuous_refusal(version: str) -> str | None:
    """Why transformers ``version`` cannot run the continuous backend, or None when it can."""
    from packaging.version import Version

    if Version(version).release[:2] >= CONTINUOUS_TRANSFORMERS:
        return None
    needed = ".".join(map(str, CONTINUOUS_TRANSFORMERS))
    return (f"spec.serving.batching: continuous needs transformers {needed} or later (its paged cache is sized "
            f"by that version's memory arithmetic); transformers {version} is installed: upgrade it, or use "
            f"batching: padded")


class ContinuousBackend:
    """A started manager over one model: ``run`` is the engine's worker thread, the rest is safe from any
    thread. Starting it answers one token first, so a manager that cannot serve fails here."""

    def __init__(self, model: Any, tokenizer: Any, closing: threading.Event, *, eos_ids: set[int],
                 max_batch_size: int, max_queued: int, kv_cache_bytes: int, context_length: int,
                 page_size: int) -> None:
        import transformers

        refusal = continuous_refusal(transformers.__version__)
        if refusal is not None:
            raise ValueError(refusal)
        self.tokenizer, self.eos_ids, self._closing = tokenizer, eos_ids, closing
        self.max_batch_size, self.max_queued = max_batch_size, max_queued
        self.manager, self.cache_tokens = _start_manager(
            model, eos_ids=eos_ids, max_batch_size=max_batch_size, max_queued=max_queued,
            kv_cache_bytes=kv_cache_bytes, context_length=context_length, page_size=page_size)
        self._handles: dict[str, RequestHandle] = {}  # request id -> handle

    def submit(self, h: RequestHandle) -> RequestHandle:
        r = h.request
        if r.temperature > 0 or not r.is_plain() or r.max_new_tokens < 1:
            raise ValueError("the continuous backend is greedy-only (no logprobs, penalties, logit_bias or "
                             "max_tokens 0); use backend='padded' (spec.serving.batching) for these")
        if len(r.prompt_ids) + r.max_new_tokens > self.cache_tokens:  # transformers' thread would die of it
            raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) + max_tokens ({r.max_new_tokens}) exceeds the "
                             f"{self.cache_tokens} tokens the continuous backend's cache holds; ask for fewer "
                             f"tokens or use batching: padded")
        if len(self._handles) >= self.max_queued + self.max_batch_size:
            raise QueueFull(f"{len(self._handles)} requests already running or waiting")
        eos = sorted(self.eos_ids | set(r.stop_token_ids))
        self._handles[h.id] = h  # before add_request: outputs may come back at once
        if self.manager.add_request(list(r.prompt_ids), request_id=h.id, max_new_tokens=r.max_new_tokens,
                                    streaming=True, eos_token_id=eos) is None:
            self._handles.pop(h.id, None)  # refused: manager stopping, or its thread died
            raise RuntimeError("continuous batching manager is not accepting requests")
        return h

    def cancel(self, handle: RequestHandle) -> None:
        self.manager.cancel_request(handle.id)  # the manager never emits a final output for a cancelled request
        self._handles.pop(handle.id, None)
        handle.finish("cancelled")

    def stats(self) -> dict[str, int]:
        held = len(self._handles)  # transformers keeps its own queue: count what it holds beyond a batch
        return {"running": min(held, self.max_batch_size), "waiting": max(0, held - self.max_batch_size)}

    def stop(self, timeout: float | None = None) -> None:
        self.manager.stop(block=True, timeout=timeout)  # also restores the attention implementation

    def run(self) -> None:
        """Route the manager's shared output queue to handles (a single reader: no requeue churn)."""
        while True:
            out = self.manager.get_result(timeout=0.1)
            if out is None or (h := self._handles.get(out.request_id)) is None:  # none, or cancelled
                if out is None and self._closing.is_set() and not self.manager.is_running():
                    break
                continue
            for tok in out.generated_tokens[len(h.tokens):]:  # outputs are cumulative
                h.push(tok)
                if reason := self._stop_hit(h, tok):  # EOS/length, or a stop string CB doesn't know
                    self.manager.cancel_request(h.id)  # frees the slot; a no-op if CB finished it already
                    h.finish(reason)
                    break
            if out.error is not None or out.is_finished():
                h.finish("error" if out.error else "length", out.error)
            if h.done:
                self._handles.pop(h.id, None)
        for h in list(self._handles.values()):  # the manager stopped under them
            h.finish("error", "engine closed")

    def _stop_hit(self, h: RequestHandle, tok: int) -> FinishReason | None:
        return stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer)


def _start_manager(model: Any, *, eos_ids: set[int], max_batch_size: int, max_queued: int, kv_cache_bytes: int,
                   context_length: int, page_size: int) -> tuple[Any, int]:
    """A started ContinuousBatchingManager and the tokens its cache holds (``cache_config``). The manager
    answers one token before the engine is used: a manager whose thread died while it started fails the
    load here instead of every request later."""
    from transformers import GenerationConfig

    gen = GenerationConfig(  # type: ignore[no-untyped-call,unused-ignore]  # do_sample is CB-wide; unset=True!
        do_sample=False, max_new_tokens=64, eos_token_id=sorted(eos_ids) or -1)
    budget = kv_cache_bytes if model.device.type == "cuda" else min(kv_cache_bytes, CB_CACHE_BYTES)
    cfg, size = cache_config(model, page_size=page_size, max_batch_size=max_batch_size, max_queued=max_queued,
                             budget=budget, context_length=context_length)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
    manager.start()
    try:
        _answers_once(manager)
    except BaseException:
        manager.stop(block=True, timeout=30)
        raise
    return manager, size.tokens


def cache_config(model: Any, *, page_size: int, max_batch_size: int, max_queued: int, budget: int,
                 context_length: int) -> tuple[Any, PagedCacheSize]:
    """The manager's ContinuousBatchingConfig, its paged cache sized explicitly (its default takes 60% of host
    RAM on CPU). The cache is allocated up front from ``budget``: on the CPU at most CB_CACHE_BYTES of what the
    tier has left (often most of the host), on a GPU what the tier has left. Within that, ``paged_cache``
    sizes it by transformers' own footprint arithmetic, for at most ``max_batch_size`` requests of
    ``context_length`` tokens. What the footprint depends on is set here, not resolved later."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.initialization import resolve_max_memory_percent

    cfg = ContinuousBatchingConfig(
        max_batch_tokens=512, max_requests_per_batch=max_batch_size, max_queue_size=max_queued,
        max_blocks_per_request=0, use_async_batching=False, allow_block_sharing=False,
        **_versioned(ContinuousBatchingConfig, page_size))
    import inspect

    # ``device`` (which warns when left out) came after 5.17, the lowest version (``make test-lowest``)
    where = {"device": model.device} if "device" in inspect.signature(resolve_max_memory_percent).parameters else {}
    resolve_max_memory_percent(cfg, has_logit_processors=False, **where)
    size = paged_cache_size(model, cfg, budget=budget, max_tokens=max_batch_size * context_length)
    cfg.num_blocks = size.num_blocks
    return cfg, size


def _versioned(config_class: Any, page_size: int) -> dict[str, Any]:
    """The arguments whose names changed across the transformers versions deploykit supports: the page
    size is ``block_size`` in 5.17 (the lowest, ``make test-lowest``), ``page_size`` in later versions;
    ``auto_switch_to_flash`` (turned off: the plan chose the attention) exists only in the versions that
    switch on their own."""
    import inspect

    known = inspect.signature(config_class).parameters
    named = {"page_size" if "page_size" in known else "block_size": page_size}
    return {**named, **({"auto_switch_to_flash": False} if "auto_switch_to_flash" in known else {})}


def _answers_once(manager: Any, timeout: float = 300.0) -> None:
    """One token through a started manager, or RuntimeError with why it cannot serve."""
    manager.add_request([0], request_id="deploykit-start-check", max_new_tokens=1, streaming=False)
    deadline, out = time.monotonic() + timeout, None
    while out is None and manager.background_thread_status.fatal_error is None and time.monotonic() < deadline:
        out = manager.get_result(request_id="deploykit-start-check", timeout=0.5)
        if out is None and not manager.is_running():
            break
    fatal = manager.background_thread_status.fatal_error
    if fatal is not None or out is None or out.error is not None:
        why = fatal or (out.error if out is not None else f"no answer in {timeout:.0f} s")
        raise RuntimeError(f"transformers' continuous batching did not start: {why}")
