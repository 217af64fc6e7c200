"""The batching engine of one loaded causal LM: many concurrent requests decoded together.

Two backends, one interface (``submit`` -> ``RequestHandle``, ``cancel``, ``close``, ``stats``):

- ``"padded"`` (default): deploykit's own decode loop on one worker thread. Waiting requests join the
  running batch at step boundaries (left-padded prefill, then their KV cache is appended to the
  batch's; it grows in place, ``kvcache.py``), finished or cancelled rows leave it at once and free
  their cache, and every request chooses its tokens on its own (``sampling.py``: greedy, temperature,
  top_p, a private seeded ``torch.Generator``, penalties, logit_bias, logprobs; one argmax for all the
  plain greedy rows). A request that fails its prefill or its sampling fails alone; a failing decode
  step fails the rows decoded together, never the engine.
- ``"continuous"``: transformers' ``ContinuousBatchingManager`` (paged KV cache), sized explicitly
  from ``kv_cache_bytes``, at most ``CB_CACHE_BYTES`` (its default takes ~60% of host RAM), and started
  with one token before it serves. Plain greedy only.

Why deploykit has its own loop at all: in transformers 5.23 continuous batching reads ``do_sample``
and the seed once per manager, so greedy and sampled requests (or two seeds) cannot share one, which an
OpenAI-compatible server must allow; and on this CPU it is slower (SmolLM2-135M fp32 through
``deploykit serve``, 16 streaming clients, 64 new tokens each, 2 cores: 160.7 tok/s against 188.9-195.6 for
the padded loop and 152-155 for ``transformers serve``; docs/benchmarks.md). Greedy outputs of both equal ``generate`` token for token (tests).
Limits of the padded loop: it pads to the longest prompt, a long new prompt stalls the batch for one
step (no chunked prefill), and it needs a full-attention cache (no sliding window).

Model work never runs on the caller's thread: ``submit`` only queues. A ``listener`` given to
``submit`` receives each new token id and then the final ``GenerationResult``, from the engine's
thread (an asyncio server forwards them with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .admission import Admission, FinishReason, QueueFull, stop_reason
from .kvcache import growing_cache
from .sampling import TokenLogprobs, is_plain_greedy, next_token, prompt_logprobs, request_generator

__all__ = ["Engine", "FinishReason", "GenerationRequest", "GenerationResult", "QueueFull", "RequestHandle",
           "TokenLogprobs"]
_FINISH_LOCK = threading.Lock()
CB_CACHE_BYTES = 1 << 30  # the continuous backend's paged cache is allocated up front: at most this much


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 => greedy
    top_p: float = 1.0
    seed: int | None = None  # None => random
    stop_token_ids: Sequence[int] = ()  # in addition to the model's EOS ids
    stop_strings: Sequence[str] = ()
    logprobs: int | None = None  # None: none; k: each generated token's logprob and the k most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    presence_penalty: float = 0.0  # OpenAI's penalties over the tokens generated so far (sampling.py)
    frequency_penalty: float = 0.0
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias added to its logit)

    def is_plain(self) -> bool:
        """Nothing beyond greedy / temperature / top_p: what every backend can serve."""
        return (self.logprobs is None and self.prompt_logprobs is None and not self.presence_penalty
                and not self.frequency_penalty and not self.logit_bias)


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]  # every generated token, the stop token included
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float | None  # seconds since submit
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for them
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt token after the first


@dataclass(eq=False)
class RequestHandle:
    """Yields new token ids as they are produced, then ends with a :class:`GenerationResult`."""

    request: GenerationRequest
    id: str
    rng: torch.Generator | None = None  # private sampling RNG (padded backend)
    submitted: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)  # written by the engine thread only
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token when requested
    prompt_logprobs: list[TokenLogprobs] | None = None  # set before the first token is pushed
    done: bool = False  # set (under _FINISH_LOCK) just before the final result
    finished: threading.Event = field(default_factory=threading.Event)
    listener: Callable[[int | GenerationResult], None] | None = None  # called from the engine's thread
    _final: GenerationResult | None = None
    _q: queue.Queue[int | GenerationResult] = field(default_factory=queue.Queue)

    # push and finish are the engine side of a handle (deploykit's engines call them; callers read).
    def push(self, tok: int, logprobs: TokenLogprobs | None = None) -> None:
        self.first_token_at = self.first_token_at or time.monotonic()
        if logprobs is not None:  # before the listener hears of the token: it may read them at once
            self.logprobs.append(logprobs)
        self.tokens.append(tok)
        self._q.put(tok)
        if self.listener is not None:
            self.listener(tok)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        with _FINISH_LOCK:  # the first final wins (client cancel vs. engine end race)
            if self.done:
                return
            self.done = True
        ttft = None if self.first_token_at is None else self.first_token_at - self.submitted
        n, m = len(self.request.prompt_ids), len(self.tokens)
        lps = list(self.logprobs) if self.request.logprobs is not None else None
        self._final = GenerationResult(list(self.tokens), reason, n, m, ttft, error, lps, self.prompt_logprobs)
        self.finished.set()
        self._q.put(self._final)
        if self.listener is not None:
            self.listener(self._final)

    def __iter__(self) -> Iterator[int]:
        """Blocking iteration over new token ids (asyncio: ``iterate_in_threadpool(handle)``)."""
        while not isinstance(item := self._q.get(), GenerationResult):
            yield item

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self.finished.wait(timeout) or self._final is None:
            raise TimeoutError(f"request {self.id} still running")
        return self._final


class Engine:
    """One engine per loaded model generation.  Every public method is safe from any thread."""

    def __init__(self, model: Any, tokenizer: Any, *, backend: Literal["padded", "continuous"] = "padded",
                 max_batch_size: int = 16, max_queued: int = 64, kv_cache_bytes: int = 256 << 20,
                 forward_lock: threading.Lock | None = None, cb_page_size: int = 64) -> None:
        if forward_lock is not None:
            backend = "padded"  # offload hooks: deploykit's loop takes the lock around each forward
        self.model, self.tokenizer, self.backend = model.eval(), tokenizer, backend
        self._forward_lock: AbstractContextManager[Any] = forward_lock or nullcontext()
        self.max_batch_size, self.max_queued, self.kv_cache_bytes = max_batch_size, max_queued, kv_cache_bytes
        eos = model.generation_config.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize  # K+V
        self._queue = Admission(max_queued=max_queued)  # padded backend: the waiting requests
        self._closing = self._queue.closing
        self._cb: Any = self._start_cb(cb_page_size) if backend == "continuous" else None
        self._cb_handles: dict[str, RequestHandle] = {}  # cb backend: request id -> handle
        target = self._cb_dispatch if backend == "continuous" else self._loop  # the one engine thread
        self._thread = threading.Thread(target=target, name=f"deploykit-engine-{backend}", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest,
               listener: Callable[[int | GenerationResult], None] | None = None) -> RequestHandle:
        """Queue ``request``; QueueFull when ``max_queued`` already wait. ``listener`` gets every token
        id, then the result."""
        h = RequestHandle(request, self._queue.check(request), rng=request_generator(request), listener=listener)
        if self._cb is not None:
            return self._cb_submit(h)
        # requests that a free batch slot takes at the next step are not queued: count only the rest
        self._queue.put(h, free_slots=max(0, self.max_batch_size - self._queue.running))
        return h

    def cancel(self, handle: RequestHandle) -> None:
        """Free the request's slot; its handle ends at once with finish_reason 'cancelled'."""
        if self._cb is not None:  # CB never emits a final output for a cancelled request
            self._cb.cancel_request(handle.id)
            self._cb_handles.pop(handle.id, None)
        handle.finish("cancelled")  # the padded backend drops the row at its next step

    def stats(self) -> dict[str, int]:
        """Requests being decoded and waiting for a slot, now."""
        if self._cb is not None:  # transformers keeps its own queue: count what it holds beyond a batch
            held = len(self._cb_handles)
            return {"running": min(held, self.max_batch_size), "waiting": max(0, held - self.max_batch_size)}
        return self._queue.stats()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests, let in-flight and waiting ones finish, stop the worker."""
        self._queue.close()
        if self._cb is not None:
            self._cb.stop(block=True, timeout=timeout)  # also restores the attention implementation
        self._thread.join(timeout)

    def _stop_hit(self, h: RequestHandle, tok: int) -> FinishReason | None:
        return stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer)

    @torch.inference_mode()
    def _loop(self) -> None:
        """The padded backend's worker thread: batch row i is rows[i]; mask is [rows, cached tokens]."""
        rows: list[RequestHandle] = []
        cache: Any = None
        mask = torch.zeros(0, 0, dtype=torch.long)  # 0 = left padding
        while True:
            rows, cache, mask = _drop_done(rows, cache, mask)
            new = self._admit(rows, mask.shape[1])
            self._queue.running = len(rows) + len(new)
            if not rows and not new:
                if not self._queue.wait_for_work(0.5):  # idle: sleep until a submit or close
                    return
                continue
            new = self._start(new)
            try:
                if new:  # join step: only the new rows get a token (old rows advance next step)
                    logits, cache, mask, new = self._join(new, cache, mask)
                    step_rows, rows = new, rows + new
                elif rows:
                    mask = F.pad(mask, (0, 1), value=1)
                    with self._forward_lock:
                        out = self.model(input_ids=torch.tensor([[h.tokens[-1]] for h in rows]),
                                         attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                                         past_key_values=cache, use_cache=True, logits_to_keep=1)
                    logits, cache, step_rows = out.logits[:, -1].float(), out.past_key_values, rows
                else:
                    continue
            except Exception as exc:  # a failed decode step fails the rows decoded together, not the engine
                for h in rows:
                    h.finish("error", repr(exc))
                rows, cache, mask = [], None, mask[:0, :0]
                continue
            self._choose(step_rows, logits)

    def _start(self, new: list[RequestHandle]) -> list[RequestHandle]:
        """Answer what needs no decoding (prompt logprobs, ``max_new_tokens`` 0); the rest will decode."""
        keep = []
        for h in new:
            try:
                if h.request.prompt_logprobs is not None:
                    h.prompt_logprobs = self._prompt_logprobs(h.request)
                if h.request.max_new_tokens == 0:
                    h.finish("length")
                else:
                    keep.append(h)
            except Exception as exc:  # this request fails, the batch goes on
                h.finish("error", repr(exc))
        return keep

    def _prompt_logprobs(self, r: GenerationRequest) -> list[TokenLogprobs]:
        """A forward of the whole prompt alone, keeping every position's logits (the batch keeps one)."""
        ids = torch.tensor([list(r.prompt_ids)])
        with self._forward_lock:
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
        return prompt_logprobs(logits, r.prompt_ids, r.prompt_logprobs or 0)

    def _join(self, new: list[RequestHandle], cache: Any, mask: torch.Tensor
              ) -> tuple[torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
        """Prefill ``new`` into the batch; when that fails, each one alone, so that a request the model
        cannot run fails alone (the running rows' cache is only touched once a prefill succeeded)."""
        try:
            return (*self._prefill_and_merge(new, cache, mask), new)
        except Exception as exc:
            if len(new) == 1:
                new[0].finish("error", repr(exc))
                return None, cache, mask, []
        parts, joined = [], []
        for h in new:
            try:
                logits, cache, mask = self._prefill_and_merge([h], cache, mask)
            except Exception as exc:
                h.finish("error", repr(exc))
                continue
            parts.append(logits)
            joined.append(h)
        return (torch.cat(parts) if parts else None), cache, mask, joined

    def _choose(self, rows: list[RequestHandle], logits: torch.Tensor | None) -> None:
        """Each row's next token (one argmax for all plain greedy rows); a row that fails here fails alone."""
        if logits is None:
            return
        greedy = logits.argmax(-1).tolist() if any(is_plain_greedy(h.request) for h in rows) else []
        for i, h in enumerate(rows):
            if h.done:
                continue
            try:
                if greedy and is_plain_greedy(h.request):
                    tok, lp = greedy[i], None
                else:
                    tok, lp = next_token(logits[i], h.request, h.tokens, h.rng)
                h.push(tok, lp)
                if reason := self._stop_hit(h, tok):
                    h.finish(reason)
            except Exception as exc:
                h.finish("error", repr(exc))

    def _admit(self, rows: list[RequestHandle], width: int) -> list[RequestHandle]:
        """Pop waiting requests (FIFO) that fit the batch-size and KV-byte budgets."""
        def size(h: RequestHandle) -> int:
            return len(h.request.prompt_ids) + h.request.max_new_tokens

        def fits(taken: list[RequestHandle], h: RequestHandle) -> bool:
            need = [size(r) for r in rows + taken]
            worst = (len(need) + 1) * (width + max(need + [size(h)]))  # padded cache if all rows run to the end
            return not need or worst * self.kv_bytes_per_token <= self.kv_cache_bytes  # else wait for rows to end

        return self._queue.take(self.max_batch_size - len(rows), fits)

    def _prefill_and_merge(self, new: list[RequestHandle], cache: Any, mask: torch.Tensor
                           ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Prefill ``new`` as a left-padded batch, then append its KV cache to the running one."""
        t = max(len(h.request.prompt_ids) for h in new)
        ids = torch.stack([_lpad(torch.tensor(list(h.request.prompt_ids)), t, 0) for h in new])
        nmask = torch.stack([_lpad(torch.ones(len(h.request.prompt_ids), dtype=torch.long), t, 0) for h in new])
        pos = (nmask.cumsum(1) - 1).clamp(min=0)
        with self._forward_lock:
            out = self.model(input_ids=ids, attention_mask=nmask, position_ids=pos, use_cache=True,
                             past_key_values=growing_cache(self.model.config), logits_to_keep=1)
        if cache is None:
            return out.logits[:, -1].float(), out.past_key_values, nmask
        width = max(mask.shape[1], t)  # RoPE is already applied to cached keys: padding is safe
        for old, add in zip(cache.layers, out.past_key_values.layers):
            old.keys = torch.cat([_lpad(old.keys, width, 2), _lpad(add.keys, width, 2)])
            old.values = torch.cat([_lpad(old.values, width, 2), _lpad(add.values, width, 2)])
        return out.logits[:, -1].float(), cache, torch.cat([_lpad(mask, width), _lpad(nmask, width)])

    def _start_cb(self, page_size: int) -> Any:
        """The continuous backend: a started ContinuousBatchingManager, sized explicitly (its default takes 60% of host
        RAM on CPU). Its paged cache is allocated up front, so it takes at most CB_CACHE_BYTES of ``kv_cache_bytes``
        (what the device tier has left, often most of the host), capped so sdpa's [M, N + M] paged mask stays under 1/4
        of that. The manager answers one token before the engine is used: a manager whose thread died while it
        started (its cache did not fit) fails the load here instead of every request later."""
        from transformers import ContinuousBatchingConfig, GenerationConfig
        m, budget = 512, min(self.kv_cache_bytes, CB_CACHE_BYTES)
        tokens = min(budget // self.kv_bytes_per_token, budget // 4 // (m * self.model.dtype.itemsize) - m)
        gen = GenerationConfig(  # type: ignore[no-untyped-call,unused-ignore]  # do_sample is CB-wide; unset=True!
            do_sample=False, max_new_tokens=64, eos_token_id=sorted(self.eos_ids) or -1)
        cfg = ContinuousBatchingConfig(
            page_size=page_size, num_blocks=max(2, tokens // page_size), max_batch_tokens=m,
            max_requests_per_batch=self.max_batch_size, max_queue_size=self.max_queued,
            allow_block_sharing=False, auto_switch_to_flash=False)
        manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cfg)
        manager.start()
        try:
            _cb_answers_once(manager)
        except BaseException:
            manager.stop(block=True, timeout=30)
            raise
        return manager

    def _cb_submit(self, h: RequestHandle) -> RequestHandle:
        r = h.request
        if r.temperature > 0 or not r.is_plain() or r.max_new_tokens < 1:
            raise ValueError("the continuous backend is greedy-only (no logprobs, penalties, logit_bias or "
                             "max_tokens 0); use backend='padded' (spec.serving.batching) for these")
        if len(self._cb_handles) >= self.max_queued + self.max_batch_size:
            raise QueueFull(f"{len(self._cb_handles)} requests already running or waiting")
        eos = sorted(self.eos_ids | set(r.stop_token_ids))
        self._cb_handles[h.id] = h  # before add_request: outputs may come back at once
        if self._cb.add_request(list(r.prompt_ids), request_id=h.id, max_new_tokens=r.max_new_tokens,
                                streaming=True, eos_token_id=eos) is None:
            self._cb_handles.pop(h.id, None)  # refused: manager stopping, or its thread died
            raise RuntimeError("continuous batching manager is not accepting requests")
        return h

    def _cb_dispatch(self) -> None:
        """Route the manager's shared output queue to handles (a single reader: no requeue churn)."""
        while True:
            out = self._cb.get_result(timeout=0.1)
            if out is None or (h := self._cb_handles.get(out.request_id)) is None:  # none, or cancelled
                if out is None and self._closing.is_set() and not self._cb.is_running():
                    break
                continue
            for tok in out.generated_tokens[len(h.tokens):]:  # outputs are cumulative
                h.push(tok)
                if reason := self._stop_hit(h, tok):  # EOS/length, or a stop string CB doesn't know
                    self._cb.cancel_request(h.id)  # frees the slot; a no-op if CB finished it already
                    h.finish(reason)
                    break
            if out.error is not None or out.is_finished():
                h.finish("error" if out.error else "length", out.error)
            if h.done:
                self._cb_handles.pop(h.id, None)
        for h in list(self._cb_handles.values()):  # the manager stopped under them
            h.finish("error", "engine closed")


def _cb_answers_once(manager: Any, timeout: float = 300.0) -> None:
    """One token through a started manager, or RuntimeError with why it cannot serve."""
    manager.add_request([0], request_id="deploykit-start-check", max_new_tokens=1, streaming=False)
    deadline, out = time.monotonic() + timeout, None
    while out is None and manager.background_thread_status.fatal_error is None and time.monotonic() < deadline:
        out = manager.get_result(request_id="deploykit-start-check", timeout=0.5)
    fatal = manager.background_thread_status.fatal_error
    if fatal is not None or out is None or out.error is not None:
        why = fatal or (out.error if out is not None else f"no answer in {timeout:.0f} s")
        raise RuntimeError(f"transformers' continuous batching did not start: {why}")


def _drop_done(rows: list[RequestHandle], cache: Any, mask: torch.Tensor
               ) -> tuple[list[RequestHandle], Any, torch.Tensor]:
    """The batch without its finished or cancelled rows, their KV cache freed."""
    keep = [i for i, h in enumerate(rows) if not h.done]
    if len(keep) == len(rows):
        return rows, cache, mask
    idx, rows = torch.tensor(keep, dtype=torch.long), [rows[i] for i in keep]
    lead = int((mask[idx].sum(0) == 0).long().cumprod(0).sum())  # now all-pad columns
    mask, cache = mask[idx, lead:], cache if rows else None
    for layer in cache.layers if rows else []:
        layer.keys, layer.values = layer.keys[idx, :, lead:], layer.values[idx, :, lead:]
    return rows, cache, mask


def _lpad(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """Left-pad ``x`` with zeros along ``dim`` up to ``width``."""
    return F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (width - x.shape[dim], 0))
