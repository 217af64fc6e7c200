"""Resharding a checkpoint: deploykit vs `cp -r` vs transformers vs accelerate, side by side.

    .venv/bin/python bench/reshard.py              # 1.5 GB fp16 Llama, 3 runs each (about 3 minutes)
    .venv/bin/python bench/reshard.py --runs 1

A Llama-shaped checkpoint (hidden 2048, 12 layers, vocab 32000: 1.5 GB at float16, random weights) is
generated once into .bench/. Each contender runs in its own process, from a warm page cache (the
source is read once before every run), into a fresh directory, and ends with `sync` so that every
byte is on disk; wall time and the process's peak RSS (wait4) are recorded, and the median run shown:

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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".bench"
PY = sys.executable

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


GENERATE = """
import shutil, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, LlamaConfig
src = Path(sys.argv[1])
config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
tmp = src.with_name(src.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp, max_shard_size="1GB")
tmp.rename(src)
"""


def make_checkpoint() -> Path:
    """Generated in a child process: this one must stay small, since children forked from it
    inherit its peak RSS in their own accounting."""
    src = WORK / "llama-1.5g"
    if not (src / "config.json").exists():
        print("generating the 1.5 GB checkpoint once (random weights)...", flush=True)
        WORK.mkdir(exist_ok=True)
        subprocess.run([PY, "-c", GENERATE, str(src)], check=True, stderr=subprocess.DEVNULL)
    return src


def warm(src: Path) -> None:
    for f in src.iterdir():
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def measure(cmd: list[str], src: Path, out: Path, *, fresh: bool = True) -> tuple[float, int]:
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    warm(src)
    report = WORK / "time.txt"
    start = time.perf_counter()
    # /usr/bin/time reports the peak RSS of the command itself (children of this process would
    # also count this process's memory from before their exec).
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(report), *cmd, str(src), str(out)],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed: {proc.stderr.decode()}")
    return elapsed, int(report.read_text().split()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    src = make_checkpoint()
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
