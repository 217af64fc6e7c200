"""Shared by the benchmarks: generated checkpoints (in child processes, so the benchmark process stays
small) and measuring commands with /usr/bin/time."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".bench"
PY = sys.executable

_GENERATE = """
import shutil, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, LlamaConfig
src, hidden, inter, layers, dtype = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=16, num_key_value_heads=16, vocab_size=32000)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
tmp = src.with_name(src.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp, max_shard_size="1GB")
tmp.rename(src)
"""

CHECKPOINTS = {
    # name: hidden, intermediate, layers, dtype
    "llama-1.5g": (2048, 5632, 12, "float16"),  # 1.5 GB
    "llama-fp32-600m": (1024, 2816, 12, "float32"),  # 0.6 GB, float32 for CPU forwards
    "llama-fp32-1.3g": (1280, 3456, 12, "float32"),  # 1.3 GB, float32: bench/quantize.py's apply peak
}


def checkpoint(name: str) -> Path:
    path = WORK / name
    if not (path / "config.json").exists():
        print(f"generating {name} once (random weights)...", flush=True)
        WORK.mkdir(exist_ok=True)
        hidden, inter, layers, dtype = CHECKPOINTS[name]
        subprocess.run([PY, "-c", _GENERATE, str(path), str(hidden), str(inter), str(layers), dtype],
                       check=True, stderr=subprocess.DEVNULL)
    return path


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def timed(cmd: list[str], *, env: dict | None = None, cwd: Path = ROOT) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of a command, measured by /usr/bin/time."""
    report = WORK / "time.txt"
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(report), *cmd], cwd=cwd, env=env,
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return elapsed, int(report.read_text().split()[-1]) * 1024, proc.stdout


def warm(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(64 * 2**20):
                    pass


def print_measures(rows: list[tuple[str, str]]) -> None:
    """A two-column table: measure, value."""
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    print(f"{'-' * width}  {'-' * 5}")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
