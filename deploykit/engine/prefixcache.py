"""The prefix cache of one generation: the KV cache of token sequences that finished, kept so that a later
request sharing a prefix with one of them (a shared system prompt, a conversation's earlier turns, the same
document again) prefills only what follows it.

Found by token ids in blocks of ``BLOCK`` tokens (vLLM's automatic prefix caching keys blocks the same way:
the hash of a block chains the hash of every block before it), then token by token: a lookup finds the kept
sequences sharing the longest block-aligned beginning with a prompt, and reuses as much more of the best of
them as still matches, up to the prompt's last token (SGLang's radix cache and llama.cpp's slots match to the
token too). Block-aligned only, the same document sent again recomputed up to 16 tokens per request, and 8
of them joining together a forward of 8 x 16 rows instead of 8 (SmolLM2 int8: 0.24-0.35 s against 0.1 s,
``bench/prefix_again.py``). An entry holds one whole sequence's keys and values for every layer (``[1, kv
heads, tokens, head dim]``, its own contiguous copy); it serves any prefix of itself as a view. Entries are
bounded by ``max_bytes`` and evicted least recently used; a sequence that extends a kept one replaces it.

Keys and values depend on the weights that computed them: every entry is kept under a *key*, the LoRA adapter
slot its row computed with (``adapters.py``: ``name~N``, a new one for each load, so a replaced adapter's
entries are never found by its new version) or ``""`` for the base, and a lookup finds only entries of its own
key (the key seeds the chain of block hashes, as vLLM keys a block's hash by its LoRA id; the stored key is
compared too). ``retain`` drops the entries of slots that left the model.
Written by hand rather than taken from a library: transformers has no prefix cache outside its
continuous-batching manager's paged cache, which deploykit's padded loop does not use.

Owned by the engine's one worker thread; ``stats`` may be read from any thread (plain ints).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import torch

BLOCK = 16  # tokens per indexed block: a sequence is found by its whole blocks, then matched to the token


@dataclass(frozen=True)
class Hit:
    """The first ``tokens`` positions of a prompt, found cached: per layer, keys and values (views)."""

    tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class _Entry:
    ids: tuple[int, ...]
    key: str  # the adapter slot that computed it; "" for the base
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    hashes: list[int]  # of each block prefix, in order
    nbytes: int


class PrefixCache:
    """KV of finished sequences, looked up by the longest shared prefix (see the module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = self.lookups = self.tokens_reused = self.evictions = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[int, dict[int, None]] = {}  # block-prefix hash -> entries holding that prefix
        self._ids = count()

    def lookup(self, prompt: Sequence[int], key: str = "") -> Hit | None:
        """The longest prefix of ``prompt`` cached under ``key`` that leaves at least one token to prefill
        (the model must see the last prompt token to give the first new one)."""
        self.lookups += 1
        hashes = _block_hashes(prompt, (len(prompt) - 1) // BLOCK, key)
        for k in range(len(hashes), 0, -1):
            best, n = None, 0
            for eid in reversed(self._index.get(hashes[k - 1], {})):
                entry = self._entries[eid]
                if entry.key == key and entry.ids[:k * BLOCK] == tuple(prompt[:k * BLOCK]):  # never a collision's
                    shared = _shared(entry.ids, prompt, k * BLOCK, len(prompt) - 1)
                    if shared > n:
                        best, n = eid, shared
            if best is not None:
                entry = self._entries[best]
                self._entries.move_to_end(best)
                self.hits += 1
                self.tokens_reused += n
                return Hit(n, [t[:, :, :n] for t in entry.keys], [t[:, :, :n] for t in entry.values])
        return None

    def insert(self, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor], key: str = "") -> None:
        """Keep the KV of ``ids`` (per layer ``[1, heads, len(ids), dim]``; copied), computed with the adapter
        slot ``key`` ("" for the base). A sequence shorter than one block is not kept (it could not be found)."""
        n = len(ids)
        nbytes = n * sum(k.shape[1] * k.shape[3] * k.element_size() * 2 for k in keys)
        if n < BLOCK or nbytes > self.max_bytes:
            return
        hashes = _block_hashes(ids, n // BLOCK, key)
        head = tuple(ids)
        for eid in list(self._index.get(hashes[-1], {})):  # already kept (or a longer one holds it)
            if self._entries[eid].key == key and self._entries[eid].ids[:n] == head:
                self._entries.move_to_end(eid)
                return
        for k, h in enumerate(hashes):  # kept sequences that this one extends are no longer needed
            for eid in list(self._index.get(h, {})):
                entry = self._entries[eid]
                if entry.key == key and len(entry.ids) // BLOCK == k + 1 and entry.ids == head[:len(entry.ids)]:
                    self._remove(eid)
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.evictions += 1
        eid = next(self._ids)
        self._entries[eid] = _Entry(head, key, [k[:, :, :n].contiguous().clone() for k in keys],
                                    [v[:, :, :n].contiguous().clone() for v in values], hashes, nbytes)
        for h in hashes:
            self._index.setdefault(h, {})[eid] = None
        self.bytes += nbytes

    def retain(self, keys: set[str]) -> None:
        """Drop the entries computed with an adapter slot not in ``keys`` (it left the model)."""
        for eid in [eid for eid, entry in self._entries.items() if entry.key not in keys]:
            self._remove(eid)

    def clear(self) -> None:
        """Drop every entry (the generation is being freed)."""
        self._entries.clear()
        self._index.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_bytes": self.bytes, "prefix_cache_hits": self.hits,
                "prefix_cache_lookups": self.lookups, "prefix_cache_tokens_reused": self.tokens_reused,
                "prefix_cache_evictions": self.evictions}

    def _remove(self, eid: int) -> None:
        entry = self._entries.pop(eid)
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(eid, None)
                if not holders:
                    del self._index[h]
        self.bytes -= entry.nbytes


def _block_hashes(ids: Sequence[int], blocks: int, key: str = "") -> list[int]:
    """The chained hash of each of the first ``blocks`` block prefixes of ``ids``, seeded with ``key``."""
    out, h = [], hash(key)
    for b in range(blocks):
        h = hash((h, tuple(ids[b * BLOCK:(b + 1) * BLOCK])))
        out.append(h)
    return out


def _shared(kept: Sequence[int], prompt: Sequence[int], start: int, most: int) -> int:
    """How many first tokens ``kept`` and ``prompt`` share, at most ``most``, knowing the first ``start`` are."""
    n, end = start, min(len(kept), most)
    while n < end and kept[n] == prompt[n]:
        n += 1
    return n
