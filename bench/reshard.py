"""Resharding a checkpoint: deploykit vs `cp -r` vs transformers vs accelerate, side by side.

    .venv/bin/python bench/reshard.py              # 1.5 GB fp16 Llama, 3 runs each (about 3 minutes)
    .venv/bin/python bench/reshard.py --runs 1

A Llama-shaped checkpoint (hidden 2048, 12 layers, vocab 32000: 1.5 GB at float16, random weights) is
generated once into .bench/. Each contender runs in its own process, from a warm page cache (the
source is read once before every run), into a fresh directory, and ends with `sync` so that every
byte is on disk; wall time and the command's peak RSS (/usr/bin/time) are recorded, median run shown:

- cp:           cp -r SRC OUT && sync
- deploykit:    deploykit reshard SRC OUT --max-shard-size 256MiB -q && sync
- deploykit, again: the same command once more into its finished output (nothing to do)
- deploykit (bf16): the same with --dtype bfloat16 (decodes and converts every tensor, in chunks)
- transformers: from_pretrained(SRC) + save_pretrained(OUT, max_shard_size="256MB")
- accelerate:   from_pretrained(SRC) + Accelerator().save_model(model, OUT, max_shard_size="256MB")
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, WORK, checkpoint, timed, warm  # noqa: E402

LOAD = ("import torch, sys; from transformers import AutoModelForCausalLM; "
        "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16); ")
CONTENDERS = {
    "cp -r + sync": ["bash", "-c", 'cp -r "$0" "$1" && sync'],
    "deploykit reshard": ["bash", "-c", f'"{PY}" -m deploykit.cli reshard "$0" "$1" --max-shard-size 256MiB -q'
                                        ' && sync'],
    "deploykit reshard --dtype bfloat16": [
        "bash", "-c", f'"{PY}" -m deploykit.cli reshard "$0" "$1" --max-shard-size 256MiB --dtype bfloat16 -q'
                      ' && sync'],
    "transformers save_pretrained": [
        PY, "-c", LOAD + "m.save_pretrained(sys.argv[2], max_shard_size='256MB'); import os; os.sync()"],
    "accelerate save_model": [
        PY, "-c", LOAD + "from accelerate import Accelerator; "
                         "Accelerator().save_model(m, sys.argv[2], max_shard_size='256MB'); import os; os.sync()"],
}


def measure(cmd: list[str], src: Path, out: Path, *, fresh: bool = True) -> tuple[float, int]:
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    warm(src)
    seconds, rss, _ = timed([*cmd, str(src), str(out)])
    return seconds, rss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    src = checkpoint("llama-1.5g")
    size = sum(f.stat().st_size for f in src.iterdir())
    results = {}
    for name, cmd in CONTENDERS.items():
        runs = [measure(cmd, src, WORK / "out") for _ in range(args.runs)]
        results[name] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
        print(f"  {name}: {[round(r[0], 2) for r in runs]} s", flush=True)
        if name == "deploykit reshard":  # again into the finished output: nothing to write
            noop = [measure(cmd, src, WORK / "out", fresh=False) for _ in range(args.runs)]
            results["deploykit reshard, again (up to date)"] = (statistics.median(r[0] for r in noop),
                                                                 max(r[1] for r in noop))
    shutil.rmtree(WORK / "out", ignore_errors=True)
    from rich.console import Console
    from rich.table import Table

    base = results["cp -r + sync"][0]
    table = Table(title=f"Resharding a {size / 1e9:.2f} GB fp16 checkpoint into 256 MiB shards "
                        f"(median of {args.runs}; peak RSS = max)")
    for col in ("tool", "wall s", "x cp", "GB/s", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "tool" else "right")
    for name, (seconds, rss) in results.items():
        table.add_row(name, f"{seconds:.2f}", f"{seconds / base:.2f}", f"{size / seconds / 1e9:.2f}",
                      f"{rss / 2**20:.0f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
