"""Balance of GPU splits: deploykit vs accelerate ("balanced") vs niuload, against the optimum.

    .venv/bin/python bench/balance.py            # full table (about a minute)
    .venv/bin/python bench/balance.py --quick    # two models

For each model shape (config.json only, from manifests/configs/) and each GPU set-up (2, 4, 8 equal
GPUs of 80 GiB, and 4 GPUs with ratios 0.5:1:1:1), every tool's device_map is scored the same way:
the bytes of every parameter at float16 are summed per device, and the *bottleneck factor* is
max_i(share_i / target_share_i) -- 1.0 is perfect balance, 1.10 means the most loaded GPU holds 10%
more than its fair share. "optimum" is the best factor any contiguous split with the embeddings on
GPU 0 can reach at block granularity, found by an independent method (parametric search over all
candidate thresholds with a greedy check), not by deploykit's DP.

How each tool is asked (what a user would write):
- accelerate: ``get_balanced_memory`` + ``infer_auto_device_map`` (= ``device_map="balanced"``); with
  ratios, the balanced per-GPU memory is scaled by ratio_i * n / sum(ratios).
- niuload: ``balanced_load(dir, num_devices=n, ratio=..., return_device_map_only=True)``. niuload builds
  its meta model with ``from_pretrained``, which needs weight files; these shapes have config.json
  only, so the bench hands it the identical meta model built from the config (its split reads only
  parameter counts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ["llama-2-7b", "mistral-7b", "qwen2-7b", "gemma-2b", "gpt2-xl", "llama-2-70b"]
SETUPS = [("2 GPUs", [1.0] * 2), ("4 GPUs", [1.0] * 4), ("8 GPUs", [1.0] * 8),
          ("4 GPUs 0.5:1:1:1", [0.5, 1.0, 1.0, 1.0])]
GPU_MEMORY = 80 * 2**30


def bytes_by_device(model, device_map: dict) -> dict:
    """Bytes of every distinct parameter and buffer (floating ones at float16), by device."""
    out: dict = {}
    seen: set[int] = set()
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        parts = name.split(".")
        device = next((device_map[".".join(parts[:i])] for i in range(len(parts), 0, -1)
                       if ".".join(parts[:i]) in device_map), device_map.get(""))
        out[device] = out.get(device, 0) + t.numel() * (2 if t.is_floating_point() else t.element_size())
    return out


def embeddings_on_first(model, device_map: dict) -> bool:
    name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    parts = name.split(".")
    device = next((device_map[".".join(parts[:i])] for i in range(len(parts), 0, -1)
                   if ".".join(parts[:i]) in device_map), device_map.get(""))
    return device == 0


def score(model, device_map: dict, ratios: list[float]) -> str:
    f, off = factor(bytes_by_device(model, device_map), ratios)
    marks = (" +offload" if off else "") + ("" if embeddings_on_first(model, device_map) else " *")
    return f"{f:.4f}{marks}"


def factor(by_device: dict, ratios: list[float]) -> tuple[float, int]:
    """(bottleneck factor over the GPUs, bytes placed off the GPUs)."""
    gpu = {d: b for d, b in by_device.items() if isinstance(d, int)}
    off = sum(b for d, b in by_device.items() if not isinstance(d, int))
    total, rsum = sum(gpu.values()), sum(ratios)
    return max(gpu.get(i, 0) / total / (r / rsum) for i, r in enumerate(ratios) if r > 0), off


def optimum(sizes: list[int], ratios: list[float], first: int) -> float:
    """Independent exact min-max: try every candidate threshold, check it greedily, take the least."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    candidates = sorted({(prefix[b] - prefix[a]) / r for r in ratios for a in range(n + 1)
                         for b in range(a, n + 1)})

    def feasible(t: float) -> bool:
        pos = 0
        for k, r in enumerate(ratios):
            start = prefix[pos]
            while pos < n and (prefix[pos + 1] - start) / r <= t:
                pos += 1
            if k == 0 and pos < first:
                return False
        return pos == n

    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    total = prefix[-1]
    return candidates[lo] / (total / sum(ratios))


