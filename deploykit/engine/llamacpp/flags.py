"""A plan's placement as llama-server's flags: ``--n-gpu-layers``, ``--tensor-split`` and ``--device``.

deploykit's exact planner decides how many decoder layers each GPU holds (embeddings and output with the
first GPU); llama.cpp takes that as the number of layers to offload and each GPU's share of them, in the
plan's GPU order. Layers the plan leaves to the CPU tier stay on the CPU. A plan whose every layer is on
GPUs offloads the output layer too (``n_layers + 1``, llama.cpp's convention). Pure: no process, no I/O.
GPU execution of these flags is unverified on deploykit's CPU-only test machine (docs/engines.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_LAYER = re.compile(r"\.(\d+)$")


@dataclass(frozen=True)
class PlacementFlags:
    gpu_layers: int  # --n-gpu-layers
    tensor_split: tuple[int, ...]  # --tensor-split: layers per GPU, in ``devices`` order
    devices: tuple[int, ...]  # --device CUDA<i>,...
    cpu_layers: int

    def as_args(self) -> list[str]:
        args = ["--n-gpu-layers", str(self.gpu_layers)]
        if self.devices:
            args += ["--device", ",".join(f"CUDA{d}" for d in self.devices)]
        if len(self.tensor_split) > 1:
            args += ["--split-mode", "layer", "--tensor-split", ",".join(map(str, self.tensor_split))]
        return args


def _layer_keys(device_map: dict[str, Any]) -> dict[str, Any]:
    """The decoder layers of a device_map (keys ending in a layer index), with their device."""
    return {k: d for k, d in device_map.items() if _LAYER.search(k)}


def placement_flags(device_map: dict[str, Any]) -> PlacementFlags:
    """llama-server's placement flags for a plan's ``device_map`` (accelerate's convention)."""
    layers = _layer_keys(device_map)
    gpus = sorted({d for d in device_map.values() if isinstance(d, int)},
                  key=lambda g: min(i for i, d in enumerate(device_map.values()) if d == g))
    per_gpu = tuple(sum(1 for d in layers.values() if d == g) for g in gpus)
    on_gpus = sum(per_gpu)
    cpu = len(layers) - on_gpus
    gpu_layers = on_gpus + 1 if layers and cpu == 0 and gpus else on_gpus
    return PlacementFlags(gpu_layers, per_gpu, tuple(gpus), cpu)
