"""The rows of the padded loop's batch joining and leaving it: its KV cache and mask ``[rows, cached
tokens]`` (0 for left padding), row i of both ``rows[i]``.

Short new prompts join in one left-padded prefill, each reading the beginning the prefix cache holds
(``prefixcache.py``) and computing only the rest, then their KV cache is appended to the batch's (it grows in
place, ``kvcache.py``; new rows with a cached beginning read it straight into the batch's buffers, below the
running rows); a request the model cannot run fails alone (the prefill again for each row alone, still
reading its cached beginning), and the running rows' keys and values are the same whether a prefill
succeeds or fails. Finished or cancelled rows leave at
once, their KV kept in the prefix cache (unless they failed or ran with an adapter) and freed from the batch,
and the padding only they needed goes with them.
"""

from __future__ import annotations

from typing import Any

import torch

from .forwards import Forwards
from .kvcache import (all_pad_columns, growing_cache, hold_all, keep_rows, merged, read_hits, read_hits_below,
                      left_pad, returned_cache, with_cache)
from .prefixcache import Hit, PrefixCache
from .requests import RequestHandle


def join(fw: Forwards, new: list[RequestHandle], hits: dict[str, Hit], cache: Any, mask: torch.Tensor
         ) -> tuple[torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
    """Prefill ``new`` into the batch (``hits``: request id -> its cached beginning, taken once); when that
    fails, each one alone (its cached beginning still read), so that a request the model cannot run fails
    alone (the running rows' keys and values stay as they were)."""
    try:
        return _join(fw, new, hits, cache, mask)
    finally:
        for h in new:
            hits.pop(h.id, None)


def _join(fw: Forwards, new: list[RequestHandle], hits: dict[str, Hit], cache: Any, mask: torch.Tensor
          ) -> tuple[torch.Tensor | None, Any, torch.Tensor, list[RequestHandle]]:
    try:
        return (*prefill_and_merge(fw, new, hits, cache, mask), new)
    except Exception as exc:
        if len(new) == 1:
            new[0].finish("error", repr(exc))
            return None, cache, mask, []
    parts, joined = [], []
    for h in new:
        try:
            logits, cache, mask = prefill_and_merge(fw, [h], hits, cache, mask)
        except Exception as exc:
            h.finish("error", repr(exc))
            continue
        parts.append(logits)
        joined.append(h)
    return (torch.cat(parts) if parts else None), cache, mask, joined


def prefill_and_merge(fw: Forwards, new: list[RequestHandle], hits_of: dict[str, Hit], cache: Any,
                      mask: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Prefill ``new`` as one left-padded batch, its KV cache appended to the running one's. A row
    whose beginning the prefix cache holds reads it from there: all rows compute their last ``s``
    tokens (``s`` the longest uncached tail among them), each after as much of its own cached
    beginning as the rest of its prompt, so the batch stays left-padded only."""
    prompts = [list(h.request.prompt_ids) for h in new]
    hits = [hits_of.get(h.id) for h in new]
    s = max(len(p) - (hit.tokens if hit else 0) for p, hit in zip(prompts, hits))
    kept = [max(0, len(p) - s) for p in prompts]  # <= its hit's tokens; 0 without one
    c = max(kept)
    ids = torch.tensor([[0] * (s - len(p) + k) + p[k:] for p, k in zip(prompts, kept)], device=fw.device)
    nmask = torch.tensor([[0] * (c - k) + [1] * k + [0] * (s - len(p) + k) + [1] * (len(p) - k)
                          for p, k in zip(prompts, kept)], dtype=torch.long, device=fw.device)
    pos = (nmask.cumsum(1) - 1).clamp(min=0)[:, c:]
    past, below = growing_cache(fw.model.config), None
    if c and cache is not None:  # the running rows and the new ones in one buffer per layer: one copy of the hits
        below = read_hits_below(cache, mask.shape[1], past, hits, kept, c, room=s)
    elif c:
        read_hits(past, hits, kept, c, room=s)
    for h, k in zip(new, kept):
        h.cached_tokens = k
    with fw.of(new):
        out = fw.model(input_ids=ids, attention_mask=nmask, position_ids=pos, use_cache=True,
                       logits_to_keep=1, **with_cache(fw.model, past))
    logits = out.logits[:, -1].float()
    if below is None:
        return (logits, *merged(cache, mask, returned_cache(out), nmask))
    width, buffers = below
    hold_all(cache, past, buffers, width)
    return logits, cache, torch.cat([left_pad(mask, width), left_pad(nmask, width)])


def drop_done(prefix: PrefixCache | None, rows: list[RequestHandle], cache: Any, mask: torch.Tensor
              ) -> tuple[list[RequestHandle], Any, torch.Tensor]:
    """The batch without its finished or cancelled rows, their KV kept in the ``prefix`` cache (unless
    they failed) and freed from the batch."""
    if prefix is not None and cache is not None:
        for i, h in enumerate(rows):
            if h.finished.is_set() and h.result().finish_reason != "error":
                keep(prefix, h, cache, int(mask[i].sum()), i)
    return without_done(rows, cache, mask)


def keep(prefix: PrefixCache, h: RequestHandle, cache: Any, cached: int, row: int) -> None:
    """Row ``row``'s sequence (prompt, then the generated tokens the cache holds) into the prefix cache, under
    the adapter slot it computed with."""
    ids = (list(h.request.prompt_ids) + h.tokens)[:cached]
    prefix.insert(ids, [layer.keys[row:row + 1, :, -cached:] for layer in cache.layers],
                  [layer.values[row:row + 1, :, -cached:] for layer in cache.layers], key=h.request.adapter or "")


def without_done(rows: list[RequestHandle], cache: Any, mask: torch.Tensor
                 ) -> tuple[list[RequestHandle], Any, torch.Tensor]:
    """The batch without its finished or cancelled rows, their KV cache freed."""
    kept = [i for i, h in enumerate(rows) if not h.done]
    if len(kept) == len(rows):
        return rows, cache, mask
    idx, rows = torch.tensor(kept, dtype=torch.long, device=mask.device), [rows[i] for i in kept]
    lead = all_pad_columns(mask[idx])
    if rows:
        keep_rows(cache, idx, lead)
    return rows, cache if rows else None, mask[idx, lead:]
