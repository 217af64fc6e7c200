"""The ``"padded"`` backend of the batching engine (the default): deploykit's own decode loop on one
worker thread.

Waiting requests join the running batch at step boundaries (left-padded prefill, then their KV cache is
appended to the batch's; it grows in place, ``kvcache.py``), finished or cancelled rows leave it at once
and free their cache, and every request chooses its tokens on its own (``sampling.py``: greedy,
temperature, top_p, a private seeded ``torch.Generator``, penalties, logit_bias, logprobs, a grammar's
mask; one argmax for all the plain greedy rows). A request that fails its prefill, a decode step or its sampling fails alone:
a failed step is run again for each row alone (only a failure pays for that); never the engine.

Why deploykit has its own loop at all: in transformers 5.23 continuous batching reads ``do_sample``
and the seed once per manager, so greedy and sampled requests (or two seeds) cannot share one, which an
OpenAI-compatible server must allow; and on this CPU it is slower (SmolLM2-135M fp32 through
``deploykit serve``, 16 streaming clients, 64 new tokens each, 2 cores: 160.7 tok/s against 188.9-195.6 for
the padded loop and 152-155 for ``transformers serve``; docs/benchmarks.md).
A new prompt whose beginning the prefix cache holds (``prefixcache.py``) reads that beginning from it
and computes only the rest. Prompts with more than ``prefill_chunk`` tokens left to compute are read
alone in chunks (``prefill.py``), each in the same forward as the running rows' next tokens (a mixed
step, ``mixed.py``; where a model or a row's adapter cannot be mixed, chunks and decode steps alternate):
running rows keep producing tokens meanwhile, and such a prompt joins the batch only once it is read. Limits of
the padded loop: rows pad to the longest row while they run together (the padding goes when it leaves),
short new prompts still join in one padded prefill step, and it serves full and sliding-window attention
(a windowed layer keeps every position, the model's mask applies the window: ``kvcache.growing_cache``),
not chunked or linear attention (refused when the engine starts).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from ..threads import release_openmp_threads
from .adapters import Adapters
from .admission import Admission, FinishReason, stop_reason
from .devices import input_device
from .kvcache import (
    all_pad_columns,
    growing_cache,
    keep_rows,
    merged,
    peak_positions,
    read_hits,
    returned_cache,
    truncate,
    with_cache,
)
from .mixed import Layout, mixable, mixed_attention
from .prefill import ChunkSizer, Prefill
from .prefixcache import Hit, PrefixCache
from .requests import GenerationRequest, RequestHandle
from .sampling import TokenLogprobs, is_plain_greedy, next_token, prompt_logprobs


class PaddedBackend:
    """The padded loop over one model: ``run`` is the engine's worker thread, the rest is safe from any
    thread. Batch row i is ``rows[i]``; ``mask`` is [rows, cached tokens], 0 for left padding."""

    def __init__(self, model: Any, tokenizer: Any, queue: Admission, *, eos_ids: set[int], max_batch_size: int,
                 kv_cache_bytes: int, kv_bytes_per_token: int, forward_lock: threading.Lock | None,
                 prefix_cache_bytes: int = 0, prefill_chunk: int = 256, adapters: Adapters | None = None) -> None:
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self.device = input_device(model)  # where ids, positions and masks are made
        self.adapters = adapters  # LoRA adapters of the model: each row computes with its own (adapters.py)
        self._queue = queue  # the waiting requests
        self._forward_lock: AbstractContextManager[Any] = forward_lock or nullcontext()
        self.max_batch_size, self.kv_cache_bytes = max_batch_size, kv_cache_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.prefill_chunk = prefill_chunk
        self._chunks = ChunkSizer(prefill_chunk)  # the chunk size while rows decode
        self._layers = len(growing_cache(model.config).layers)  # a model this loop cannot serve fails here
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.mixable = mixable(model)  # decode steps and prompt chunks share forwards (mixed.py)
        self.mixed_steps = 0  # forwards that held the rows' tokens and a prompt's chunk (read by any thread)
        self._hits: dict[str, Hit] = {}  # request id -> its cached beginning, from _route to its prefill

    def submit(self, h: RequestHandle) -> RequestHandle:
        # requests that a free batch slot takes at the next step are not queued: count only the rest
        self._queue.put(h, free_slots=max(0, self.max_batch_size - self._queue.running))
        return h

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # the loop drops the row at its next step

    def stats(self) -> dict[str, int]:
        return {**self._queue.stats(), **(self.prefix.stats() if self.prefix is not None else {})}

    def stop(self, timeout: float | None = None) -> None:
        """Nothing to stop: the loop returns once the closed queue is empty and its rows ended."""

    @torch.inference_mode()
    def run(self) -> None:
        """The worker thread: admit, then one unit of work per step: join short new prompts to the batch,
        or decode the running rows and read one chunk of a prompt prefilled alone in one forward (a mixed
        step), or either alone (chunks and decode steps alternate where they cannot be mixed), and choose
        the tokens of the rows that got logits."""
        rows: list[RequestHandle] = []
        cache: Any = None
        mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # 0 = left padding
        reading: list[Prefill] = []  # prompts prefilled alone, oldest first
        chunk_next = busy = True
        try:
            while True:
                rows, cache, mask = self._drop_done(rows, cache, mask)
                reading = [p for p in reading if not p.handle.done]
                new = self._admit(rows + [p.handle for p in reading], mask.shape[1])
                self._queue.running = len(rows) + len(reading) + len(new)
                if not rows and not new and not reading:
                    if busy:  # going idle: its OpenMP threads would slow other engines of the process
                        release_openmp_threads()
                        busy = False
                    if not self._queue.wait_for_work(0.5):  # idle: sleep until a submit or close
                        return
                    continue
                busy = True
                short, alone = self._route(self._start(new))
                reading += alone
                if short:  # join step: only the new rows get a token (old rows advance next step)
                    logits, cache, mask, short = self._join(short, cache, mask)
                    step_rows, rows = short, rows + short
                elif reading and rows and self._mixes(rows, reading[0]):  # one forward: rows' tokens and a chunk
                    rows, logits, cache, mask, step_rows = self._decode_and_read(rows, reading[0], cache, mask)
                    chunk_next = True  # unless mixed again: the chunk alone next (after a failed mixed forward)
                    if reading[0].handle.done or reading[0].handle in step_rows:
                        reading.pop(0)
                elif reading and (chunk_next or not rows):
                    logits, cache, mask, step_rows = self._read(reading[0], cache, mask, decoding=bool(rows))
                    rows, chunk_next = rows + step_rows, False
                    if reading[0].handle.done or step_rows:
                        reading.pop(0)
                elif rows:
                    started = time.perf_counter()
                    rows, logits, cache, mask = self._decode_rows(rows, cache, mask)
                    step_rows, chunk_next = rows, True
                    self._chunks.decoded(time.perf_counter() - started)  # what a chunk is sized against
                else:
                    continue
                self._choose(step_rows, logits)
        finally:
            if self.prefix is not None:  # the generation is going: its kept prefixes go with it
                self.prefix.clear()

    def _decode_rows(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                     ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor]:
        """A decode step of the running rows; when it fails, each row alone; the rows decoded together
        fail only when that fails too, never the engine."""
        try:
            return (rows, *self._decode(rows, cache, mask))
        except Exception:
            try:
                if len(rows) < 2:  # a lone row's failure is its own
                    raise
                return self._decode_apart(rows, cache, mask)
            except Exception as again:
                for h in rows:
                    h.finish("error", repr(again))
                return [], None, None, mask[:0, :0]

    def _mixes(self, rows: list[RequestHandle], p: Prefill) -> bool:
        """Whether the running rows and ``p``'s next chunk can share a forward (base weights only)."""
        return (self.mixable and p.mixes and p.handle.request.adapter is None
                and all(h.request.adapter is None for h in rows))

    def _decode_and_read(self, rows: list[RequestHandle], p: Prefill, cache: Any, mask: torch.Tensor
                         ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
        """A mixed step (``mixed.py``): the rows' next tokens and a chunk of ``p`` in one forward; once ``p``
        is read, its cache joins the batch's and its row gets logits too. When the forward fails, neither
        cache keeps any of it, and the step is a decode step alone (each row's failure its own), the chunk
        read alone at the next step (its own failure its own)."""
        width, read = mask.shape[1], p.done
        started = time.perf_counter()
        try:
            logits, chunk_logits, mask = self._mixed(rows, p, cache, mask)
        except Exception:
            truncate(cache, width)
            truncate(p.cache, read)
            p.done, p.mixes = read, False  # its next chunk is read alone: a prompt the model cannot run fails alone
            rows, decoded, cache, mask = self._decode_rows(rows, cache, mask)
            return rows, decoded, cache, mask, rows
        self.mixed_steps += 1
        if self._chunks.step_seconds is not None:  # what the chunk added to a decode step
            self._chunks.read(p.done - read, max(0.0, time.perf_counter() - started - self._chunks.step_seconds))
        if chunk_logits is None:
            return rows, logits, cache, mask, rows
        cache, mask = merged(cache, mask, p.cache, torch.ones(1, p.done, dtype=torch.long, device=self.device))
        return rows + [p.handle], torch.cat([logits, chunk_logits]), cache, mask, rows + [p.handle]

    def _mixed(self, rows: list[RequestHandle], p: Prefill, cache: Any, mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The mixed forward: the rows' logits, ``p``'s once its last token is read, and the rows' new mask."""
        mask = F.pad(mask, (0, 1), value=1)
        ids, positions, end = p.next_chunk(self._chunks.next(decoding=True), self.device)
        tokens = torch.tensor([[h.tokens[-1] for h in rows]], device=self.device)
        keep = torch.arange(len(rows) + (1 if end == len(p.prompt) else 0), device=self.device)
        if len(keep) > len(rows):  # the chunk's last token gives the prompt's first new one
            keep[-1] = len(rows) + ids.shape[1] - 1
        with self._forwarding(rows + [p.handle]), mixed_attention(self.model, Layout(len(rows), cache, mask, p.cache)):
            out = self.model(input_ids=torch.cat([tokens, ids], 1),
                             position_ids=torch.cat([mask.sum(1) - 1, positions])[None], use_cache=False,
                             logits_to_keep=keep)
        p.done = end
        logits = out.logits[0].float()
        return logits[:len(rows)], (logits[len(rows):] if len(keep) > len(rows) else None), mask

    def _route(self, new: list[RequestHandle]) -> tuple[list[RequestHandle], list[Prefill]]:
        """Which new requests join the batch in one padded prefill (what is left to compute of their prompt,
        after any cached beginning, fits one chunk), and which are read alone in chunks (``prefill.py``)."""
        short, alone = [], []
        for h in new:
            prompt = h.request.prompt_ids
            # a prefix's KV depends on the adapter it was computed with: the cache holds the base's only
            hit = self.prefix.lookup(prompt) if self.prefix is not None and h.request.adapter is None else None
            if len(prompt) - (hit.tokens if hit else 0) <= self.prefill_chunk:
                short.append(h)
                if hit is not None:
                    self._hits[h.id] = hit
            else:
                alone.append(Prefill(h, self.model.config, hit))
        return short, alone

    def _read(self, p: Prefill, cache: Any, mask: torch.Tensor, *, decoding: bool
              ) -> tuple[torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
        """One chunk of ``p``'s prompt (``prefill_chunk`` tokens, fewer while rows are ``decoding``:
        ``ChunkSizer``); once it is all read, its cache joins the batch's and its row gets logits. A
        prompt the model cannot run fails alone."""
        try:
            logits = p.step(self.model, self._forwarding([p.handle]), self._chunks.next(decoding), self._chunks)
        except Exception as exc:
            p.handle.finish("error", repr(exc))
            return None, cache, mask, []
        if logits is None:
            return None, cache, mask, []
        cache, mask = merged(cache, mask, p.cache, torch.ones(1, p.done, dtype=torch.long, device=self.device))
        return logits, cache, mask, [p.handle]

    def _decode(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One decode step of the running rows: each one's last token in, next-token logits out."""
        mask = F.pad(mask, (0, 1), value=1)
        with self._forwarding(rows):
            out = self.model(input_ids=torch.tensor([[h.tokens[-1]] for h in rows], device=mask.device),
                             attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                             use_cache=True, logits_to_keep=1, **with_cache(self.model, cache))
        return out.logits[:, -1].float(), returned_cache(out), mask

    def _decode_apart(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                      ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor]:
        """After a failed decode step: the step again for each row alone, from the cache as it was before
        it, so that a row the model cannot run fails alone and the others go on (their caches are joined
        again). Only a failure pays for this."""
        width = mask.shape[1]
        for layer in cache.layers:  # the failed step may have appended to some layers: cut that off
            layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]
        ran: list[tuple[RequestHandle, torch.Tensor, Any, torch.Tensor]] = []
        for i, h in enumerate(rows):
            alone = copy.copy(cache)
            alone.layers = [copy.copy(layer) for layer in cache.layers]
            for layer in alone.layers:
                layer.keys, layer.values = layer.keys[i:i + 1].clone(), layer.values[i:i + 1].clone()
            try:
                ran.append((h, *self._decode([h], alone, mask[i:i + 1])))
            except Exception as exc:
                h.finish("error", repr(exc))
        if not ran:
            return [], None, None, mask[:0, :0]
        mask = torch.cat([m for _, _, _, m in ran])
        lead = all_pad_columns(mask)  # the failed rows may have been the only ones that long
        for j, layer in enumerate(cache.layers):
            layer.keys = torch.cat([c.layers[j].keys for _, _, c, _ in ran])[:, :, lead:]
            layer.values = torch.cat([c.layers[j].values for _, _, c, _ in ran])[:, :, lead:]
        return [h for h, _, _, _ in ran], torch.cat([lg for _, lg, _, _ in ran]), cache, mask[:, lead:]

    def _forwarding(self, rows: list[RequestHandle]) -> AbstractContextManager[Any]:
        """The context of one forward of ``rows``: the forward lock, and each row's own LoRA adapter."""
        return self._forwarding_requests([h.request for h in rows])

    @contextmanager
    def _forwarding_requests(self, requests: list[GenerationRequest]) -> Iterator[None]:
        with self._forward_lock, self.adapters.rows([r.adapter for r in requests]) if self.adapters else nullcontext():
            yield

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
        ids = torch.tensor([list(r.prompt_ids)], device=self.device)
        with self._forwarding_requests([r]):
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
                    tok, lp = next_token(logits[i], h.request, h.tokens, h.rng, h.grammar)
                h.push(tok, lp)
                if reason := self._stop_hit(h, tok):
                    h.finish(reason)
            except Exception as exc:
                h.finish("error", repr(exc))

    def _stop_hit(self, h: RequestHandle, tok: int) -> FinishReason | None:
        return stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer)

    def _admit(self, rows: list[RequestHandle], width: int) -> list[RequestHandle]:
        """Pop waiting requests (FIFO) that fit the batch-size and KV-byte budgets."""
        def size(h: RequestHandle) -> int:
            return len(h.request.prompt_ids) + h.request.max_new_tokens

        def fits(taken: list[RequestHandle], h: RequestHandle) -> bool:
            need = [size(r) for r in rows + taken]
            # the padded cache if all rows run to the end, with its headroom and one layer in transit
            worst = peak_positions(len(need) + 1, width + max(need + [size(h)]), self._layers)
            return not need or worst * self.kv_bytes_per_token <= self.kv_cache_bytes  # else wait for rows to end

        return self._queue.take(self.max_batch_size - len(rows), fits)

    def _prefill_and_merge(self, new: list[RequestHandle], cache: Any, mask: torch.Tensor
                           ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Prefill ``new`` as one left-padded batch, then append its KV cache to the running one. A row
        whose beginning the prefix cache holds reads it from there: all rows compute their last ``s``
        tokens (``s`` the longest uncached tail among them), each after as much of its own cached
        beginning as the rest of its prompt, so the batch stays left-padded only."""
        prompts = [list(h.request.prompt_ids) for h in new]
        hits = [self._hits.pop(h.id, None) for h in new]
        s = max(len(p) - (hit.tokens if hit else 0) for p, hit in zip(prompts, hits))
        kept = [max(0, len(p) - s) for p in prompts]  # <= its hit's tokens; 0 without one
        c = max(kept)
        ids = torch.tensor([[0] * (s - len(p) + k) + p[k:] for p, k in zip(prompts, kept)], device=self.device)
        nmask = torch.tensor([[0] * (c - k) + [1] * k + [0] * (s - len(p) + k) + [1] * (len(p) - k)
                              for p, k in zip(prompts, kept)], dtype=torch.long, device=self.device)
        pos = (nmask.cumsum(1) - 1).clamp(min=0)[:, c:]
        past = growing_cache(self.model.config)
        if c:
            read_hits(past, hits, kept, c, room=s)
        for h, k in zip(new, kept):
            h.cached_tokens = k
        with self._forwarding(new):
            out = self.model(input_ids=ids, attention_mask=nmask, position_ids=pos, use_cache=True,
                             logits_to_keep=1, **with_cache(self.model, past))
        return (out.logits[:, -1].float(), *merged(cache, mask, returned_cache(out), nmask))

    def _drop_done(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                   ) -> tuple[list[RequestHandle], Any, torch.Tensor]:
        """The batch without its finished or cancelled rows, their KV kept in the prefix cache (unless
        they failed) and freed from the batch."""
        if self.prefix is not None and cache is not None:
            for i, h in enumerate(rows):
                if h.finished.is_set() and h.result().finish_reason != "error" and h.request.adapter is None:
                    self._keep(h, cache, int(mask[i].sum()), i)
        return _drop_done(rows, cache, mask)

    def _keep(self, h: RequestHandle, cache: Any, cached: int, row: int) -> None:
        """Row ``row``'s sequence (prompt, then the generated tokens the cache holds) into the prefix cache."""
        assert self.prefix is not None
        ids = (list(h.request.prompt_ids) + h.tokens)[:cached]
        self.prefix.insert(ids, [layer.keys[row:row + 1, :, -cached:] for layer in cache.layers],
                           [layer.values[row:row + 1, :, -cached:] for layer in cache.layers])


def _drop_done(rows: list[RequestHandle], cache: Any, mask: torch.Tensor
               ) -> tuple[list[RequestHandle], Any, torch.Tensor]:
    """The batch without its finished or cancelled rows, their KV cache freed."""
    keep = [i for i, h in enumerate(rows) if not h.done]
    if len(keep) == len(rows):
        return rows, cache, mask
    idx, rows = torch.tensor(keep, dtype=torch.long, device=mask.device), [rows[i] for i in keep]
    lead = all_pad_columns(mask[idx])
    if rows:
        keep_rows(cache, idx, lead)
    return rows, cache if rows else None, mask[idx, lead:]
