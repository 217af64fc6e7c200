"""The same documents sent again, in one process on SmolLM2 with int8 linears and head (as
``spec.model.quantization: int8`` serves it): 2 streams run, 8 distinct ~750-token documents are read
(16 tokens each), then the same 8 again, all at once. Reports the second time's TTFT p50 and how long the
step that joined them took, three ways, alternated in every round (the load average is printed):

- ``blocks``: the prefix cache matched by whole blocks of 16 tokens only, and the cached keys read into a
  cache of the new rows' own, then stacked below the running rows' (two copies): deploykit before;
- ``tokens``: matched to the token (``deploykit/engine/prefixcache.py``), still two copies;
- ``tokens, one copy``: and read straight into the batch's buffers (``kvcache.read_hits_below``): deploykit now.

    .venv/bin/python bench/prefix_again.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from mixed_prefill import WORDS, load  # noqa: E402

from deploykit.engine import batch_rows, padded, prefixcache  # noqa: E402
from deploykit.engine.batching import Engine, GenerationRequest, GenerationResult  # noqa: E402
from deploykit.engine.kvcache import read_hits, read_hits_below  # noqa: E402

SHARED, JOINS = prefixcache._shared, []  # seconds of each join step of the second reading


def by_blocks(kept: Any, prompt: Any, start: int, most: int) -> int:
    return start  # whole blocks only


def two_copies(cache: Any, width: int, past: Any, hits: Any, kept: Any, cached: int, *, room: int) -> None:
    read_hits(past, hits, kept, cached, room=room)  # into the new rows' own cache; stacked below afterwards
    return None


def timed_join(*args: Any) -> Any:
    start = time.perf_counter()
    out = JOIN(*args)
    JOINS.append(time.perf_counter() - start)
    return out


JOIN, padded.join = padded.join, timed_join


def one_round(model: Any, tokenizer: Any, way: str, seed: int) -> tuple[float, float]:
    """(the second reading's TTFT p50, its join steps' seconds in all)."""
    prefixcache._shared = by_blocks if way == "blocks" else SHARED
    batch_rows.read_hits_below = read_hits_below if way == "tokens, one copy" else two_copies
    rng = random.Random(seed)
    docs = [tokenizer(" ".join(rng.choice(WORDS) for _ in range(700)))["input_ids"][:750] for _ in range(8)]
    started, count = threading.Event(), [0]

    def listen(event: int | GenerationResult) -> None:
        count[0] += isinstance(event, int)
        if count[0] == 20:
            started.set()

    engine = Engine(model, tokenizer, max_batch_size=16, prefill_chunk=256, kv_cache_bytes=4 << 30,
                    prefix_cache_bytes=1 << 30)
    try:
        ends = tuple((e, -100.0) for e in engine.eos_ids)  # the streams never end by themselves
        streams = [engine.submit(GenerationRequest(prompt_ids=[1, 2, 3 + i], max_new_tokens=2000, logit_bias=ends),
                                 listener=listen if i == 0 else None) for i in range(2)]
        assert started.wait(120)
        for h in [engine.submit(GenerationRequest(prompt_ids=d, max_new_tokens=16)) for d in docs]:
            h.result(timeout=600)
        JOINS.clear()
        again = [h.result(timeout=600) for h in [engine.submit(GenerationRequest(prompt_ids=d, max_new_tokens=16))
                                                 for d in docs]]
        joins = sum(JOINS)
        for s in streams:
            engine.cancel(s)
    finally:
        engine.close(timeout=60)
    return statistics.median(r.time_to_first_token or 0 for r in again), joins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(None)
    ways = ["blocks", "tokens", "tokens, one copy"]
    got: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            ttft, joins = one_round(model, tokenizer, way, seed=r)
            got[way].append(ttft)
            print(f"round {r} {way}: the same 8 documents again, TTFT p50 {1000 * ttft:.0f} ms (join steps "
                  f"{1000 * joins:.0f} ms); load {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for way in ways:
        print(f"{way}: median {1000 * statistics.median(got[way]):.0f} ms over {len(got[way])} rounds")


if __name__ == "__main__":
    main()