def accelerate_map(model, ratios: list[float]) -> dict:
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    n = len(ratios)
    no_split = list(model._no_split_modules or [])
    max_memory = {i: GPU_MEMORY for i in range(n)}
    import torch

    balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                   dtype=torch.float16, low_zero=False)
    if len(set(ratios)) > 1:
        balanced = {k: (int(v * ratios[k] * n / sum(ratios)) if isinstance(k, int) else v)
                    for k, v in balanced.items()}
    return infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split,
                                 dtype=torch.float16)


@contextlib.contextmanager
def niuload_sees_meta_models(config):
    """niuload calls ``AutoModelForCausalLM.from_pretrained(dir)`` under init_empty_weights; give it
    the same model from the config, since these directories hold no weights."""
    import transformers

    original = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        return transformers.AutoModelForCausalLM.from_config(config)

    transformers.AutoModelForCausalLM.from_pretrained = from_pretrained
    try:
        yield
    finally:
        transformers.AutoModelForCausalLM.from_pretrained = original


def niuload_map(model_dir: Path, config, ratios: list[float]) -> dict | str:
    from niuload import balanced_load

    with niuload_sees_meta_models(config), contextlib.redirect_stdout(io.StringIO()):
        try:
            return balanced_load(str(model_dir), num_devices=len(ratios),
                                 ratio=list(ratios) if len(set(ratios)) > 1 else None,
                                 return_device_map_only=True)
        except BaseException as exc:  # niuload drops into pdb on some corner cases
            return f"fails ({type(exc).__name__})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two models only")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # accelerate: "Device N is not available" on a host without GPUs
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from deploykit.placement.inventory import parse_devices
    from deploykit.spec.schema import Spec
    from deploykit.placement.planner import plan
    from deploykit.model.structure import build_meta_model, load_config, structure_from_model

    transformers.logging.set_verbosity_error()
    table = Table(title="Bottleneck factor (1.0 = perfect; lower is better) and plan time")
    for col in ("model", "GPUs", "optimum", "deploykit", "accelerate", "niuload", "deploykit plan()",
                "accelerate plan"):
        table.add_column(col, justify="left" if col in ("model", "GPUs") else "right")
    all_optimal = True
    models = MODELS[:2] if args.quick else MODELS
    for name in models:
        model_dir = ROOT / "manifests" / "configs" / name
        config = load_config(model_dir)
        model = build_meta_model(config, task="causal-lm")
        structure = structure_from_model(model, task="causal-lm", dtype="float16")
        sizes = [b.weight_bytes for b in structure.blocks]
        for label, ratios in SETUPS:
            n = len(ratios)
            spec = Spec.model_validate({"model": {"path": str(model_dir)}, "placement": {
                "gpus": list(range(n)), "ratios": ratios, "reserve": 0}})
            inventory = parse_devices(f"{n}x80GiB")
            start = time.perf_counter()
            p = plan(structure, spec, inventory)
            dk_time = time.perf_counter() - start
            dk, _ = factor(bytes_by_device(model, p.device_map), ratios)
            best = optimum(sizes, ratios, structure.embedding_block + 1)
            all_optimal &= abs(dk - best) < 1e-9 and embeddings_on_first(model, p.device_map)
            start = time.perf_counter()
            acc_map = accelerate_map(model, ratios)
            acc_time = time.perf_counter() - start
            niu = niuload_map(model_dir, config, ratios)
            niu_text = niu if isinstance(niu, str) else score(model, niu, ratios)
            table.add_row(name, label, f"{best:.4f}", f"{dk:.4f}", score(model, acc_map, ratios), niu_text,
                          f"{dk_time * 1000:.0f} ms", f"{acc_time * 1000:.0f} ms")
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    console = Console(width=140)
    console.print(table)
    console.print("* the input embeddings are not on GPU 0 (the split breaks `embeddings: first`)")
    console.print(f"deploykit equals the optimum in every case: {'yes' if all_optimal else 'NO'}")


if __name__ == "__main__":
    main()
