"""A llama.cpp plan's bytes against llama.cpp's own estimate of what it will allocate.

``llama-fit-params --fit-print on`` (built beside llama-server) loads the model's tensor table without
allocating anything and prints, per device, the model's bytes, the context's (KV cache and output buffer)
and the compute buffers' that llama.cpp reserves for the worst-case micro-batch. On this CPU-only machine
there is one device, the host. The plan (weights, KV cache, and the logits of a micro-batch with the
block that computes them) must come within the part it leaves to ``placement.reserve``: the layers'
intermediate tensors, at most ``micro-batch x 2 x feed_forward_length`` floats. Without the logits (96 MiB
for SmolLM2 at 512 tokens) the plan fell short of llama.cpp's figure by far more than that.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deploykit.model.gguf import gguf_metadata
from deploykit.placement.planning import plan_manifest
from deploykit.spec.manifest import load_manifests
from helpers import smollm2_file
from llamacpp import llama_server, manifest
from test_gguf import write_tiny_gguf

MIB = 1 << 20
SLOTS, CONTEXT = 2, 512  # tests/llamacpp.py's manifest


def llama_cpp_estimate(gguf_file: Path, batch: int) -> dict[str, int]:
    """llama.cpp's (model, context, compute) bytes on the host, in whole MiB as it prints them."""
    fit = llama_server().path.parent / "llama-fit-params"
    if not fit.exists():
        pytest.skip(f"no llama-fit-params beside {llama_server().path}")
    args = [str(fit), "-m", str(gguf_file), "-c", str(SLOTS * CONTEXT), "-np", str(SLOTS), "-b", str(batch),
            "-ub", str(batch), "--fit-print", "on"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    device, *mib = done.stdout.split()[-4:]
    assert device == "Host", done.stdout
    return dict(zip(("model", "context", "compute"), (int(m) * MIB for m in mib)))


@pytest.mark.parametrize("kind,batch", [("smollm2", 512), ("smollm2", 128), ("untied", 512)])
def test_the_plan_holds_what_llama_cpp_allocates_but_the_layers_scratch(tmp_path, kind, batch):
    gguf_file = smollm2_file() if kind == "smollm2" else write_tiny_gguf(tmp_path / "untied.gguf", hidden=512, heads=8, kv_heads=8, ff=2048, vocab=32000,
                                              tokens=True)
    path = tmp_path / "m.yaml"
    path.write_text(manifest(gguf_file, engine=f", batch_size: {batch}"))
    [loaded] = load_manifests(path)
    planned = plan_manifest(loaded, devices="cpu=8GiB").total_bytes
    estimate = llama_cpp_estimate(gguf_file, batch)
    ff = int(gguf_metadata(gguf_file).scalars["llama.feed_forward_length"])
    scratch = batch * 2 * ff * 4  # the layers' intermediate tensors: left to placement.reserve
    rounding = 3 * MIB  # three figures printed in whole MiB
    vocab = gguf_metadata(gguf_file).shape("token_embd.weight")[1]  # type: ignore[index]
    assert batch * vocab * 4 > scratch + rounding  # the logits are what a plan without them would miss
    assert planned - rounding <= sum(estimate.values()) <= planned + scratch + rounding, (planned, estimate)
