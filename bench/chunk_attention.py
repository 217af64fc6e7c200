"""What a prompt chunk's attention costs in a mixed step (deploykit/engine/mixed.py), in ways torch offers.

    .venv/bin/python bench/chunk_attention.py [--threads 2]

SmolLM2-135M's attention shape (9 query heads, 3 key/value heads of 64, 30 layers, float32): a chunk of
QUERIES new prompt tokens attends over KEYS positions of its prompt (the ones read before and its own),
each query to the positions up to its own. Milliseconds for the 30 layers (each its own cache, so memory
serves them as in a forward), median of 5 rounds: transformers' ``sdpa`` as the mixed step calls it (a bool
mask, the key/value heads repeated per query head); torch's SDPA sharing the key/value heads
(``enable_gqa``) with the mask, and without any mask (the lower bound of masking); two matmuls and a
softmax with the query heads grouped per key/value head. Prints the load average and GFLOPS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def per_forward(fn: Callable[[], None], rounds: int = 5, calls: int = 10) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="1x400,16x400,16x780,24x780,256x780", help="QUERIESxKEYS,...")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    group = HEADS // KV_HEADS
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; threads {torch.get_num_threads()}\n")
    print("| queries x keys | sdpa, heads repeated (transformers) | sdpa, heads shared | sdpa, no mask | "
          "two matmuls | GFLOPS (heads shared) |\n|---|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, total = (int(v) for v in shape.split("x"))
        qs = [torch.randn(1, HEADS, n, DIM) for _ in range(LAYERS)]
        kvs = [(torch.randn(1, KV_HEADS, total, DIM), torch.randn(1, KV_HEADS, total, DIM)) for _ in range(LAYERS)]
        mask = (torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None])[None, None]
        additive = torch.zeros(n, total).masked_fill(~mask[0, 0], float("-inf"))

        def repeated() -> None:
            for q, (k, v) in zip(qs, kvs):
                F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                               attn_mask=mask)

        def shared(masked: bool = True) -> None:
            for q, (k, v) in zip(qs, kvs):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None, enable_gqa=True)

        def matmuls() -> None:
            for q, (k, v) in zip(qs, kvs):
                scores = torch.baddbmm(additive.repeat(KV_HEADS, group, 1), q.view(KV_HEADS, group * n, DIM),
                                       k[0].transpose(1, 2), alpha=DIM ** -0.5)
                torch.bmm(scores.softmax(-1), v[0])

        times = [per_forward(repeated), per_forward(shared), per_forward(lambda: shared(False)), per_forward(matmuls)]
        flops = LAYERS * HEADS * n * total * DIM * 4
        print(f"| {n} x {total} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {flops / times[1] / 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
