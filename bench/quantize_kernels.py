"""The matmul kernels deploykit's QuantizedLinear chooses between, on one SmolLM2 MLP shape, side by side.

    .venv/bin/python bench/quantize_kernels.py

Microseconds per call (median of --runs rounds, each the mean of --calls calls, options alternated
within a round) of y = x @ W.T for W of shape [out, in] (default 1536 x 576, SmolLM2's gate/up
projection) and x of ROWS rows: float32 ``F.linear`` (the reference); ``torch._weight_int8pack_mm`` with
float32 and with bfloat16 activations; int8 weights dequantized to bfloat16 then ``F.linear`` in
bfloat16 (what deploykit runs above ``_SMALL`` rows); the same with the weights converted and the outputs
scaled; activations quantized to int8 per row and ``torch._int_mm`` (int8 x int8; not used: it costs
SmolLM2's answers, ``bench/activation_int8.py``); ``torch._weight_int4pack_mm_for_cpu`` with bfloat16 activations. Prints the load average.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from activation_int8 import per_token_int8  # noqa: E402


def per_call(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=int, default=1536)
    parser.add_argument("--in", dest="inputs", type=int, default=576)
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads; 1 gives steadier figures on a shared, loaded machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out, inputs, group = args.out, args.inputs, 32
    w = torch.randn(out, inputs) * 0.05
    scale = w.abs().amax(1) / 127
    q8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    groups = w.reshape(out, -1, group)
    low, high = groups.amin(-1), groups.amax(-1)
    s4 = (high - low) / 15
    z4 = low + 8 * s4
    q4 = torch.round((groups - z4[..., None]) / s4[..., None] + 8).clamp(0, 15).to(torch.int32).reshape(out, inputs)
    packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([s4.t(), z4.t()], -1).to(torch.bfloat16).contiguous()
    sb = scale.to(torch.bfloat16)
    print(f"load average before: {Path('/proc/loadavg').read_text().strip()}  threads: {torch.get_num_threads()}")
    print(f"| rows | float32 | int8 kernel, float32 in | int8 kernel, bfloat16 in | int8 dequantized, bfloat16 "
          f"GEMM | int8 converted, GEMM, outputs scaled | int8 activations, _int_mm | int4 kernel, bfloat16 in |\n"
          f"|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, inputs)
        options = {
            "f32": lambda: F.linear(x, w),
            "int8_f32": lambda: torch._weight_int8pack_mm(x, q8, scale),
            "int8_bf16": lambda: torch._weight_int8pack_mm(x.bfloat16(), q8, sb).float(),
            "int8_deq": lambda: F.linear(x.bfloat16(), q8.bfloat16() * sb[:, None]).float(),
            "int8_cvt": lambda: (F.linear(x.bfloat16(), q8.bfloat16()) * sb).float(),
            "int8_a8": lambda: per_token_int8(x, q8, scale),
            "int4_bf16": lambda: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, group, sz).float(),
        }
        times: dict[str, list[float]] = {k: [] for k in options}
        for _ in range(args.runs):
            for name, fn in options.items():
                times[name].append(per_call(fn, args.calls if rows <= 64 else max(5, args.calls // 5)))
        cells = [f"{statistics.median(times[k]):.0f}" for k in options]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
