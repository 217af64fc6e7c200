"""Loading to ready, no-op apply, and forward latency with a disk tier: deploykit vs transformers.

    .venv/bin/python bench/load.py

1. Apply-to-ready on a 1.5 GB fp16 checkpoint, each in a fresh process from a warm page cache, all on
   CPU, including imports and the first forward pass (``from_pretrained`` maps the weights and reads
   them only on first use, so a load without a forward flatters):
   - transformers: ``from_pretrained(SRC, device_map="cpu")`` + one forward
   - deploykit apply (the checkpoint's own layout fits the manifest: used in place, no copy)
   - deploykit apply (16 MiB shards asked for: resharded first)
   - deploykit apply again (unchanged: the no-op)
2. Forward latency (32 tokens, median of 15 after 2 warm-ups, the three models timed round-robin) on
   a 0.6 GB fp32 checkpoint, with the last half of the layers on the disk tier vs all on CPU:
   - deploykit, all CPU
   - deploykit, half on disk (memory-mapped shards)
   - transformers' own disk offload (``device_map`` with "disk" entries: accelerate hooks)
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, WORK, checkpoint, size_of, timed, warm  # noqa: E402

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: bench}}
spec:
  model: {{path: {path}, dtype: {dtype}}}
  placement: {{gpus: []}}
  sharding: {{max_shard_size: {shard}, path: {shards}}}
  offload:
    cpu: {{max_memory: {cpu}}}
    disk: {{path: {offload}, max_size: 100GiB}}
"""

TRANSFORMERS = ("import torch, sys; from transformers import AutoModelForCausalLM; "
                "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float16, device_map='cpu'); "
                "ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]]); "
                "torch.no_grad().__enter__(); assert torch.isfinite(m(ids).logits).all()")


def write(target: Path, **fields: object) -> Path:
    target.write_text(MANIFEST.format(**fields))
    return target


def load_to_ready(runs: int) -> list[tuple[str, float, int]]:
    src = checkpoint("llama-1.5g")
    rows = []
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}

    def measure(name: str, make_cmd, fresh_state: bool = True) -> None:
        results = []
        for _ in range(runs):
            state = WORK / "load-state"
            if fresh_state:
                shutil.rmtree(state, ignore_errors=True)
                shutil.rmtree(WORK / "load-shards", ignore_errors=True)
            subprocess.run(["sync"])
            warm(src)
            results.append(timed(make_cmd(), env={**env, "DEPLOYKIT_STATE": str(state)})[:2])
        rows.append((name, statistics.median(r[0] for r in results), max(r[1] for r in results)))
        print(f"  {name}: {[round(r[0], 2) for r in results]} s", flush=True)

    in_place = write(WORK / "load-in-place.yaml", path=src, dtype="float16", shard="4GiB",
                     shards=WORK / "load-shards", cpu="64GiB", offload=WORK / "load-offload")
    resharded = write(WORK / "load-reshard.yaml", path=src, dtype="float16", shard="16MiB",
                      shards=WORK / "load-shards", cpu="64GiB", offload=WORK / "load-offload")
    measure("transformers from_pretrained + forward", lambda: [PY, "-c", TRANSFORMERS, str(src)])
    measure("deploykit apply (layout fits: in place)",
            lambda: [PY, "-m", "deploykit.cli", "apply", str(in_place), "-q"])
    measure("deploykit apply (resharded to 16 MiB)",
            lambda: [PY, "-m", "deploykit.cli", "apply", str(resharded), "-q"])
    measure("deploykit apply again (no-op)",
            lambda: [PY, "-m", "deploykit.cli", "apply", str(resharded), "-q"], fresh_state=False)
    return rows


def forward_latency(repeats: int = 15) -> list[tuple[str, float]]:
    """All three models are loaded side by side and timed round-robin, so drift (CPU frequency, other
    load) hits each the same; the median of ``repeats`` forwards after two warm-ups is reported."""
    import torch
    from transformers import AutoModelForCausalLM

    from deploykit.spec.manifest import load_manifests
    from deploykit.control.revisions.reconciler import ApplyOptions, apply
    from deploykit.control.revisions.state import StateStore

    src = checkpoint("llama-fp32-600m")
    size = size_of(src)
    ids = torch.arange(1, 33).unsqueeze(0)
    models: dict[str, object] = {}
    for i, (name, cpu) in enumerate((("deploykit, all on CPU", "64GiB"),
                                     ("deploykit, half on disk (mapped)", size // 2))):
        manifest = write(WORK / f"latency-{i}.yaml", path=src, dtype="float32", shard="64MiB",
                         shards=WORK / f"latency-shards-{i}", cpu=cpu, offload=WORK / "latency-offload")
        [loaded] = load_manifests(manifest)
        outcome = apply(loaded, store=StateStore(WORK / f"latency-state-{i}"), options=ApplyOptions(keep_model=True, force=True))
        models[name] = outcome.loaded.model
        device_map = outcome.plan.device_map
    offload = WORK / "latency-hf-offload"
    shutil.rmtree(offload, ignore_errors=True)
    models["transformers disk offload (accelerate hooks)"] = AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, device_map=device_map, offload_folder=str(offload))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for round_ in range(repeats + 2):
            for name, model in models.items():
                start = time.perf_counter()
                model(ids)  # type: ignore[operator]
                if round_ >= 2:
                    times[name].append(time.perf_counter() - start)
    return [(name, statistics.median(t)) for name, t in times.items()]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    load_rows = load_to_ready(args.runs)
    latency_rows = forward_latency()
    console = Console(width=120)
    base = load_rows[0][1]
    table = Table(title=f"Load to ready, 1.5 GB fp16 checkpoint on CPU (median of {args.runs}, fresh "
                        "process, warm page cache)")
    for col in ("what", "wall s", "x transformers", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for name, seconds, rss in load_rows:
        table.add_row(name, f"{seconds:.2f}", f"{seconds / base:.2f}", f"{rss / 2**20:.0f}")
    console.print(table)
    base = latency_rows[0][1]
    table = Table(title="Forward latency, 0.6 GB fp32 checkpoint, 32 tokens (median of 15, round-robin)")
    for col in ("placement", "ms", "x all-CPU"):
        table.add_column(col, justify="left" if col == "placement" else "right")
    for name, seconds in latency_rows:
        table.add_row(name, f"{seconds * 1000:.1f}", f"{seconds / base:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
