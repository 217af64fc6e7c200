"""The ``"padded"`` backend of the batching engine (the default): deploykit's own decode loop on one
worker thread, and which unit of work each of its steps runs.

Waiting requests join the running batch at step boundaries (``intake.py`` admits and routes them; short
prompts join in one left-padded prefill, ``batch_rows.py``), finished or cancelled rows leave it at once and
free their cache, and every request chooses its tokens on its own (``sampling.py``: greedy, temperature,
top_p, a private seeded ``torch.Generator``, penalties, logit_bias, logprobs, a grammar's mask; one argmax
for all the plain greedy rows). A request that fails its prefill, a decode step or its sampling fails alone
(a failed step is run again for each row alone, ``forwards.py``); never the engine.

Why deploykit has its own loop at all: in transformers 5.23 continuous batching reads ``do_sample``
and the seed once per manager, so greedy and sampled requests (or two seeds) cannot share one, which an
OpenAI-compatible server must allow; and on this CPU it is slower (SmolLM2-135M fp32 through
``deploykit serve``, 16 streaming clients, 64 new tokens each, 2 cores: 160.7 tok/s against 188.9-195.6 for
the padded loop and 152-155 for ``transformers serve``; docs/benchmarks.md).
Prompts with more than ``prefill_chunk`` tokens left to compute (after what the prefix cache holds) are
read alone in chunks (``prefill.py``), each in the same forward as the running rows' next tokens (a mixed
step, ``mixed.py``, each token with its row's LoRA adapter; where a model cannot be mixed, chunks and decode
steps alternate):
running rows keep producing tokens meanwhile, and such a prompt joins the batch only once it is read. With
``spec.speculative`` (``speculative.py``) a decode step whose rows have drafts is a verification step: every
row's last token and its drafts in one forward (packed where the model mixes: a row with k drafts adds
k + 1 positions, one that decodes adds one, beside a prompt's chunk when one is read), the accepted ones
kept. Limits of
the padded loop: rows pad to the longest row while they run together (the padding goes when it leaves),
short new prompts still join in one padded prefill step, and it serves full and sliding-window attention
(a windowed layer keeps every position, the model's mask applies the window: ``kvcache.growing_cache``),
not chunked or linear attention (refused when the engine starts).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..threads import release_openmp_threads
from .adapters import Adapters
from .admission import Admission, FinishReason, stop_reason
from .batch_rows import drop_done, join
from .drafting import DraftModel
from .forwards import Forwards
from .intake import Intake
from .kvcache import growing_cache, keep_verified, merged, truncate
from .mixed import mixable
from .prefill import ChunkSizer, Prefill
from .prefixcache import PrefixCache
from .requests import RequestHandle
from .sampling import is_plain_greedy, next_token
from .speculative import Speculator
from .types import Speculation


class PaddedBackend:
    """The padded loop over one model: ``run`` is the engine's worker thread, the rest is safe from any
    thread. Batch row i is ``rows[i]``; ``mask`` is [rows, cached tokens], 0 for left padding."""

    def __init__(self, model: Any, tokenizer: Any, queue: Admission, *, eos_ids: set[int], max_batch_size: int,
                 kv_cache_bytes: int, kv_bytes_per_token: int, forward_lock: threading.Lock | None,
                 prefix_cache_bytes: int = 0, prefill_chunk: int = 256, adapters: Adapters | None = None,
                 speculative: Speculation | None = None, draft_model: Any = None) -> None:
        self.model, self.tokenizer, self.eos_ids = model, tokenizer, eos_ids
        self._fw = Forwards(model, forward_lock, adapters)  # the model's forwards (forwards.py)
        self.device, self.adapters = self._fw.device, adapters
        self._queue = queue  # the waiting requests
        self._chunks = ChunkSizer(prefill_chunk)  # the chunk size while rows decode
        layers = len(growing_cache(model.config).layers)  # a model this loop cannot serve fails here
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._intake = Intake(queue, self._fw, max_batch_size=max_batch_size, kv_cache_bytes=kv_cache_bytes,
                              kv_bytes_per_token=kv_bytes_per_token, layers=layers, prefix=self.prefix,
                              prefill_chunk=prefill_chunk,  # admission and start of new requests (intake.py)
                              draft_tokens=speculative.num_tokens if speculative else 0)
        if draft_model is not None and not isinstance(draft_model, DraftModel):
            draft_model = DraftModel(draft_model)  # a model: drafting with the default threads
        self.speculator = (Speculator(speculative, draft_model)
                           if speculative is not None else None)  # drafts (speculative.py, drafting.py)
        self.mixable = mixable(model)  # decode steps and prompt chunks share forwards (mixed.py)
        self.mixed_steps = 0  # forwards that held the rows' tokens and a prompt's chunk (read by any thread)
        self._slots: set[str] = set()  # the adapter slots the prefix cache was last trimmed to

    def resize_kv(self, kv_cache_bytes: int) -> None:
        """The KV bytes new requests are admitted against from now (a live adapter change took or gave back
        room; rows running keep theirs). One int, read by the loop's thread at its next admission."""
        self._intake.kv_cache_bytes = kv_cache_bytes
    def submit(self, h: RequestHandle) -> RequestHandle:
        # requests that a free batch slot takes at the next step are not queued: count only the rest
        self._queue.put(h, free_slots=max(0, self._intake.max_batch_size - self._queue.running))
        return h

    def cancel(self, handle: RequestHandle) -> None:
        handle.finish("cancelled")  # the loop drops the row at its next step

    def stats(self) -> dict[str, int]:
        return {**self._queue.stats(), **(self.prefix.stats() if self.prefix is not None else {}),
                **(self.speculator.stats() if self.speculator is not None else {})}

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
                rows, cache, mask = drop_done(self.prefix, rows, cache, mask)
                if self.speculator is not None:  # rows that left take their drafts' state along
                    self.speculator.keep(rows)
                self._forget_gone_adapters()
                reading = [p for p in reading if not p.handle.done]
                new = self._intake.admit(rows + [p.handle for p in reading], mask.shape[1])
                self._queue.running = len(rows) + len(reading) + len(new)
                if not rows and not new and not reading:
                    if busy:  # going idle: its OpenMP threads would slow other engines of the process
                        release_openmp_threads()
                        busy = False
                    if not self._queue.wait_for_work(0.5):  # idle: sleep until a submit or close
                        return
                    continue
                busy = True
                short, alone = self._intake.route(self._intake.start(new))
                reading += alone
                if short:  # join step: only the new rows get a token (old rows advance next step)
                    logits, cache, mask, short = join(self._fw, short, self._intake.hits, cache, mask)
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
                    rows, logits, cache, mask = self._decode(rows, cache, mask)
                    step_rows, chunk_next = rows, True
                else:
                    continue
                self._choose(step_rows, logits)
        finally:
            if self.prefix is not None:  # the generation is going: its kept prefixes go with it
                self.prefix.clear()

    def _forget_gone_adapters(self) -> None:
        """The prefix cache drops what adapter slots that left the model computed (never found again: a new
        version is a new slot)."""
        if self.prefix is None or self.adapters is None:
            return
        slots = self.adapters.slots()
        if slots != self._slots:
            self.prefix.retain(slots | {""})
            self._slots = slots

    def _mixes(self, rows: list[RequestHandle], p: Prefill) -> bool:
        """Whether the running rows and ``p``'s next chunk can share a forward (each token with its row's
        adapter: ``Adapters.packed``)."""
        return self.mixable and p.mixes

    def _decode_and_read(self, rows: list[RequestHandle], p: Prefill, cache: Any, mask: torch.Tensor
                         ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
        """A mixed step (``mixed.py``): the rows' next tokens (their drafts too, verified: ``_verify``) and a
        chunk of ``p`` in one forward; once ``p`` is read, its cache joins the batch's and its row gets
        logits. When the forward fails, neither cache keeps any of it, and the step is a decode step alone
        (each row's failure its own), the chunk read alone at the next step (its own failure its own)."""
        width, read = mask.shape[1], p.done
        drafts = self.speculator.drafts(rows) if self.speculator is not None else []
        started = time.perf_counter()
        try:
            logits, chunk_logits, mask = self._fw.mixed(rows, p, self._chunks.next(True, len(rows)), cache, mask,
                                                        drafts if any(drafts) else None)
        except Exception:
            truncate(cache, width)
            truncate(p.cache, read)
            p.done, p.mixes = read, False  # its next chunk is read alone: a prompt the model cannot run fails alone
            rows, decoded, cache, mask = self._fw.decode_rows(rows, cache, mask)
            return rows, decoded, cache, mask, rows
        self.mixed_steps += 1
        step_rows = rows
        if any(drafts):  # the rows' tokens are chosen here (verification's time is not the chunk's)
            mask = self._accept(rows, drafts, logits, cache, mask, width, None)
            logits, step_rows = logits[:0], []
        elif self._chunks.step_seconds is not None:  # what the chunk added to a decode step
            self._chunks.read(p.done - read, max(0.0, time.perf_counter() - started - self._chunks.step_seconds))
        if chunk_logits is None:
            return rows, logits, cache, mask, step_rows
        cache, mask = merged(cache, mask, p.cache, torch.ones(1, p.done, dtype=torch.long, device=self.device))
        return rows + [p.handle], torch.cat([logits, chunk_logits]), cache, mask, step_rows + [p.handle]

    def _read(self, p: Prefill, cache: Any, mask: torch.Tensor, *, decoding: bool
              ) -> tuple[torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
        """One chunk of ``p``'s prompt (``prefill_chunk`` tokens, fewer while rows are ``decoding``:
        ``ChunkSizer``); once it is all read, its cache joins the batch's and its row gets logits. A
        prompt the model cannot run fails alone."""
        try:
            logits = p.step(self.model, self._fw.of([p.handle]), self._chunks.next(decoding), self._chunks)
        except Exception as exc:
            p.handle.finish("error", repr(exc))
            return None, cache, mask, []
        if logits is None:
            return None, cache, mask, []
        cache, mask = merged(cache, mask, p.cache, torch.ones(1, p.done, dtype=torch.long, device=self.device))
        return logits, cache, mask, [p.handle]

    def _decode(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor]:
        """A decode step of the running rows, or a verification step where rows have drafts (its tokens are
        chosen here: no logits left to choose from)."""
        drafts = self.speculator.drafts(rows) if self.speculator is not None else []
        if any(drafts):
            return self._verify(rows, drafts, cache, mask)
        started = time.perf_counter()
        rows, logits, cache, mask = self._fw.decode_rows(rows, cache, mask)
        self._chunks.decoded(time.perf_counter() - started)  # what a chunk is sized against
        if self.speculator is not None:  # what a draft token and a verification step are weighed against
            self.speculator.decoded(time.perf_counter() - started)
        return rows, logits, cache, mask

    def _verify(self, rows: list[RequestHandle], drafts: list[list[int]], cache: Any, mask: torch.Tensor
                ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor]:
        """The rows' last tokens and drafts in one forward (packed where the model mixes: each row's own
        positions only; else every row widened to the longest draft); each row's tokens chosen from its
        positions in turn while they equal its draft, and the cache cut back to what was accepted
        (``speculative.py``). When the forward fails, the cache keeps none of it and the step is a decode
        step (each row's failure its own)."""
        width, started = mask.shape[1], time.perf_counter()
        try:
            if self.mixable:
                logits, _, wide = self._fw.mixed(rows, None, 0, cache, mask, drafts)
            else:
                logits, cache, wide = self._fw.verify(rows, drafts, cache, mask)
        except Exception:
            truncate(cache, width)
            return self._fw.decode_rows(rows, cache, mask)
        return rows, None, cache, self._accept(rows, drafts, logits, cache, wide, width,
                                               time.perf_counter() - started)

    def _accept(self, rows: list[RequestHandle], drafts: list[list[int]], logits: torch.Tensor, cache: Any,
                wide: torch.Tensor, width: int, seconds: float | None) -> torch.Tensor:
        """Choose each row's tokens from its verified positions (``logits``: packed, row after row, or
        ``[rows, most, vocab]`` widened) and cut the cache back to what each kept; the new mask. ``seconds``:
        the forward's time, weighed against decoding's (None: a chunk shared it)."""
        assert self.speculator is not None
        self.speculator.stepped(with_chunk=seconds is None)
        kept, at = [], 0
        for i, (h, d) in enumerate(zip(rows, drafts)):
            own = logits[at:at + len(d) + 1] if logits.dim() == 2 else logits[i, :len(d) + 1]
            at += len(d) + 1
            kept.append(self.speculator.accept(h, d, own, self._choose_one))
        if seconds is not None:
            self.speculator.verified(seconds, len(rows), sum(kept))
        return keep_verified(cache, wide, width, kept)

    def _choose(self, rows: list[RequestHandle], logits: torch.Tensor | None) -> None:
        """Each row's next token (one argmax for all plain greedy rows); a row that fails here fails alone."""
        if logits is None:
            return
        greedy = logits.argmax(-1).tolist() if any(is_plain_greedy(h.request) for h in rows) else []
        for i, h in enumerate(rows):
            if not h.done:
                self._choose_one(h, logits[i], greedy[i] if greedy else None)

    def _choose_one(self, h: RequestHandle, logits: torch.Tensor, greedy: int | None = None) -> int | None:
        """Push ``h``'s next token from its ``logits`` (``greedy``: their argmax, when known) and end the row
        where it stops; the token, or None when the row failed here (alone)."""
        try:
            if is_plain_greedy(h.request):
                tok, lp = (int(logits.argmax()) if greedy is None else greedy), None
            else:
                tok, lp = next_token(logits, h.request, h.tokens, h.rng, h.grammar)
            h.push(tok, lp)
            if reason := self._stop_hit(h, tok):
                h.finish(reason)
            return tok
        except Exception as exc:
            h.finish("error", repr(exc))
            return None

    def _stop_hit(self, h: RequestHandle, tok: int) -> FinishReason | None:
        return stop_reason(h, tok, eos_ids=self.eos_ids, tokenizer=self.tokenizer)

