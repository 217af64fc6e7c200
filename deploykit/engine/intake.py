"""New requests into the padded loop (``padded.py``): which waiting requests the batch takes (FIFO, within
the batch-size and KV-byte budgets), the answers that need no decoding (prompt logprobs, ``max_new_tokens``
0), and how each prompt is read: in the next join step with other short ones (``batch_rows.py``) when what is
left of it after the beginning the prefix cache holds (``prefixcache.py``) fits one chunk, else alone in
chunks (``prefill.py``) between or beside the running rows' decode steps.
"""

from __future__ import annotations

from ..spec.speculative import verification_room
from .admission import Admission
from .forwards import Forwards
from .kvcache import peak_positions
from .prefill import Prefill
from .prefixcache import Hit, PrefixCache
from .requests import RequestHandle


class Intake:
    """The admission and start of the padded loop's new requests; ``hits`` holds each routed short request's
    cached beginning (request id -> its hit) until its join step takes it."""

    def __init__(self, queue: Admission, fw: Forwards, *, max_batch_size: int, kv_cache_bytes: int,
                 kv_bytes_per_token: int, layers: int, prefix: PrefixCache | None, prefill_chunk: int,
                 draft_tokens: int = 0) -> None:
        self._queue, self._fw = queue, fw
        self.max_batch_size, self.kv_cache_bytes = max_batch_size, kv_cache_bytes
        self.kv_bytes_per_token, self._layers = kv_bytes_per_token, layers
        self.prefix, self.prefill_chunk = prefix, prefill_chunk
        self.hits: dict[str, Hit] = {}
        self.draft_tokens = draft_tokens  # spec.speculative.num_tokens (0: no speculation)

    def admit(self, rows: list[RequestHandle], width: int) -> list[RequestHandle]:
        """Pop waiting requests (FIFO) that fit the batch-size and KV-byte budgets."""
        def size(h: RequestHandle) -> int:
            return len(h.request.prompt_ids) + h.request.max_new_tokens

        def fits(taken: list[RequestHandle], h: RequestHandle) -> bool:
            need = [size(r) for r in rows + taken]
            # the padded cache if all rows run to the end, with its headroom and one layer in transit
            room = verification_room(self.draft_tokens, len(need) + 1) if self.draft_tokens else 0  # drafts' positions
            worst = peak_positions(len(need) + 1, width + max(need + [size(h)]) + room, self._layers)
            return not need or worst * self.kv_bytes_per_token <= self.kv_cache_bytes  # else wait for rows to end

        return self._queue.take(self.max_batch_size - len(rows), fits)

    def start(self, new: list[RequestHandle]) -> list[RequestHandle]:
        """Answer what needs no decoding (prompt logprobs, ``max_new_tokens`` 0); the rest will decode."""
        keep = []
        for h in new:
            try:
                if h.request.prompt_logprobs is not None:
                    h.prompt_logprobs = self._fw.prompt_logprobs(h.request)
                if h.request.max_new_tokens == 0:
                    h.finish("length")
                else:
                    keep.append(h)
            except Exception as exc:  # this request fails, the batch goes on
                h.finish("error", repr(exc))
        return keep

    def route(self, new: list[RequestHandle]) -> tuple[list[RequestHandle], list[Prefill]]:
        """Which new requests join the batch in one padded prefill (what is left to compute of their prompt,
        after any cached beginning, fits one chunk), and which are read alone in chunks (``prefill.py``)."""
        short, alone = [], []
        for h in new:
            prompt = h.request.prompt_ids
            # a prefix's KV depends on the adapter it was computed with: found under the row's own slot only
            hit = self.prefix.lookup(prompt, h.request.adapter or "") if self.prefix is not None else None
            if len(prompt) - (hit.tokens if hit else 0) <= self.prefill_chunk:
                short.append(h)
                if hit is not None:
                    self.hits[h.id] = hit
            else:
                alone.append(Prefill(h, self._fw.model.config, hit))
        return short, alone
