"""The size of the continuous backend's paged KV cache, by transformers' own memory arithmetic.

When its manager starts, transformers (``PagedAttentionMemoryHandler._check_footprint``) refuses a cache
whose *footprint* exceeds the memory it sees: the cache itself plus every tensor that scales with it — per
cached token the keys and values read back at the attention peak (eager/sdpa repeat the KV heads to every
query head) and its read indices, the ``[M, N + M]`` attention masks, the batch's activations and IO. For
Llama-3.2-1B that is ~1.3x the K and V bytes per cached token, so a cache sized from K and V alone does not
start. Here the handler itself computes the footprint of a candidate size — its geometry taken from a
``PagedAttentionCache`` built on the meta device, which holds no memory — and the cache gets the most
sectors whose footprint fits the budget, and no more than the engine can use: ``max_batch_size`` requests
of the longest context it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil
from typing import Any


@dataclass(frozen=True)
class PagedCacheSize:
    num_blocks: int  # ContinuousBatchingConfig.num_blocks: whole-model blocks of page_size tokens
    tokens: int  # tokens the cache holds (num_blocks x page_size)
    footprint: int  # transformers' computed footprint of this size, bytes
    budget: int  # what it had to fit in


def footprint_handler(model: Any, config: Any) -> Any:
    """transformers' ``PagedAttentionMemoryHandler`` for ``model`` under ``config`` (a
    ``ContinuousBatchingConfig`` whose ``max_memory_percent`` is set), with the sector geometry its
    ``PagedAttentionCache`` computes (built here on the meta device)."""
    from transformers.generation.continuous_batching.cache import (
        FullAttentionCacheAllocator, PagedAttentionCache, PagedAttentionMemoryHandler, find_head_dim,
        find_num_key_value_heads)
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text = model.config.get_text_config()
    logits_to_keep = getattr(model, "_supports_logits_to_keep", None)
    keeps = callable(logits_to_keep) and bool(logits_to_keep())
    geometry = PagedAttentionCache(text, replace(config, num_blocks=1), device="meta",
                                   distributed_helper=DistributedHelper(None, None), dtype=model.dtype,
                                   model_supports_logits_to_keep=keeps)
    # the cache's own bytes_per_block (PagedAttentionCache.__init__ keeps it local): K and V of every layer
    bytes_per_block = text.num_hidden_layers * FullAttentionCacheAllocator.get_bytes_per_page(
        find_num_key_value_heads(text), find_head_dim(text), model.dtype, config.page_size)
    return PagedAttentionMemoryHandler(
        config=text, cb_config=config, dtype=model.dtype, bytes_per_sector=geometry.bytes_per_sector,
        tokens_per_sector=geometry.tokens_per_sector, bytes_per_block=bytes_per_block,
        attn_types=list(geometry.cache_allocators), model_supports_logits_to_keep=keeps)


def paged_cache_size(model: Any, config: Any, *, budget: int, max_tokens: int) -> PagedCacheSize:
    """The ``num_blocks`` for ``config`` (page size, ``max_batch_tokens``, requests per batch, memory percent
    set) whose footprint fits both ``budget`` and the memory transformers sees, holding at most
    ``max_tokens`` tokens. ValueError when not even one block fits."""
    handler = footprint_handler(model, config)
    budget = min(budget, handler.available_memory)
    m = config.max_batch_tokens
    # the footprint is linear in the sectors (the masks too: M x (sectors x tokens_per_sector + M))
    fixed = handler.compute_memory_footprint(m, 0)
    per_sector = handler.compute_memory_footprint(m, 1) - fixed
    sectors = min((budget - fixed) // per_sector, ceil(max_tokens / handler.tokens_per_sector))
    num_blocks = sectors * handler.bytes_per_sector // handler.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"transformers' continuous batching needs {fixed + per_sector} bytes for one cache block "
                         f"of {config.page_size} tokens (batch of {m} tokens), more than the {budget} bytes left for "
                         "it; use spec.serving.batching: padded or give the tier more memory")
    sized = replace(config, num_blocks=num_blocks)
    handler.cb_config = sized
    footprint = handler.compute_memory_footprint(m, handler.num_sectors_from_config())
    return PagedCacheSize(num_blocks, num_blocks * config.page_size, footprint, budget)
