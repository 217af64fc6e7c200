"""Hot reload under load: manifest write to new generation serving, worst request latency during a
swap (blue-green and recreate), and memory after 10 reloads.

    .venv/bin/python bench/reload.py

A 0.6 GB fp32 Llama-shaped checkpoint is served by ``Deployment.from_manifest(watch=True)`` while two
threads run 32-token forwards without pause. The manifest is rewritten (as an editor does: write and
rename) alternating the CPU/disk boundary, which changes the plan and the shard layout every time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import WORK, checkpoint, size_of  # noqa: E402

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: reload-bench}}
spec:
  model: {{path: {path}, dtype: float32}}
  placement: {{gpus: []}}
  sharding: {{max_shard_size: 64MiB, path: {shards}}}
  offload:
    cpu: {{max_memory: {cpu}}}
    disk: {{path: {offload}, max_size: 100GiB}}
  rollout: {{strategy: {strategy}}}
"""


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Clients:
    def __init__(self, dep, threads: int = 2) -> None:
        import torch

        self.dep, self.ids, self.torch = dep, torch.arange(1, 33).unsqueeze(0), torch
        self.samples: list[tuple[float, float]] = []  # (end time, latency)
        self.failures = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                with self.dep.acquire() as model, self.torch.no_grad():
                    model(self.ids)
            except Exception:
                self.failures += 1
            end = time.perf_counter()
            self.samples.append((end, end - start))

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def warm_up(dep) -> None:
    """One forward, in a function of its own: a caller's local holding the model would keep that
    generation alive after it is swapped out (the measurement would then count it)."""
    import torch

    with dep.acquire() as model, torch.no_grad():
        model(torch.arange(1, 33).unsqueeze(0))


def run_strategy(strategy: str, reloads: int) -> dict[str, float]:
    from deploykit import Deployment
    from deploykit.placement.inventory import process_rss

    src = checkpoint("llama-fp32-600m")
    size = size_of(src)
    root = WORK / f"reload-{strategy}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    manifest = root / "model.yaml"

    def text(i: int) -> str:
        cpu = "64GiB" if i % 2 == 0 else size // 2
        return MANIFEST.format(path=src, shards=root / "shards", cpu=cpu, offload=root / "offload",
                               strategy=strategy)

    write(manifest, text(0))
    dep = Deployment.from_manifest(manifest, watch=True, state_dir=root / "state", debounce=0.1)
    warm_up(dep)
    rss_start = process_rss()
    to_serving, swap_worst = [], []
    with Clients(dep) as clients:
        time.sleep(2)
        baseline = statistics.median(lat for _, lat in clients.samples)
        for i in range(1, reloads + 1):
            generation = dep.generation
            written = time.perf_counter()
            write(manifest, text(i))
            while dep.generation == generation:
                time.sleep(0.005)
            serving = time.perf_counter()
            to_serving.append(serving - written)
            time.sleep(0.5)
            window = [lat for end, lat in clients.samples if written <= end <= serving + 0.5]
            swap_worst.append(max(window) if window else 0.0)
    import gc

    gc.collect()  # the client threads' frames held the last models they used until they ended
    time.sleep(1)
    rss_end = process_rss()
    dep.close()
    return {"reload_s": statistics.median(to_serving), "reload_max_s": max(to_serving),
            "baseline_ms": baseline * 1000, "worst_ms": max(swap_worst) * 1000,
            "failures": clients.failures, "requests": len(clients.samples),
            "rss_start": rss_start, "rss_end": rss_end, "model": size}


def main() -> None:
    import argparse

    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser()
    parser.add_argument("--reloads", type=int, default=10)
    args = parser.parse_args()
    results = {s: run_strategy(s, args.reloads) for s in ("blue-green", "recreate")}
    table = Table(title=f"Hot reload of a 0.6 GB model under 2 busy client threads ({args.reloads} reloads each)")
    for col in ("strategy", "write -> serving s (median / max)", "request ms: typical", "worst during swaps",
                "failed requests", "RSS before -> after MiB"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for strategy, r in results.items():
        table.add_row(strategy, f"{r['reload_s']:.2f} / {r['reload_max_s']:.2f}", f"{r['baseline_ms']:.0f}",
                      f"{r['worst_ms']:.0f}", f"{r['failures']} of {r['requests']}",
                      f"{r['rss_start'] / 2**20:.0f} -> {r['rss_end'] / 2**20:.0f}")
    Console(width=140).print(table)
    model = next(iter(results.values()))["model"]
    print(f"model size {model / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
