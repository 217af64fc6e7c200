"""Manifests the checks deploy: one function, every field a check varies named."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class Spec:
    """What varies between the checks' manifests."""

    name: str
    model: Path
    dtype: str
    gpus: tuple[int, ...] = ()
    quantization: str = "none"
    cpu: int | None = None  # offload.cpu.max_memory in bytes (None: what the host has)
    disk: Path | None = None  # offload.disk.path (None: no disk tier)
    serving: dict[str, Any] = field(default_factory=dict)
    lifecycle: dict[str, Any] = field(default_factory=dict)


def manifest(spec: Spec, shards: Path) -> dict[str, Any]:
    offload: dict[str, Any] = {"cpu": {"max_memory": spec.cpu}}
    if spec.disk is not None:
        offload["disk"] = {"path": str(spec.disk), "max_size": "64GiB"}
    body: dict[str, Any] = {
        "model": {"path": str(spec.model), "task": "causal-lm", "dtype": spec.dtype,
                  "quantization": spec.quantization},
        "placement": {"gpus": list(spec.gpus), "reserve": 0},
        "sharding": {"max_shard_size": "1GiB", "path": str(shards)},
        "offload": offload,
        "rollout": {"health_check": {"timeout": "60s"}},
    }
    if spec.serving:
        body["serving"] = spec.serving
    if spec.lifecycle:
        body["lifecycle"] = spec.lifecycle
    return {"apiVersion": "deploykit/v1", "kind": "ModelDeployment", "metadata": {"name": spec.name}, "spec": body}


def write(spec: Spec, directory: Path, *, shards: Path) -> Path:
    """Write ``spec``'s manifest as ``directory/<name>.yaml``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(manifest(spec, shards), sort_keys=False))
    return path
