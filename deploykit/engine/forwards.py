"""The padded loop's forwards of the model (``padded.py`` chooses which runs at each step): a decode step of
the running rows, a mixed step (their next tokens and a chunk of a prompt, ``mixed.py``) and a prompt's
logprobs; each under the forward lock and with each row's own LoRA adapter (``adapters.py``).

A decode step that fails is run again for each row alone, from the cache as it was before it, so that a row
the model cannot run fails alone and the others go on (only a failure pays for that); never the engine.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from .adapters import Adapters
from .devices import input_device
from .kvcache import all_pad_columns, returned_cache, with_cache
from .mixed import Layout, mixed_attention
from .prefill import Prefill
from .requests import GenerationRequest, RequestHandle
from .sampling import TokenLogprobs, prompt_logprobs


class Forwards:
    """The forwards of one model for the padded loop's batch: row i of ``mask`` ([rows, cached tokens],
    0 for left padding) and of the cache is ``rows[i]``."""

    def __init__(self, model: Any, forward_lock: threading.Lock | None, adapters: Adapters | None) -> None:
        self.model = model
        self.device = input_device(model)  # where ids, positions and masks are made
        self.adapters = adapters  # LoRA adapters of the model: each row computes with its own (adapters.py)
        self._forward_lock: AbstractContextManager[Any] = forward_lock or nullcontext()

    def of(self, rows: list[RequestHandle]) -> AbstractContextManager[Any]:
        """The context of one forward of ``rows``: the forward lock, and each row's own LoRA adapter."""
        return self.of_requests([h.request for h in rows])

    @contextmanager
    def of_requests(self, requests: list[GenerationRequest]) -> Iterator[None]:
        with self._forward_lock, self.adapters.rows([r.adapter for r in requests]) if self.adapters else nullcontext():
            yield

    def decode_rows(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                    ) -> tuple[list[RequestHandle], torch.Tensor | None, Any, torch.Tensor]:
        """A decode step of the running rows; when it fails, each row alone; the rows decoded together
        fail only when that fails too, never the engine."""
        try:
            return (rows, *self.decode(rows, cache, mask))
        except Exception:
            try:
                if len(rows) < 2:  # a lone row's failure is its own
                    raise
                return self.decode_apart(rows, cache, mask)
            except Exception as again:
                for h in rows:
                    h.finish("error", repr(again))
                return [], None, None, mask[:0, :0]

    def decode(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
               ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One decode step of the running rows: each one's last token in, next-token logits out."""
        mask = F.pad(mask, (0, 1), value=1)
        with self.of(rows):
            out = self.model(input_ids=torch.tensor([[h.tokens[-1]] for h in rows], device=mask.device),
                             attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                             use_cache=True, logits_to_keep=1, **with_cache(self.model, cache))
        return out.logits[:, -1].float(), returned_cache(out), mask

    def decode_apart(self, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
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
                ran.append((h, *self.decode([h], alone, mask[i:i + 1])))
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

    def verify(self, rows: list[RequestHandle], drafts: list[list[int]], cache: Any, mask: torch.Tensor
               ) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """A verification step (``speculative.py``): each row's last token and its draft, ``K + 1`` positions
        per row (``K`` the longest draft; a shorter one is filled with its last token, after its real
        positions, where the causal mask keeps them out of the real ones; the filler repeats its last real
        position, so a row near the end of its context never asks for a position past it: absolute
        position embeddings have none). Every position's logits ``[rows, K + 1, vocab]``, the cache with
        ``K + 1`` new positions per row, and its mask."""
        k, width = max(len(d) for d in drafts), mask.shape[1]
        ids = [[h.tokens[-1], *d] for h, d in zip(rows, drafts)]
        ids = [row + [row[-1]] * (k + 1 - len(row)) for row in ids]
        before = mask.sum(1, keepdim=True)  # each row's real positions so far
        last = torch.tensor([[len(d)] for d in drafts], device=mask.device)  # each row's last real offset
        positions = before + torch.minimum(torch.arange(k + 1, device=mask.device)[None], last)
        mask = F.pad(mask, (0, k + 1), value=1)
        with self.of(rows):
            out = self.model(input_ids=torch.tensor(ids, device=mask.device), attention_mask=mask,
                             position_ids=positions, use_cache=True,
                             logits_to_keep=k + 1, **with_cache(self.model, cache))
        assert mask.shape[1] == width + k + 1
        return out.logits.float(), returned_cache(out), mask

    def mixed(self, rows: list[RequestHandle], p: Prefill | None, chunk: int, cache: Any, mask: torch.Tensor,
              drafts: list[list[int]] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The packed forward (``mixed.py``) of the rows' next tokens (each row's last token and its draft,
        when ``drafts``) and up to ``chunk`` tokens of ``p`` (None: no chunk): the rows' logits
        (``[sum(1 + len(draft)), vocab]``, row after row), ``p``'s once its last token is read, and the rows'
        new mask (each row's columns past its own tokens 0)."""
        drafts = drafts or [[] for _ in rows]
        counts = [1 + len(d) for d in drafts]
        most, packed = max(counts), sum(counts)
        before = mask.sum(1)  # each row's real positions so far
        new = torch.arange(most, device=mask.device)[None] < torch.tensor(counts, device=mask.device)[:, None]
        mask = torch.cat([mask, new.to(mask.dtype)], 1)
        tokens = torch.tensor([[t for h, d in zip(rows, drafts) for t in (h.tokens[-1], *d)]], device=self.device)
        positions = torch.cat([before[i] + torch.arange(n, device=mask.device) for i, n in enumerate(counts)])
        ids, chunk_positions, end = (p.next_chunk(chunk, self.device) if p is not None else
                                     (tokens[:, :0], positions[:0], 0))
        read = p is not None and end == len(p.prompt)  # the chunk's last token gives the prompt's first new one
        keep = list(range(packed)) + ([packed + ids.shape[1] - 1] if read else [])
        slots = [h.request.adapter for h, n in zip(rows, counts) for _ in range(n)]
        slots += [p.handle.request.adapter] * ids.shape[1] if p is not None else []  # per packed token
        adapters = self.adapters.packed(slots, keep) if self.adapters else nullcontext()
        layout = Layout(len(rows), cache, mask, p.cache if p is not None else None,
                        counts if most > 1 else None)
        with self._forward_lock, adapters, mixed_attention(self.model, layout):
            out = self.model(input_ids=torch.cat([tokens, ids], 1),
                             position_ids=torch.cat([positions, chunk_positions.to(positions.device)])[None],
                             use_cache=False, logits_to_keep=torch.tensor(keep, device=self.device))
        if p is not None:
            p.done = end
        logits = out.logits[0].float()
        return logits[:packed], (logits[packed:] if read else None), mask

    def prompt_logprobs(self, r: GenerationRequest) -> list[TokenLogprobs]:
        """A forward of the whole prompt alone, keeping every position's logits (the batch keeps one)."""
        ids = torch.tensor([list(r.prompt_ids)], device=self.device)
        with self.of_requests([r]):
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
        return prompt_logprobs(logits, r.prompt_ids, r.prompt_logprobs or 0)
