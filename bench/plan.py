"""Warm `deploykit plan` vs `deploykit validate`: what the structure cache saves.

    .venv/bin/python bench/plan.py              # median of 5 runs each
    .venv/bin/python bench/plan.py --runs 9

Three commands on manifests/llama-2-70b.yaml (a config-only checkpoint: config.json, no weights), each
in a fresh process through the `deploykit` console script of this venv, round-robin so that drift in the
machine's speed hits all three alike:

- validate:   deploykit validate manifests/llama-2-70b.yaml
- cold plan:  deploykit plan manifests/llama-2-70b.yaml --devices 8x80GiB, with an empty structure cache
              (imports torch and transformers, builds the meta model, writes the cache)
- warm plan:  the same with the cache filled (reads one JSON file; imports neither)

The cache is a directory under .bench/ (DEPLOYKIT_CACHE), never the user's. Target: warm plan within
1.5x of validate. The cold and warm plans must print the same digest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, WORK, timed  # noqa: E402

DEPLOYKIT = str(Path(sys.executable).with_name("deploykit"))
MANIFEST = "manifests/llama-2-70b.yaml"
COMMANDS = {
    "validate": [DEPLOYKIT, "validate", MANIFEST],
    "cold plan (empty cache)": [DEPLOYKIT, "plan", MANIFEST, "--devices", "8x80GiB"],
    "warm plan (cache filled)": [DEPLOYKIT, "plan", MANIFEST, "--devices", "8x80GiB"],
}
TARGET = 1.5


def env_with_cache(cache: Path) -> dict[str, str]:
    return {**os.environ, "DEPLOYKIT_CACHE": str(cache), "COLUMNS": "120"}


def digest(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if "digest:" in line).split("digest:")[1].strip()


def run_once(name: str, cache: Path) -> tuple[float, int, str]:
    if name.startswith("cold"):
        shutil.rmtree(cache, ignore_errors=True)
    return timed(COMMANDS[name], env=env_with_cache(cache), cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    cold_cache, warm_cache = WORK / "plan-cache-cold", WORK / "plan-cache-warm"
    shutil.rmtree(warm_cache, ignore_errors=True)
    timed(COMMANDS["warm plan (cache filled)"], env=env_with_cache(warm_cache), cwd=ROOT)  # fill it
    samples: dict[str, list[tuple[float, int]]] = {name: [] for name in COMMANDS}
    digests: dict[str, set[str]] = {name: set() for name in COMMANDS if "plan" in name}
    for _ in range(args.runs):
        for name in COMMANDS:
            seconds, rss, stdout = run_once(name, cold_cache if name.startswith("cold") else warm_cache)
            samples[name].append((seconds, rss))
            if name in digests:
                digests[name].add(digest(stdout))
    for name, runs in samples.items():
        print(f"  {name}: {[round(s, 3) for s, _ in runs]} s", flush=True)
    shutil.rmtree(cold_cache, ignore_errors=True)
    report(samples, args.runs)
    same = len(set().union(*digests.values())) == 1
    print(f"cold and warm plans give the same digest: {'yes' if same else 'NO'} "
          f"({', '.join(sorted(set().union(*digests.values())))})")


def report(samples: dict[str, list[tuple[float, int]]], runs: int) -> None:
    from rich.console import Console
    from rich.table import Table

    medians = {name: statistics.median(s for s, _ in r) for name, r in samples.items()}
    base = medians["validate"]
    table = Table(title=f"{Path(MANIFEST).name}, median of {runs}")
    for col in ("command", "wall s", "x validate", "peak RSS MiB"):
        table.add_column(col, justify="left" if col == "command" else "right")
    for name, r in samples.items():
        table.add_row(name, f"{medians[name]:.3f}", f"{medians[name] / base:.2f}",
                      f"{max(m for _, m in r) / 2**20:.0f}")
    Console(width=120).print(table)
    ratio = medians["warm plan (cache filled)"] / base
    print(f"warm plan / validate = {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
