"""A llama.cpp plan: bytes exact from the GGUF's tensor table (checked against the `gguf` package's own reader)
plus the KV cache of slots x context, and the plan's per-GPU layers as llama-server flags, shown by
`deploykit plan --devices 4x24GiB` and given by `-o json`. Pure planning: no server runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deploykit.engine.llamacpp.flags import llamacpp_devices, placement_flags
from helpers import smollm2_file
from llamacpp import manifest

SLOTS, CONTEXT = 2, 512


def _reference_bytes(gguf_file: Path) -> tuple[int, int, int]:
    """(bytes of all tensors, KV bytes per token and layer, the logits' bytes per token), read with the gguf
    package."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_file)
    tensors = sum(int(t.n_bytes) for t in reader.tensors)
    field = reader.fields
    heads = int(field["llama.attention.head_count"].parts[-1][0])
    kv_heads = int(field["llama.attention.head_count_kv"].parts[-1][0])
    width = int(field["llama.embedding_length"].parts[-1][0])
    vocab = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    return tensors, 2 * (width // heads) * kv_heads * 2, vocab * 4


def _plan(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEPLOYKIT_LLAMA_SERVER": "/bin/true"}  # planning runs no binary
    return subprocess.run([sys.executable, "-m", "deploykit.cli", "plan", str(path), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_plan_bytes_and_flags_from_the_gguf(tmp_path):
    gguf_file = smollm2_file()
    (tmp_path / "smol.yaml").write_text(manifest(gguf_file, extra="  placement: {gpus: all}\n"))
    result = _plan(tmp_path / "smol.yaml", "--devices", "4x24GiB", "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    tensors, kv_per_token, logits_per_token = _reference_bytes(gguf_file)
    layers = 30  # SmolLM2-135M
    # exact: this file's tensors need no alignment padding (sizes come from the table's offsets); the logits
    # of one micro-batch (engine.batch_size 512) with the head
    assert plan["total_bytes"] == tensors + layers * kv_per_token * SLOTS * CONTEXT + 512 * logits_per_token
    assert "prefix_cache_bytes" not in plan  # the default prefix cache is the transformers engine's: none here
    flags = plan["llama_server"]
    assert flags["gpu_layers"] == layers + 1 and sum(flags["tensor_split"]) == layers + 1 and flags["cpu_layers"] == 0
    assert flags["flags"][:4] == ["--n-gpu-layers", "31", "--device", "CUDA0,CUDA1,CUDA2,CUDA3"]
    assert plan["device_map"]["token_embd"] == 0 and plan["device_map"]["output"] == 3  # embeddings on the first GPU
    shown = _plan(tmp_path / "smol.yaml", "--devices", "4x24GiB")
    assert "llama-server flags: --n-gpu-layers 31" in shown.stdout and "--tensor-split" in shown.stdout


def test_layers_the_plan_leaves_on_the_cpu_stay_there():
    device_map = {"token_embd": 0, **{f"blk.{i}": 0 for i in range(3)}, **{f"blk.{i}": 1 for i in range(3, 5)},
                  **{f"blk.{i}": "cpu" for i in range(5, 8)}, "output": "cpu"}
    flags = placement_flags(device_map)
    # the output slot counts on the last GPU (llama.cpp offloads it first); the output itself is pinned to the CPU
    assert (flags.gpu_layers, flags.tensor_split, flags.devices, flags.cpu_layers) == (6, (3, 3), (0, 1), 3)
    assert flags.overrides == (r"^token_embd\.weight$=CUDA0", r"^output(_norm)?\.weight$=CPU")
    assert [d for d in llamacpp_devices(8, flags.gpu_layers, flags.tensor_split, 2)] == [None] * 3 + [0] * 3 + [1] * 3
    assert placement_flags({"token_embd": "cpu", "blk.0": "cpu", "output": "cpu"}).as_args() == ["--n-gpu-layers", "0"]


DEVICES = ["4x24GiB", "2x24GiB,1x48GiB", "1x2184MiB,1x2088MiB,cpu=8GiB", "1x2196MiB,cpu=8GiB"]  # GPU 0: + the logits


def test_llama_cpps_own_placement_rule_gives_each_gpu_the_plans_layers(tmp_path):
    """llama.cpp's rule (llama_model::load_tensors), applied to the flags of several plans of the GGUF, puts
    on each GPU exactly the layers the plan counted there, and the output head where the plan put it."""
    gguf_file = smollm2_file()
    (tmp_path / "smol.yaml").write_text(manifest(gguf_file, extra="  placement: {gpus: all}\n"))
    n_layer = 30
    for devices in DEVICES:
        result = _plan(tmp_path / "smol.yaml", "--devices", devices, "-o", "json")
        assert result.returncode == 0, result.stderr
        plan = json.loads(result.stdout)
        device_map, flags = plan["device_map"], plan["llama_server"]
        gpus = sorted({d for d in device_map.values() if isinstance(d, int)})
        slots = llamacpp_devices(n_layer, flags["gpu_layers"], flags["tensor_split"], len(gpus))
        for g in gpus:
            planned = sum(1 for k, d in device_map.items() if k.startswith("blk.") and d == g)
            assert slots[:n_layer].count(gpus.index(g)) == planned, (devices, g, slots)
        assert slots[:n_layer].count(None) == flags["cpu_layers"], devices
        output_pinned = r"^output(_norm)?\.weight$=CPU" in " ".join(flags["flags"])
        assert output_pinned == (device_map["output"] == "cpu"), devices  # else the rule put it on the last GPU
        assert output_pinned or slots[n_layer] == gpus.index(device_map["output"]), devices
