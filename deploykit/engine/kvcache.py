"""The padded loop's KV cache: transformers' ``DynamicCache`` whose full-attention layers grow in place,
and what the loop does to the batch's cache and its mask (rows joined, cached prefixes read, padding).

transformers' ``DynamicLayer.update`` concatenates every step, so each decode step copies the whole cache
of every layer into a new tensor (14% of the engine thread's time serving SmolLM2 to 16 clients, by
py-spy). ``GrowingLayer`` keeps a buffer with room for ``HEADROOM`` more positions and writes the new
keys and values into it; ``keys`` / ``values`` are views of its first positions, so the model, the mask
code and the engine see what ``DynamicLayer`` would give them. When the engine replaces ``keys`` /
``values`` (a row leaves, new rows join) the next update starts a new buffer from them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

if TYPE_CHECKING:
    from .prefixcache import Hit

HEADROOM = 64  # positions allocated ahead: one copy of the cache every 64 decode steps at most
_WINDOWED = (DynamicLayer, DynamicSlidingWindowLayer)  # the layers a GrowingLayer stands in for


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


def with_cache(model: Any, past: Any) -> dict[str, Any]:
    """The keyword argument that hands ``past`` to ``model``'s forward: ``cache`` where its forward names it so
    (transformers renamed its models' ``past_key_values`` to ``cache``; the old name warns, FutureWarning, and
    goes in 5.40), ``past_key_values`` in the versions before and in models not renamed yet."""
    return {_cache_keyword(type(model).forward): past}


def returned_cache(out: Any) -> Any:
    """The cache a forward returned, read under the name it has (``out.past_key_values`` warns once renamed)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


@cache
def _cache_keyword(forward: Callable[..., Any]) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


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
    """An empty cache for ``config``'s model, every layer a ``GrowingLayer``; ValueError for a model whose
    attention the padded loop cannot serve exactly.

    Sliding-window layers keep every position too (transformers' ``DynamicSlidingWindowLayer`` keeps the
    last ``window - 1``): the model's own mask then limits each query to its window, counted in cache
    columns, which within a left-padded row are its positions shifted by the row's padding, so the window
    is exact for every row, and joining, dropping and prefix-caching rows stays column slicing (a windowed
    layer's length is not the mask's width: the batch's cache operations broke on it). The price is the
    memory of full attention, which is what the plan and the admission count for every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attention_chunk_size", None):
        raise ValueError("this model uses chunked attention (attention_chunk_size), whose chunks start at "
                         "absolute positions that left padding shifts: the padded loop cannot serve it exactly; "
                         "use spec.serving.batching: continuous")
    cache = DynamicCache(config=config)
    other = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in _WINDOWED})
    if other:
        raise ValueError(f"this model's KV cache has {', '.join(other)} layers; the padded loop serves full "
                         "and sliding-window attention only: use spec.serving.batching: continuous")
    cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def read_hits(past: Any, hits: list[Hit | None], kept: list[int], width: int, *, room: int) -> None:
    """Fill ``past`` with each row's first ``kept`` cached tokens, left-padded to ``width``: copied once,
    straight into buffers with ``room`` more positions, which the prefill's forward then appends to (a
    padded copy, a concatenation and a grown buffer took three copies of every cached token before)."""
    some = next(hit for hit in hits if hit is not None)
    for j, layer in enumerate(past.layers):
        buffers = []
        for cached, attr in ((some.keys[j], "keys"), (some.values[j], "values")):
            _, heads, _, dim = cached.shape
            buffers.append(cached.new_empty(len(hits), heads, width + room + HEADROOM, dim))
            _write_hits(buffers[-1], hits, kept, j, attr, width)
        layer.preset(buffers[0], buffers[1], width)


def _write_hits(rows: torch.Tensor, hits: list[Hit | None], kept: list[int], layer: int, attr: str, end: int) -> None:
    """Row i of ``rows`` (``[len(hits), heads, >= end, dim]``): ``hits[i]``'s first ``kept[i]`` cached keys or
    values (``attr``) of ``layer`` ending at column ``end``, zeros before them (padding is read, masked: never
    left uninitialised); what follows ``end`` is the prefill's to write."""
    for row, (hit, k) in enumerate(zip(hits, kept)):
        rows[row, :, :end - k].zero_()
        if hit is not None and k:
            rows[row, :, end - k:end] = getattr(hit, attr)[layer][0, :, :k]


