"""Where int8's two CPU kernels cross over in a whole forward: SmolLM2-135M with deploykit's int8 layers and
head, one forward of ROWS new tokens, with the weight-only kernel (``torch._weight_int8pack_mm``) for every
row count against the weights dequantized to bfloat16 for one GEMM above ``_SMALL`` rows.

    .venv/bin/python bench/int8_rows.py [--rows 16,26,34,40,48,64,80,96,128 --runs 3]

A single layer's kernels (``bench/quantize_kernels.py``) run with its weight in the CPU's caches; a whole
forward reads 135 MB of weights from memory, which is what a served step does. Milliseconds per forward
(median of --runs rounds, each the median of 5 forwards after 2 warm-ups; the two choices alternated
within a round); prints the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,26,34,40,48,64,80,96,128")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from openmp_teams import int8_model
    from transformers import DynamicCache

    import deploykit.engine.quantized as quantized

    model = int8_model()
    quantized.quantize_head(model, "causal-lm", "int8")
    chosen = quantized._SMALL

    def forward(rows: int, small: int) -> float:
        quantized._SMALL = small
        times = []
        with torch.inference_mode():
            for i in range(7):
                ids = torch.randint(100, 40000, (1, rows))
                start = time.perf_counter()
                model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                      logits_to_keep=1)
                times.append(time.perf_counter() - start)
        return statistics.median(times[2:]) * 1e3

    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; threads {torch.get_num_threads()}; "
          f"deploykit's _SMALL {chosen}\n")
    print("| rows | weight-only kernel ms | dequantized + bfloat16 GEMM ms |\n|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        kernel, dequantized = [], []
        for run in range(args.runs):
            # _SMALL 1: every layer of more than one row dequantizes; the head, which keeps one row, does not
            for small in ((1 << 20, 1) if run % 2 == 0 else (1, 1 << 20)):
                (kernel if small > 1 else dequantized).append(forward(rows, small))
        print(f"| {rows} | {statistics.median(kernel):.1f} | {statistics.median(dequantized):.1f} |", flush=True)
    quantized._SMALL = chosen
    print(f"\nload average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
