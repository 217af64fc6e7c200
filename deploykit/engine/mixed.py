"""A mixed step of the padded loop: one forward holding the running rows' next tokens and a chunk of a prompt
being read alone (``prefill.Prefill``), as vLLM's and SGLang's schedulers mix decodes and prefill chunks.

The rows' caches are a padded rectangle ``[rows, heads, width, dim]`` and the prompt's is a cache of its own,
so the two cannot be one batch of the model's usual forward. Here they are one *packed* sequence instead:
``input_ids`` is ``[1, rows + chunk]`` (each row's last token, then the chunk), with every token's own
position, so the embeddings, projections, MLPs and the head read their weights once for both (on a CPU a
forward's time is mostly reading weights). Attention is the one part that must keep them apart: for the
forward, the model's attention is deploykit's (transformers' ``AttentionInterface``), which appends the
rows' new keys and values to the batch's cache and the chunk's to the prompt's (``GrowingLayer.update``),
and runs transformers' own ``sdpa`` attention twice: each row's token over its row (the padded mask), the
chunk causally over the prompt's cache. The model builds no mask for the packed shape (transformers makes
none for an attention implementation without a mask function) and is given no cache (the attention holds
both).

Rows and prompts with LoRA adapters are mixed too: peft chooses an adapter per batch row, and the packed
sequence is one row, so each adapted layer takes it as one row per token for the forward
(``adapters.Adapters.packed``), each token with its own row's adapter. Only models whose attention is plain
full attention through transformers' ``sdpa`` are mixed (no sliding window, no chunked attention, not an
encoder-decoder); the loop alternates decode steps and chunks for the rest, as before.

Verification of drafts (``speculative.py``) is the same packed forward, with or without a chunk beside it:
row i contributes its last token and its ``k_i`` drafted tokens, ``k_i + 1`` positions (``Layout.counts``),
beside rows that decode one, so the projections, MLPs and head read ``sum(k_i + 1)`` tokens, not every row
widened to the longest draft. Each row's cache still grows by the batch's most new positions (the padded
rectangle); the columns a shorter row has no token for are zeros its mask hides, and the queries of a row
are scattered into ``[rows, heads, most, dim]`` for ``sdpa`` (causal over the new columns) and gathered back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MIXED = "deploykit_mixed"  # the attention implementation a mixed forward runs with
_current = threading.local()  # the mixed step of this thread's forward (each engine forwards on its own thread)


@dataclass
class Layout:
    """What the mixed forward's attention needs: the batch's cache and mask (with the new columns), the
    prompt's cache (None: no chunk), and how many of the packed tokens each row has (the rest are the chunk).
    ``counts`` None: one token per row (a decode step beside a chunk)."""

    rows: int
    batch: Any  # the batch's DynamicCache (GrowingLayers)
    mask: torch.Tensor  # [rows, width + most], 0 for left padding and for a row's columns past its tokens
    prompt: Any  # the prompt's DynamicCache (GrowingLayers), or None
    counts: list[int] | None = None  # packed tokens per row (verification: 1 + its drafts)
    masks: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # per device: the masks, the index

    @property
    def uniform(self) -> bool:
        """Whether every row has as many packed tokens (no row's columns need filling)."""
        return self.counts is None or min(self.counts) == max(self.counts)

    @property
    def packed(self) -> int:
        """How many of the packed tokens are the rows'."""
        return self.rows if self.counts is None else sum(self.counts)

    def row_mask(self, device: torch.device) -> torch.Tensor:
        """``[rows, 1, most, width + most]``: each row's queries see its real columns, its own new ones causally."""
        key = ("rows", str(device))
        if key not in self.masks:
            seen = self.mask.to(device=device, dtype=torch.bool)[:, None, None, :]
            most = 1 if self.counts is None else max(self.counts)
            if most > 1:
                cols = torch.arange(seen.shape[-1], device=device)[None, :] - (seen.shape[-1] - most)
                seen = seen & (cols <= torch.arange(most, device=device)[:, None])[None, None]
            self.masks[key] = seen
        return self.masks[key]

    def index(self, device: torch.device) -> torch.Tensor:
        """Where each of the rows' packed tokens sits in ``[rows * most]`` (row i's j-th at ``i * most + j``)."""
        key = ("index", str(device))
        if key not in self.masks:
            counts = self.counts or [1] * self.rows
            most = max(counts)
            self.masks[key] = torch.tensor([i * most + j for i, n in enumerate(counts) for j in range(n)],
                                           device=device)
        return self.masks[key]

    def chunk_mask(self, device: torch.device, chunk: int, total: int) -> torch.Tensor:
        key = ("chunk", str(device))
        if key not in self.masks:  # query i (position total - chunk + i) sees every column up to its own
            cols = torch.arange(total, device=device)[None, :]
            rows = torch.arange(total - chunk, total, device=device)[:, None]
            self.masks[key] = (cols <= rows)[None, None]
        return self.masks[key]


def mixable(model: Any) -> bool:
    """Whether ``model``'s forward can be mixed (see the module docstring)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    return (getattr(text, "_attn_implementation", None) == "sdpa" and not getattr(config, "is_encoder_decoder", False)
            and getattr(text, "sliding_window", None) is None and layer_types == {"full_attention"}
            and not getattr(text, "attention_chunk_size", None))


@contextmanager
def mixed_attention(model: Any, layout: Layout) -> Iterator[None]:
    """Run ``model``'s forwards inside with the mixed attention over ``layout``."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    _current.layout = layout
    text._attn_implementation = MIXED
    try:
        yield
    finally:
        text._attn_implementation = "sdpa"
        _current.layout = None


def _mixed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The rows' tokens over their rows, the chunk over the prompt (``query``: ``[1, heads, packed + chunk,
    dim]``); the output ``[1, packed + chunk, heads, dim]`` as transformers' ``sdpa`` gives it."""
    layout: Layout = _current.layout
    j, r = module.layer_idx, layout.packed
    if layout.counts is None:
        keys, values = layout.batch.layers[j].update(_per_row(key[:, :, :r]), _per_row(value[:, :, :r]))
        rows, _ = sdpa_attention_forward(module, _per_row(query[:, :, :r]), keys, values,
                                         layout.row_mask(query.device), **kwargs)
        rows = rows.transpose(0, 1)
    else:
        index = layout.index(query.device)
        keys, values = layout.batch.layers[j].update(_scattered(key[:, :, :r], index, layout),
                                                     _scattered(value[:, :, :r], index, layout))
        rows, _ = sdpa_attention_forward(module, _scattered(query[:, :, :r], index, layout), keys, values,
                                         layout.row_mask(query.device), **kwargs)
        rows = rows.reshape(-1, *rows.shape[2:])  # [rows, most, heads, dim] -> [1, packed, heads, dim]
        rows = (rows if layout.uniform else rows[index])[None]
    if layout.prompt is None:
        return rows, None
    chunk = query.shape[2] - r
    keys, values = layout.prompt.layers[j].update(key[:, :, r:], value[:, :, r:])
    read, _ = sdpa_attention_forward(module, query[:, :, r:], keys, values,
                                     layout.chunk_mask(query.device, chunk, keys.shape[2]), **kwargs)
    return torch.cat([rows, read], dim=1), None


def _per_row(x: torch.Tensor) -> torch.Tensor:
    """``[1, heads, rows, dim]`` (one packed sequence) as ``[rows, heads, 1, dim]`` (one token per row)."""
    return x[0].transpose(0, 1).unsqueeze(2)


def _scattered(x: torch.Tensor, index: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``[1, heads, packed, dim]`` as ``[rows, heads, most, dim]``: each row's tokens first, zeros after."""
    assert layout.counts is not None
    heads, dim, most = x.shape[1], x.shape[3], max(layout.counts)
    if layout.uniform:  # every row has ``most`` tokens (one row verifying): the packed tokens are the rectangle
        return x[0].transpose(0, 1).reshape(layout.rows, most, heads, dim).transpose(1, 2)
    out = x.new_zeros(layout.rows * most, heads, dim)
    out[index] = x[0].transpose(0, 1)
    return out.view(layout.rows, most, heads, dim).transpose(1, 2)


AttentionInterface.register(MIXED, _mixed_attention)
