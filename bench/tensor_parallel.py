"""Tensor parallelism on this CPU: per-token latency and tokens/s of 2 rank processes (started by
deploykit, gloo) against one process holding the whole model, and each rank's peak RSS.
Run: .venv/bin/python bench/tensor_parallel.py [--layers 4 --hidden 1024 --tokens 32 --runs 3]

The contenders (one process with 2 torch threads, the same with 1 thread, 2 ranks of 1 thread each) decode the same prompt greedily through the same ``step(group, ids, mask, positions)``
interface the serving engine drives (outputs checked equal); they are loaded once and then run
alternately, ``--runs`` times each; the table gives the median of the runs. The machine's load average is
printed before and after: on a shared 2-core host the figures move with it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import build, timed_greedy  # noqa: E402
from common import print_measures  # noqa: E402


class OneProcess:
    """The whole model in this process, stepped like the ranks (a DynamicCache per group)."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.caches: dict = {}
        self.threads = threads

    def step(self, group: str, ids, mask, positions):
        import torch
        from transformers import DynamicCache

        torch.set_num_threads(self.threads)
        with torch.inference_mode():
            cache = self.caches.setdefault(group, DynamicCache(config=self.model.config))
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].float()

    def release(self, group: str) -> None:
        self.caches.pop(group, None)


_ONE_PROCESS_RSS = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.inference_mode():
    model(torch.tensor([[1, 2, 3]]))
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def one_process_rss(model_dir: Path) -> int:
    """Peak RSS of a fresh process that loads the model and runs one forward (what one process costs)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _ONE_PROCESS_RSS, str(model_dir)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[:3].__str__()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import torch

    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.engine.tensor_parallel.group import RankGroup
    from deploykit.engine.tensor_parallel.runtime import RankOptions, rank_specs
    from deploykit.model.checkpoint import open_checkpoint

    before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "model", args.layers, args.hidden)
        size = (model_dir / "model.safetensors").stat().st_size
        checkpoint = open_checkpoint(model_dir)
        t0 = time.perf_counter()
        shards = write_rank_shards(checkpoint, Path(tmp) / "ranks", rank_layout(checkpoint, ranks=2, dtype="float32"))
        t_shards = time.perf_counter() - t0
        one = OneProcess(model_dir, threads=2)
        one_thread = OneProcess(model_dir, threads=1)  # the same weights, stepped with one thread
        one_thread.model = one.model
        one_rss = one_process_rss(model_dir)
        t0 = time.perf_counter()
        group = RankGroup.start(rank_specs(shards, RankOptions(ranks=2, threads=1)))
        t_start = time.perf_counter() - t0
        prompt = [(7 * i + 3) % 32000 for i in range(args.prompt)]
        results: dict[str, list[tuple[float, float]]] = {"one": [], "one-1t": [], "tp": []}
        try:
            reference = None
            for _ in range(args.runs):
                for name, stepper in (("one", one), ("tp", group), ("one-1t", one_thread)):  # alternated
                    t0 = time.perf_counter()
                    tokens, _, steps = timed_greedy(stepper.step, stepper.release, prompt, args.tokens)
                    total = time.perf_counter() - t0
                    reference = reference or tokens
                    assert tokens == reference, f"{name}: greedy tokens differ from the other contender"
                    results[name].append((statistics.median(steps), args.tokens / total))
            infos = group.info()
        finally:
            group.close()
    after = loadavg()
    med = lambda name, i: statistics.median(r[i] for r in results[name])  # noqa: E731
    rows = [("model", f"Llama {args.layers} layers, hidden {args.hidden}, float32, {size / 2**20:.0f} MiB"),
            ("prompt / new tokens", f"{args.prompt} / {args.tokens} (greedy, outputs equal)"),
            ("one process (2 threads): ms/token, median of runs", f"{1000 * med('one', 0):.1f}"),
            ("one process (1 thread): ms/token", f"{1000 * med('one-1t', 0):.1f}"),
            ("TP=2 ranks (1 thread each): ms/token", f"{1000 * med('tp', 0):.1f}"),
            ("one process (2 threads): tokens/s (incl. prefill)", f"{med('one', 1):.1f}"),
            ("one process (1 thread): tokens/s (incl. prefill)", f"{med('one-1t', 1):.1f}"),
            ("TP=2: tokens/s (incl. prefill)", f"{med('tp', 1):.1f}"),
            ("one process (loads the model, one forward): peak RSS, MiB", f"{one_rss / 2**20:.0f}"),
            *[(f"TP=2 rank {i['rank']}: peak RSS, MiB", f"{i['peak_rss'] / 2**20:.0f}") for i in infos],
            ("rank files written, s", f"{t_shards:.1f}"),
            ("2 ranks started (spawn, join, load), s", f"{t_start:.1f}"),
            ("runs per contender (alternated)", str(args.runs)),
            ("load average before / after", f"{before} / {after}")]
    print_measures(rows)


if __name__ == "__main__":
    main()
