"""spec.adapters in the plan: each adapter's bytes (from its safetensors header, at the base's dtype) on the
devices holding the layers it adapts, in ``deploykit plan`` (text and JSON) and in the host budget."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner
from safetensors import safe_open

from deploykit.cli import main
from deploykit.control.budget import plan_tiers
from deploykit.placement.planning import plan_manifest
from deploykit.spec.manifest import load_manifests

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: chat
spec:
  model:
    path: {base}
    dtype: {dtype}
  placement:
    gpus: {gpus}
    reserve: 0
  adapters:
    - name: pirate
      path: {pirate}
    - name: polite
      path: {polite}
"""


def _manifest(tmp_path: Path, lora: Any, *, dtype: str = "float32", gpus: str = "[]") -> Path:
    file = tmp_path / "chat.yaml"
    file.write_text(MANIFEST.format(base=lora.base, pirate=lora.pirate, polite=lora.polite, dtype=dtype, gpus=gpus))
    return file


def _layer_bytes(adapter: Path, itemsize: int) -> dict[int, int]:
    """Bytes per decoder layer of an adapter, counted from its tensors by the safetensors library."""
    out: dict[int, int] = {}
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        for key in f.keys():
            layer = int(key.split(".layers.")[1].split(".")[0])
            out[layer] = out.get(layer, 0) + f.get_tensor(key).numel() * itemsize
    return out


def test_adapter_bytes_at_the_base_dtype_in_plan_json_and_total(lora: Any, tmp_path: Path) -> None:
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        result = CliRunner().invoke(main, ["plan", str(_manifest(tmp_path, lora, dtype=dtype)), "-o", "json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.output)
        want = sum(_layer_bytes(lora.pirate, itemsize).values())
        assert [(a["name"], a["bytes"]) for a in data["adapters"]] == [("pirate", want), ("polite", want)]
        assert data["adapters"][0]["devices"] == [{"device": "cpu", "bytes": want}]
        assert data["total_bytes"] == sum(d["bytes"] for d in data["devices"]) + 2 * want


def test_adapters_sit_on_the_gpus_of_the_layers_they_adapt_and_count_in_the_budget(lora: Any,
                                                                                      tmp_path: Path) -> None:
    from deploykit.placement.kv import prefix_cache_tiers

    [loaded] = load_manifests(_manifest(tmp_path, lora, gpus="[0, 1]"))
    plan = plan_manifest(loaded, devices="2x1GiB,cpu=1GiB")
    layer_device = {int(k.split(".")[2]): d for k, d in plan.device_map.items() if k.startswith("model.layers.")}
    assert set(layer_device.values()) == {0, 1}  # the two layers on two GPUs
    per_layer = _layer_bytes(lora.pirate, 4)
    want = {d: sum(b for layer, b in per_layer.items() if layer_device[layer] == d) for d in (0, 1)}
    assert dict(plan.adapters[0].devices) == want
    without = {d.device: d.bytes for d in plan.devices}
    cached = prefix_cache_tiers(plan)  # the default prefix cache, spread as the KV is
    assert cached["gpu0"] + cached["gpu1"] == plan.prefix_cache_bytes > 0
    assert plan_tiers(plan) == {"gpu0": without[0] + 2 * want[0] + cached["gpu0"],
                                "gpu1": without[1] + 2 * want[1] + cached["gpu1"]}


def test_plan_text_lists_each_adapter(lora: Any, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["plan", str(_manifest(tmp_path, lora))])
    assert result.exit_code == 0, result.output
    assert "adapter pirate: 13 KiB (cpu 13 KiB)" in result.output
    assert "adapter polite: 13 KiB (cpu 13 KiB)" in result.output


def test_adapters_on_layers_a_gpu_plan_offloads_to_cpu_are_refused_at_plan_time(lora: Any, tmp_path: Path) -> None:
    """Accelerate brings an offloaded layer's weights to the GPU for each forward, but peft's LoRA matrices of
    that layer would stay on the meta device: refused, naming the adapter's entry and the layer. A CPU-only
    plan holds every layer where it runs, and serves them."""
    import pytest

    from deploykit.errors import PlanInfeasible

    file = _manifest(tmp_path, lora, gpus="[0]")
    offload = "    reserve: 0\n  offload: {cpu: {max_memory: 1GiB}}\n"
    file.write_text(file.read_text().replace("    reserve: 0\n", offload))
    [loaded] = load_manifests(file)
    with pytest.raises(PlanInfeasible) as err:
        plan_manifest(loaded, devices="1x300KiB,cpu=1GiB")  # layer 1 does not fit on the GPU: it is offloaded
    assert "spec.adapters[0] (adapter 'pirate') adapts 'model.layers.1." in str(err.value)
    assert "to CPU memory" in str(err.value)
    on_gpu = plan_manifest(loaded, devices="1x2MiB,cpu=1GiB")
    assert all(device == 0 for a in on_gpu.adapters for device, _ in a.devices)
    [cpu_only] = load_manifests(_manifest(tmp_path, lora))
    assert plan_manifest(cpu_only, devices="cpu=64MiB").adapters


def test_the_prefix_cache_is_sized_from_the_room_the_adapters_leave(lora: Any, tmp_path: Path) -> None:
    """A prefix cache of exactly the room beside the weights less the batch's 64 MiB fits without adapters;
    with them it would push the host past its memory: refused at max_bytes. The default cache is a quarter
    of the room the adapters leave."""
    import pytest

    from deploykit.errors import PlanInfeasible
    from deploykit.placement.kv import MIN_KV_BYTES, kv_budget

    bare = tmp_path / "bare.yaml"
    bare.write_text(MANIFEST.split("  adapters:")[0].format(base=lora.base, dtype="float32", gpus="[]")
                    + "  serving: {prefix_cache: {enabled: false}}\n")
    devices = "cpu=600MiB"
    room = kv_budget(plan_manifest(load_manifests(bare)[0], devices=devices))
    assert room is not None and room > MIN_KV_BYTES
    sized = (f"  serving: {{prefix_cache: {{max_bytes: {room - MIN_KV_BYTES}}}}}\n")
    bare.write_text(bare.read_text().replace("  serving: {prefix_cache: {enabled: false}}\n", sized))
    assert plan_manifest(load_manifests(bare)[0], devices=devices).prefix_cache_bytes == room - MIN_KV_BYTES

    with_adapters = _manifest(tmp_path, lora)
    with_adapters.write_text(with_adapters.read_text() + sized)
    with pytest.raises(PlanInfeasible) as err:
        plan_manifest(load_manifests(with_adapters)[0], devices=devices)
    assert err.value.field == "spec.serving.prefix_cache.max_bytes"

    default = _manifest(tmp_path, lora)
    planned = plan_manifest(load_manifests(default)[0], devices=devices)
    adapters = sum(a.bytes for a in planned.adapters)
    assert planned.prefix_cache_bytes == (room - adapters) // 4 >> 20 << 20
