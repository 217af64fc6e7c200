"""The quantized linears' CUDA kernels against dequantizing per call (what ran on CUDA before them) and
against the plan: one layer of each of Llama-3.2-1B's MLP shapes at bfloat16, random weights quantized as
the reshard does, for 1, 16 and 256 rows (decode steps and a prefill). Reported per scheme, shape and rows:
microseconds per call (median of a few CUDA-synchronised runs) of bfloat16 ``F.linear``, the dequantize
path and the kernel path, and, for int8, torch's ``_weight_int8pack_mm`` (a candidate, not used); judged:
the kernel path's output against the dequantize path's, and the GPU bytes a prepared layer holds against
the plan's (``quantized_nbytes``). The dry run runs the same code on the CPU with a small shape (its
kernels are the CPU ones; nothing is judged on speed or bytes there).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from ..context import Context
from ..record import Recorder

SHAPES = ((8192, 2048), (2048, 8192))  # [out, in]: Llama-3.2-1B's up/gate and down projections
DRY_SHAPES = ((256, 128),)
ROWS = (1, 16, 256)
RUNS, WARMUP = 20, 3


def run(ctx: Context, rec: Recorder) -> None:
    import torch

    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for scheme in ("int8", "int4"):
        for shape in DRY_SHAPES if ctx.dry else SHAPES:
            found = rec.attempt(_layer, ctx, rec, scheme, shape)
            if found is not None:
                rows.extend(found)
                rec.metric("layers", rows)


def _layer(ctx: Context, rec: Recorder, scheme: str, shape: tuple[int, int]) -> list[dict[str, Any]]:
    import torch
    from torch.nn import functional as F

    from deploykit.artifacts.quantize import quantize_rows
    from deploykit.engine.quantized import QuantizedLinear
    from deploykit.model.quantization import quantized_nbytes

    out, inputs = shape
    dtype = torch.bfloat16
    device = torch.device(ctx.device)
    weight = torch.randn(out, inputs, device=device) / inputs ** 0.5
    stored = quantize_rows(weight, scheme, dtype)
    dense = weight.to(dtype)
    dequantize = _layer_from(QuantizedLinear, stored, shape, scheme, dtype)  # never prepared: per call
    before = torch.cuda.memory_allocated(device) if not ctx.dry else 0
    kernel = _layer_from(QuantizedLinear, [t.clone() for t in stored], shape, scheme, dtype)
    kernel.prepare()
    held = torch.cuda.memory_allocated(device) - before if not ctx.dry else None
    planned = quantized_nbytes(shape, scheme, "bfloat16")
    name = kernel.kernel.name if kernel.kernel is not None else "cpu"
    label = f"{scheme} {out}x{inputs}"
    if ctx.dry:
        rec.skip(f"{label}: GPU bytes of the prepared layer equal the plan's", "dry run: no GPU")
    else:
        rec.expect(f"{label}: GPU bytes of the prepared layer equal the plan's", held == planned,
                   f"{held} bytes held, {planned} planned ({name})")
    results = []
    for n in ROWS:
        x = torch.randn(n, inputs, device=device, dtype=dtype)
        with torch.no_grad():
            want, got = dequantize(x).float(), kernel(x).float()
            error = float((got - want).norm() / want.norm())
            row = {"scheme": scheme, "shape": [out, inputs], "rows": n, "kernel": name,
                   "relative_error": round(error, 5), "held_bytes": held, "plan_bytes": planned,
                   "us_bfloat16": _time(ctx, lambda: F.linear(x, dense)),
                   "us_dequantize": _time(ctx, lambda: dequantize(x)),
                   "us_kernel": _time(ctx, lambda: kernel(x))}
            if scheme == "int8":
                row["us_int8pack_mm"] = _int8pack(ctx, x, stored)
        row["kernel_vs_dequantize"] = round(row["us_dequantize"] / row["us_kernel"], 2)
        row["kernel_vs_bfloat16"] = round(row["us_bfloat16"] / row["us_kernel"], 2)
        rec.expect(f"{label}, {n} rows: the kernel path equals dequantizing (relative error <= 1e-2)",
                   error <= 1e-2, f"{error:.2e}; {row['us_kernel']} us vs {row['us_dequantize']} us dequantizing, "
                   f"{row['us_bfloat16']} us at bfloat16")
        results.append(row)
    return results


def _layer_from(cls: Any, stored: list[Any], shape: tuple[int, int], scheme: str, dtype: Any) -> Any:
    import torch
    from torch import nn

    out, inputs = shape
    with torch.device("meta"):  # the stored tensors replace every parameter: nothing allocated twice
        layer = cls(inputs, out, bias=False, scheme=scheme, dtype=dtype)
    layer.weight = nn.Parameter(stored[0], requires_grad=False)
    layer.weight_scale = nn.Parameter(stored[1], requires_grad=False)
    if scheme == "int4":
        layer.weight_zero = nn.Parameter(stored[2], requires_grad=False)
    return layer


def _int8pack(ctx: Context, x: Any, stored: list[Any]) -> float | str:
    import torch

    try:
        return _time(ctx, lambda: torch._weight_int8pack_mm(x, stored[0], stored[1].to(x.dtype)))
    except RuntimeError as exc:  # not every build has it for this device and dtype: reported, not judged
        return f"unavailable: {str(exc)[:120]}"


def _time(ctx: Context, fn: Callable[[], Any]) -> float:
    """Median microseconds per call of ``fn``, synchronising CUDA around each run."""
    import torch

    sync = (lambda: None) if ctx.dry else torch.cuda.synchronize
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(3 if ctx.dry else RUNS):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return round(statistics.median(samples), 1)