def read_hits_below(batch: Any, width: int, past: Any, hits: list[Hit | None], kept: list[int], cached: int, *,
                    room: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``read_hits`` for new rows joining a running ``batch`` (``width`` positions): one buffer per layer holds
    the batch's rows and, below them, the new ones, left-padded to ``W = max(width, cached + room)``. The
    batch's rows are copied in (each layer's old buffers freed before the next layer's are made) and its
    layers hold them there, as before (a prefill that fails leaves the batch as it was); the new rows' cached
    tokens are copied in and ``past``'s layers hold the new rows' part, which their prefill appends to. Returns
    ``W`` and the buffers, which ``hold_all`` gives the batch once the prefill succeeded. The new rows' cached
    keys and values are copied once: reading them into a cache of their own, then stacking it below the
    batch's, copied them twice (8 same documents again on SmolLM2: ``bench/prefix_again.py``)."""
    rows, new, wide = batch.layers[0].keys.shape[0], len(hits), max(width, cached + room)
    start = wide - cached - room  # the new rows' first column
    buffers = []
    for j, (layer, target) in enumerate(zip(batch.layers, past.layers)):
        pair = []
        for old, attr in ((layer.keys, "keys"), (layer.values, "values")):
            buffer = old.new_empty(rows + new, old.shape[1], wide + HEADROOM, old.shape[3])
            buffer[:rows, :, :wide - width].zero_()  # padding is read (masked): never left uninitialised
            buffer[:rows, :, wide - width:wide] = old
            _write_hits(buffer[rows:], hits, kept, j, attr, wide - room)
            pair.append(buffer)
        _release(layer)
        layer.preset(pair[0][:, :, wide - width:][:rows], pair[1][:, :, wide - width:][:rows], width)
        target.preset(pair[0][rows:, :, start:], pair[1][rows:, :, start:], cached)
        buffers.append((pair[0], pair[1]))
    return wide, buffers


def hold_all(batch: Any, past: Any, buffers: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
    """The batch's layers hold every row of ``buffers`` (``read_hits_below``), ``width`` positions each."""
    for layer, new, (keys, values) in zip(batch.layers, past.layers, buffers):
        _release(new)
        layer.preset(keys, values, width)


def peak_positions(rows: int, width: int, layers: int) -> int:
    """The most cached positions (one token of one row, in every layer: ``kv_bytes_per_token`` each) that
    the batch's cache holds with ``rows`` rows of at most ``width`` positions: buffers ``HEADROOM`` longer,
    and one layer's buffers twice while that layer grows or rows join or leave (each layer's old buffer is
    freed before the next layer's new one is made). What admission counts against the KV budget."""
    return -(-rows * (width + HEADROOM) * (layers + 1) // layers)


def merged(cache: Any, mask: torch.Tensor, add: Any, add_mask: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The batch's cache and mask with the rows of ``add`` appended below, both left-padded to one width
    (RoPE is already applied to cached keys: padding is safe). ``add``'s layers are emptied as they are
    copied, so that only one layer is ever held twice."""
    if cache is None:
        return add, add_mask
    width = max(mask.shape[1], add_mask.shape[1])
    for old, new in zip(cache.layers, add.layers):
        # one copy, into buffers the next decode steps append to
        old.preset(_stacked(old.keys, new.keys, width), _stacked(old.values, new.values, width), width)
        _release(new)
    return cache, torch.cat([left_pad(mask, width), left_pad(add_mask, width)])


def truncate(cache: Any, n: int) -> None:
    """Cut every layer of ``cache`` back to its first ``n`` positions (what a failed forward appended goes;
    the next update appends after them in place)."""
    for layer in cache.layers:
        if layer.keys is not None:
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def keep_verified(cache: Any, mask: torch.Tensor, width: int, kept: list[int]) -> torch.Tensor:
    """After a verification step (``speculative.py``): row i keeps the first ``kept[i]`` of the positions the
    step appended after column ``width`` (its rejected drafts go). Rows that keep fewer than the most are
    moved right, in place in their buffers, so every row still ends at the last column; the new columns
    on their left are zeroed padding. Columns that are then padding in every row go (rows whose accepted
    runs alternate would grow them at every step): the layers' buffers start after them, no copy. Returns
    the batch's new mask."""
    most, rows = max(kept), len(kept)
    end = width + most
    shifts = [(i, most - k) for i, k in enumerate(kept) if k < most]
    out = mask.new_zeros(rows, end)
    for i, k in enumerate(kept):
        out[i, most - k:] = mask[i, :width + k]
    lead = all_pad_columns(out)
    for layer in cache.layers:
        for x in (layer.keys, layer.values):
            for i, shift in shifts:
                x[i, :, shift:end] = x[i, :, :end - shift].clone()
                x[i, :, :shift].zero_()
        _cut(layer, lead, end)
    return out[:, lead:]


def _cut(layer: Any, lead: int, end: int) -> None:
    """``layer`` holds its columns ``lead`` .. ``end``; a ``GrowingLayer`` whose keys are its buffers' view keeps
    appending in place after them (its buffers start at ``lead``)."""
    buffers = getattr(layer, "_buffers", None)
    if lead and buffers is not None and _views(layer.keys, buffers[0], end):
        layer._buffers = (buffers[0][:, :, lead:], buffers[1][:, :, lead:])
        layer.keys, layer.values = layer._buffers[0][:, :, :end - lead], layer._buffers[1][:, :, :end - lead]
    else:
        layer.keys, layer.values = layer.keys[:, :, lead:end], layer.values[:, :, lead:end]


def keep_rows(cache: Any, rows: torch.Tensor, lead: int) -> None:
    """Keep only ``rows`` of every layer of ``cache``, without their first ``lead`` positions: each layer's
    rows copied into a new buffer with ``HEADROOM`` more positions, which replaces the old one before the
    next layer is copied (slicing the cache kept the old buffers alive beside the copies, and the next
    update then made a third: near three times the batch's KV at once)."""
    for layer in cache.layers:
        at = rows.to(layer.keys.device)  # each layer's cache is on its layer's device
        width = layer.keys.shape[2] - lead
        keys, values = _copy_rows(layer.keys, at, lead), _copy_rows(layer.values, at, lead)
        _release(layer)
        layer.preset(keys, values, width)


def _copy_rows(x: torch.Tensor, rows: torch.Tensor, lead: int) -> torch.Tensor:
    out = x.new_empty(len(rows), x.shape[1], x.shape[2] - lead + HEADROOM, x.shape[3])
    torch.index_select(x[:, :, lead:], 0, rows, out=out[:, :, :x.shape[2] - lead])
    return out


def _release(layer: Any) -> None:
    """Drop ``layer``'s references to its tensors (its buffers are freed once nothing else holds them)."""
    layer.keys = layer.values = None
    layer._buffers = None


def _stacked(top: torch.Tensor, below: torch.Tensor, width: int) -> torch.Tensor:
    """``top``'s rows then ``below``'s, each left-padded to ``width`` positions, in a new buffer with
    ``HEADROOM`` more (a padded copy, a concatenation and a grown buffer took three copies before)."""
    rows, heads, _, dim = top.shape
    out = top.new_zeros(rows + below.shape[0], heads, width + HEADROOM, dim)
    out[:rows, :, width - top.shape[2]:width] = top
    out[rows:, :, width - below.shape[2]:width] = below
    return out


def all_pad_columns(mask: torch.Tensor) -> int:
    """How many leading columns of ``mask`` are padding in every row."""
    return int((mask.sum(0) == 0).long().cumprod(0).sum())


def left_pad(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """Left-pad ``x`` with zeros along ``dim`` up to ``width``."""
    return F.pad(x, (0, 0) * (x.dim() - 1 - dim) + (width - x.shape[dim], 0))
