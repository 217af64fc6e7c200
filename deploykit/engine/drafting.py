"""The draft model of ``spec.speculative.method: draft`` (transformers engine): loading it, and the drafts it
proposes for each decoding row of the padded loop (``speculative.py`` verifies them).

Two sources (``spec.speculative.draft``):
- ``quantized: int8 | int4``: the serving checkpoint loaded a second time, every linear layer the scheme can
  hold (the head included) quantized in memory with ``model.quantization``'s kernels (``quantized.py``).
- ``path``: a checkpoint directory sharing the model's tokenizer (checked at validation), loaded at the
  model's dtype.
Either lands on the device of the model's first layers.

Drafting: each row has its own KV cache of the draft model (``growing_cache``), and the ids it holds. A row's
draft continues its sequence (prompt and output so far) greedily for up to ``k`` tokens, one forward of the
draft per token, and ends after a token the draft gave less than ``DRAFT_CONFIDENCE``; the first forward computes what the cache lacks: the ids after the longest prefix the cache
shares with the sequence (the cache is cut back to it first, so the positions of rejected drafts go, as
``kvcache.keep_verified`` does for the model's own cache), the whole prompt on the row's first draft. The
draft is deterministic (greedy), so verification's point-mass acceptance keeps every emitted token the
model's own. Rows draft one after another (one row per draft forward), on one CPU thread (``DRAFT_THREADS``):
a draft forward of one row is many small matmuls, which a team of OpenMP threads slows down more than it
speeds them up (SmolLM2-135M on 2 shared cores, ms per drafted token with 2 threads / 1: float32 280 / 81,
int8 1335-1526 / 40, int4 627-1231 / 23-30; the machine was loaded, load average 3.5-5.5).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..model.hf import BUILD_LOCK, quiet_transformers
from .devices import input_device
from .kvcache import growing_cache, returned_cache, truncate, with_cache

log = logging.getLogger(__name__)

DRAFT_THREADS = 1  # torch's intra-op threads while the draft model runs (0: as the engine's forwards)
# a draft stops after a token its model gave less than this probability (transformers' assisted generation
# stops its assistant the same way, ``assistant_confidence_threshold``): the tokens after an unsure one are
# seldom accepted, and each costs a forward of the draft. Lower than transformers' 0.4 because a verification
# forward costs more than a drafted token here: SmolLM2-135M with its int4 self-draft, open chat, 1 client,
# 2 cores (bench/speculative_transformers.py --task chat --drafts int4 --draft-confidence 0,0.1,0.25), the three
# alternated in each of 3 rounds: 0.1 was the fastest in every round, 7% faster than never stopping early
# (1.51x against 1.40x without speculation); 0.25 and 0.4 stopped too soon (more verification forwards)
DRAFT_CONFIDENCE = 0.1


def load_draft(*, checkpoint: Path, path: str | None, quantized: str | None, dtype: torch.dtype,
               device: torch.device, trust_remote_code: bool = False) -> Any:
    """The draft model: ``path``'s checkpoint, or ``checkpoint`` (the serving one) quantized ``quantized``;
    on ``device``, evaluation mode. Raises whatever loading raised (the caller serves without it)."""
    from transformers import AutoModelForCausalLM

    source = Path(path) if path is not None else checkpoint
    with BUILD_LOCK, quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, device_map=str(device),
                                                     trust_remote_code=trust_remote_code)
    model.eval()
    if quantized is not None:
        from .quantized import quantize_linears

        quantize_linears(model, quantized)
    return model


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)  # what the cache holds, one position each
    cache: Any = None


class DraftModel:
    """Greedy drafts of a small (or quantized) model for the padded loop's rows, each row with its own cache
    (used on the loop's thread)."""

    def __init__(self, model: Any, threads: int = DRAFT_THREADS, confidence: float = DRAFT_CONFIDENCE) -> None:
        self.model = model
        self.threads = threads
        self.confidence = confidence  # a draft ends after a token chosen with less probability than this
        self.device = input_device(model)
        self._rows: dict[str, _Row] = {}
        self.positions = _positions(model.config)  # the draft's own context (None: not bounded)
        self.token_seconds: float | None = None  # one draft forward of one row, a running mean

    def keep(self, live: set[str]) -> None:
        """Forget the caches of rows that left the batch."""
        for key in [k for k in self._rows if k not in live]:
            del self._rows[key]

    def cached_positions(self) -> int:
        """Positions the rows' draft caches hold now (each one token in every layer of the draft)."""
        return sum(len(r.ids) for r in self._rows.values())

    @torch.inference_mode()
    def draft(self, key: str, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens the draft model chooses greedily after ``seq`` (row ``key``'s prompt and output
        so far), within the draft's own context (a draft with fewer positions than the model drafts for a
        row only while the row fits in them). A failing draft forward drops the row's cache and drafts
        nothing (the row decodes on)."""
        if self.positions is not None:  # the last drafted token is never fed: positions up to len(seq) + k - 2
            k = min(k, self.positions - len(seq) + 1)
        if k < 1 or not seq:
            return []
        row = self._rows.setdefault(key, _Row())
        before = torch.get_num_threads()
        if self.threads and self.threads != before:
            torch.set_num_threads(self.threads)
        try:
            return self._draft(row, seq, k)
        except Exception as exc:  # the draft is an optimisation: the model's own step still runs
            log.warning("the draft model failed on a row (it decodes without drafts this step): %r", exc)
            self._rows.pop(key, None)
            return []
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _draft(self, row: _Row, seq: list[int], k: int) -> list[int]:
        shared = _common_prefix(row.ids, seq)
        shared = min(shared, len(seq) - 1)  # at least the last id is computed: its logits give the first draft
        if row.cache is None or shared == 0:
            row.cache, shared = growing_cache(self.model.config), 0
        else:
            truncate(row.cache, shared)
        row.ids = list(seq[:shared])
        feed, out = list(seq[shared:]), []
        for i in range(k):
            token, sure = self._next(row, feed)
            out.append(token)  # an unsure token is still proposed: verifying one more position costs little
            if i == k - 1 or not sure:
                break
            feed = [token]
        return out

    def _next(self, row: _Row, feed: list[int]) -> tuple[int, bool]:
        """Compute ``feed`` after what ``row``'s cache holds; the greedy next token, and whether the draft gave
        it at least ``confidence``."""
        n = len(row.ids)
        started = time.perf_counter()
        ids = torch.tensor([feed], device=self.device)
        result = self.model(input_ids=ids, position_ids=torch.arange(n, n + len(feed), device=self.device)[None],
                            use_cache=True, logits_to_keep=1, **with_cache(self.model, row.cache))
        row.cache = returned_cache(result)
        row.ids += feed
        probs = result.logits[0, -1].float().softmax(-1)
        token = int(probs.argmax())
        if len(feed) == 1:  # what one more drafted token costs (a row's catching up is not counted)
            seconds = time.perf_counter() - started
            self.token_seconds = seconds if self.token_seconds is None else 0.8 * self.token_seconds + 0.2 * seconds
        return token, float(probs[token]) >= self.confidence


def _positions(config: Any) -> int | None:
    """How many positions ``config``'s model has (gpt2's ``n_positions`` is its ``max_position_embeddings``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if len(diff) else n
