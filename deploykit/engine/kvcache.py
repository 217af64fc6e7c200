"""The padded loop's KV cache: transformers' ``DynamicCache`` whose full-attention layers grow in place.

transformers' ``DynamicLayer.update`` concatenates every step, so each decode step copies the whole cache
of every layer into a new tensor (14% of the engine thread's time serving SmolLM2 to 16 clients, by
py-spy). ``GrowingLayer`` keeps a buffer with room for ``HEADROOM`` more positions and writes the new
keys and values into it; ``keys`` / ``values`` are views of its first positions, so the model, the mask
code and the engine see what ``DynamicLayer`` would give them. When the engine replaces ``keys`` /
``values`` (a row leaves, new rows join) the next update starts a new buffer from them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

HEADROOM = 64  # positions allocated ahead: one copy of the cache every 64 decode steps at most


class GrowingLayer(DynamicLayer):
    """A full-attention cache layer that appends in place (see the module docstring)."""

    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.get_seq_length(), key_states.shape[-2]
        assert self.keys is not None and self.values is not None  # initialised above
        buffers = self._buffers
        if buffers is None or not _views(self.keys, buffers[0], n) or n + add > buffers[0].shape[-2]:
            buffers = (_grown(self.keys, key_states, n + add), _grown(self.values, value_states, n + add))
            self._buffers = buffers
        keys, values = buffers
        keys[:, :, n:n + add] = key_states
        values[:, :, n:n + add] = value_states
        self.keys, self.values = keys[:, :, :n + add], values[:, :, :n + add]
        return self.keys, self.values


    def preset(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Start from buffers whose first ``n`` positions the caller filled (``[batch, heads, >= n, dim]``):
        the next update appends after them in place, with no copy of what they hold."""
        self.lazy_initialization(keys, values)
        self._buffers = (keys, values)
        self.keys, self.values = keys[:, :, :n], values[:, :, :n]


def _views(keys: torch.Tensor, buffer: torch.Tensor, n: int) -> bool:
    """Whether ``keys`` is still the view of ``buffer`` (the engine may have replaced it)."""
    return n > 0 and keys.data_ptr() == buffer.data_ptr() and keys.shape[0] == buffer.shape[0] \
        and keys.stride() == buffer.stride()


def _grown(old: torch.Tensor, new: torch.Tensor, need: int) -> torch.Tensor:
    batch, heads, _, dim = new.shape
    buffer = new.new_empty(batch, heads, need + HEADROOM, dim)
    if old.numel():
        buffer[:, :, :old.shape[-2]] = old
    return buffer


def growing_cache(config: Any) -> DynamicCache:
    """An empty cache for ``config``'s model whose full-attention layers are ``GrowingLayer``s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
