"""spec.model.quantization end to end on tiny real models: the field, exact plan sizes, quantized shards
on disk with their checksums, loading and a greedy answer, a no-op re-apply, a new layout when the
quantization changes, and kill -9 in the middle of a quantizing reshard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from deploykit.errors import ManifestError
from deploykit.spec.manifest import parse_manifests

HEADER = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: q}\nspec:\n"


def _manifest(model: Path, quantization: str | None, *, dtype: str = "float32") -> str:
    line = f"    quantization: {quantization}\n" if quantization is not None else ""
    return (HEADER + f"  model:\n    path: {model}\n    dtype: {dtype}\n{line}  placement: {{gpus: []}}\n")


def test_quantization_defaults_to_none_and_keeps_the_digest(tmp_path):
    [plain] = parse_manifests(_manifest(tmp_path, None).encode(), source="m.yaml", base_dir=tmp_path)
    [none] = parse_manifests(_manifest(tmp_path, "none").encode(), source="m.yaml", base_dir=tmp_path)
    [int8] = parse_manifests(_manifest(tmp_path, "int8").encode(), source="m.yaml", base_dir=tmp_path)
    assert plain.manifest.spec.model.quantization == "none"
    assert plain.digest == none.digest  # naming the default changes nothing
    assert "quantization:" not in plain.text
    assert int8.manifest.spec.model.quantization == "int8" and int8.digest != plain.digest
    assert "quantization: int8" in int8.text


def test_unknown_quantization_is_a_located_error(tmp_path):
    with pytest.raises(ManifestError) as err:
        parse_manifests(_manifest(tmp_path, "int3").encode(), source="m.yaml", base_dir=tmp_path)
    [issue] = err.value.issues
    assert (issue.line, issue.column, issue.field) == (8, 19, "spec.model.quantization")
    assert issue.message == "Input should be 'none', 'int8' or 'int4'"
    assert issue.hint == "did you mean 'int8'?"


def test_validate_exits_2_naming_the_field_and_the_allowed_values(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(_manifest(tmp_path, "fp4"))
    result = subprocess.run([sys.executable, "-m", "deploykit.cli", "validate", "--schema-only", str(path)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stdout
    assert (f"{path}:8:19: spec.model.quantization: Input should be 'none', 'int8' or 'int4'"
            in result.stderr)


# ---------------------------------------------------------------------------------------------------
# Exact plan sizes.

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _expected_bytes(model: Path, scheme: str) -> int:
    """The bytes the model takes at float32 under ``scheme``, worked out by hand from the checkpoint's
    tensors: int8 = 1 byte per weight + a float32 scale per output row; int4 = half a byte per weight +
    a float32 scale and zero per 32 inputs of each row. Embeddings, lm_head and norms stay float32.
    Buffers that are not saved (rotary frequencies) are in memory too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deploykit.model.checkpoint import open_checkpoint

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    saved = meta.state_dict()
    total = sum(b.numel() * 4 for n, b in meta.named_buffers() if n not in saved)
    for t in open_checkpoint(model).tensors:
        linear = t.name.startswith("model.layers.") and t.name.split(".")[-2] in LINEARS
        out, inputs = t.shape if len(t.shape) == 2 else (0, 0)
        if linear and scheme == "int8":
            total += out * inputs + out * 4
        elif linear and scheme == "int4":
            total += out * inputs // 2 + 2 * out * (inputs // 32) * 4
        else:
            total += t.nbytes // 2 * 4 if t.dtype in ("F16", "BF16") else t.nbytes
    return total


def _plan(model: Path, scheme: str, tmp_path: Path, devices: str = "cpu=8GiB", gpus: str = "[]"):
    from deploykit.placement.planning import plan_manifest

    text = _manifest(model, scheme).replace("placement: {gpus: []}", f"placement: {{gpus: {gpus}, reserve: 0}}")
    [loaded] = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    return plan_manifest(loaded, devices=devices)


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_plan_bytes_are_exact(tiny_model, tmp_path, name, scheme):
    model = tiny_model(name)
    plan = _plan(model, scheme, tmp_path)
    assert plan.total_bytes == _expected_bytes(model, scheme)  # a tied lm_head counted once
    assert plan.quantization == scheme
    data = plan.to_dict()
    assert data["devices"][0]["weight_bytes"] == plan.total_bytes
    assert ("quantization" in data) == (scheme != "none")


def test_quantization_changes_the_plan_digest_not_the_unquantized_one(tiny_model, tmp_path):
    from deploykit.placement.planner import _digest

    model = tiny_model("llama")
    none, int8, int4 = (_plan(model, s, tmp_path) for s in ("none", "int8", "int4"))
    assert none.device_map == int8.device_map == int4.device_map
    assert len({none.digest, int8.digest, int4.digest}) == 3
    assert none.digest == _digest("q", none.architecture, "float32", none.device_map)  # as before the field


def test_quantized_plan_balances_the_quantized_bytes(tiny_model, tmp_path):
    """Two equal GPUs split the layers by their quantized bytes; the split stays the exact optimum."""
    model = tiny_model("llama")
    plan = _plan(model, "int4", tmp_path, devices="2x1GiB", gpus="[0, 1]")
    gpu0, gpu1 = plan.devices[:2]
    assert gpu0.weight_bytes + gpu1.weight_bytes == _expected_bytes(model, "int4")
    unquantized = _plan(model, "none", tmp_path, devices="2x1GiB", gpus="[0, 1]")
    assert gpu0.weight_bytes < unquantized.devices[0].weight_bytes
    assert plan.bottleneck_factor is not None and plan.bottleneck_factor <= unquantized.bottleneck_factor + 0.2
