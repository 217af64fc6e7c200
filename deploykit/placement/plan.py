"""The placement decision as data: ``Plan`` (one device_map and what each device holds), ``DevicePlan``,
``NodePlan`` (one pipeline stage), their JSON form, ``plan_digest`` (the digest of what was decided) and
``bottleneck_factor`` (how far the most loaded GPU is above its share).

Plain frozen values: a Plan round-trips through ``to_dict`` / ``from_dict`` (the state store keeps plans
as JSON), and two plans are compared by digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Device = int | str  # accelerate's convention: GPU index, "cpu" or "disk"


@dataclass(frozen=True)
class DevicePlan:
    """What one device holds. ``load`` is what is balanced (bytes or FLOPs per token)."""

    device: Device
    tier: Literal["gpu", "cpu", "disk"]
    bytes: int  # weights plus planned KV cache and logits
    weight_bytes: int
    budget: int | None  # None: not limited
    blocks: tuple[str, ...]  # compressed runs, e.g. "model.layers.0-7"
    load: int = 0
    ratio: float | None = None
    target_share: float | None = None
    actual_share: float | None = None


@dataclass(frozen=True)
class NodePlan:
    """One pipeline stage: the machine it runs on and the contiguous run of blocks it holds."""

    node: int  # stage index, 0 first
    name: str  # the inventory's name of the machine (node0..., or the Ray node's address)
    blocks: tuple[str, ...]  # compressed runs
    layers: tuple[int, int] | None  # first and last decoder layer index held, None if none
    bytes: int
    load: int
    target_share: float
    actual_share: float
    address: str | None = None
    id: str | None = None


@dataclass(frozen=True)
class AdapterPlan:
    """One LoRA adapter of ``spec.adapters``: its bytes at the base's dtype, on the devices holding the
    layers it adapts (``placement/adapters.py``)."""

    name: str
    path: str
    bytes: int
    devices: tuple[tuple[Device, int], ...]  # (device, bytes there), in the plan's device order


@dataclass(frozen=True)
class DraftPlan:
    """The draft model of ``spec.speculative`` (``method: draft``): its file, its weights and the KV cache of
    its own layers, all held on one device (``placement/llamacpp.py``: llama.cpp engine)."""

    path: str
    bytes: int  # weight_bytes + kv_bytes (+ the logits of a micro-batch)
    weight_bytes: int
    kv_bytes: int  # engine.slots x engine.context tokens of its own layers
    layers: int
    device: Device


@dataclass(frozen=True)
class Plan:
    """A placement decision. ``digest`` covers what was decided (model, dtype, device_map)."""

    name: str
    architecture: str
    dtype: str
    balance: str
    device_map: dict[str, Device]
    devices: tuple[DevicePlan, ...]
    bottleneck_factor: float | None  # max over GPUs of actual_share / target_share; 1.0 is perfect
    total_bytes: int
    kv_cache_tokens: int | None = None
    notes: tuple[str, ...] = ()
    digest: str = field(default="")
    # Several nodes (placement.nodes > 1): the stage of every device_map key, and each stage's summary.
    # device_map then holds each block's device on its own node (GPU indices count from 0 per node).
    node_map: dict[str, int] = field(default_factory=dict)
    nodes: tuple[NodePlan, ...] = ()
    device_nodes: tuple[int, ...] = ()  # the node of each entry of ``devices``
    quantization: str = "none"  # spec.model.quantization: block sizes are the quantized bytes
    prefix_cache_bytes: int = 0  # spec.serving.prefix_cache, spread as the KV is (placement.kv)
    adapters: tuple[AdapterPlan, ...] = ()  # spec.adapters; their bytes are in total_bytes, not in devices
    draft: DraftPlan | None = None  # llama.cpp: spec.speculative's draft model; its bytes are in total_bytes, not in devices
    # spec.speculative method draft (transformers engine): the draft model's weights and its rows' KV, on the
    # device of the model's first layers; in total_bytes, not in devices
    draft_bytes: int = 0

    @property
    def adapter_bytes(self) -> int:
        return sum(a.bytes for a in self.adapters)

    @property
    def is_quantized(self) -> bool:
        return self.quantization != "none"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = [asdict(d) for d in self.devices]
        data["notes"] = list(self.notes)
        for d in data["devices"]:
            d["blocks"] = list(d["blocks"])
        if not self.is_quantized:  # unquantized plans keep their exact former shape
            data.pop("quantization")
        if not self.prefix_cache_bytes:
            data.pop("prefix_cache_bytes")
        if not self.draft_bytes:  # plans without a draft model keep their exact former shape
            data.pop("draft_bytes")
        if not self.adapters:  # plans without adapters keep their exact former shape
            data.pop("adapters")
        else:
            data["adapters"] = [{"name": a.name, "path": a.path, "bytes": a.bytes,
                                 "devices": [{"device": d, "bytes": b} for d, b in a.devices]} for a in self.adapters]
        if self.draft is None:  # plans without a draft model keep their exact former shape
            data.pop("draft")
        if not self.nodes:  # one-node plans keep their exact former shape
            for key in ("node_map", "nodes", "device_nodes"):
                data.pop(key)
        else:
            data["device_nodes"] = list(self.device_nodes)
            data["nodes"] = [{**asdict(n), "blocks": list(n.blocks),
                              "layers": list(n.layers) if n.layers else None} for n in self.nodes]
        return data

    def stage_device_map(self, node: int) -> dict[str, Device]:
        """The device_map of one stage (accelerate's convention, on that node)."""
        if not self.nodes:
            return dict(self.device_map)
        return {k: d for k, d in self.device_map.items() if self.node_map.get(k) == node}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        devices = tuple(DevicePlan(**{**d, "blocks": tuple(d["blocks"])}) for d in data["devices"])
        nodes = tuple(NodePlan(**{**n, "blocks": tuple(n["blocks"]),
                                  "layers": tuple(n["layers"]) if n.get("layers") else None})
                      for n in data.get("nodes", ()))
        adapters = tuple(AdapterPlan(a["name"], a["path"], a["bytes"],
                                     tuple((d["device"], d["bytes"]) for d in a["devices"]))
                         for a in data.get("adapters", ()))
        draft = DraftPlan(**data["draft"]) if data.get("draft") else None
        return cls(**{**data, "devices": devices, "notes": tuple(data.get("notes", ())), "nodes": nodes,
                      "adapters": adapters, "draft": draft,
                      "device_nodes": tuple(data.get("device_nodes", ())),
                      "node_map": dict(data.get("node_map", {}))})


def plan_digest(name: str, architecture: str, dtype: str, device_map: dict[str, Device],
                node_map: dict[str, int] | None = None, quantization: str = "none") -> str:
    """``Plan.digest``: sha256 over what was decided (name, architecture, dtype, device_map, and the
    node_map and quantization only where set, so older plans keep their digest)."""
    decided: dict[str, Any] = {"name": name, "architecture": architecture, "dtype": dtype,
                               "device_map": list(device_map.items())}
    if node_map:  # only multi-node plans: one-node digests stay what they were
        decided["node_map"] = list(node_map.items())
    if quantization != "none":  # only quantized plans: others keep their digest
        decided["quantization"] = quantization
    payload = json.dumps(decided, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


def bottleneck_factor(shares: Iterable[tuple[float, float]], gpu_load: int, has_gpus: bool) -> float | None:
    """``Plan.bottleneck_factor`` from each GPU's (target share, actual share): the largest actual / target,
    rounded; 1.0 when the GPUs carry no load, None without GPUs."""
    factor: float | None = None
    for target, actual in shares:
        if target > 0:
            factor = max(factor or 0.0, actual / target)
    return round(factor, 6) if factor is not None and gpu_load else (1.0 if has_gpus else None)
