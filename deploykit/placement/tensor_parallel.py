"""Planning ``spec.placement.tensor_parallel: N``: each rank's share of the model. Pure, no torch.

Every rank runs every block, so there is nothing to partition: a rank holds the weights the model's
tensor-parallel plan splits (``Block.split_bytes``, 1/N each) plus everything the plan leaves whole
(norms, rotary tables: ``weight_bytes - split_bytes``), counted on every rank since each holds a copy.
Its KV cache is 1/N of the model's (key-value heads are split); the logits are gathered whole on every
rank. The ranks are the listed GPUs (one each), or, with ``gpus: []``, N worker processes on the host
CPU, shown as devices ``cpu:0`` ... ``cpu:N-1``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from ..errors import PlanInfeasible
from ..model.structure import Structure
from ..spec.schema import Spec
from ..units import format_size
from .inventory import Inventory
from .keys import compress_names
from .plan import Device, DevicePlan, Plan

FIELD = "spec.placement.tensor_parallel"


def rank_weight_bytes(structure: Structure, ranks: int) -> list[int]:
    """Weights held by each rank: its slice of what is split, plus all that is replicated."""
    split = sum(b.split_bytes for b in structure.blocks)
    whole = structure.weight_bytes - split
    base, extra = divmod(split, ranks)
    return [whole + base + (1 if r < extra else 0) for r in range(ranks)]


def plan_tensor_parallel(structure: Structure, spec: Spec, inventory: Inventory, *, name: str = "") -> Plan:
    """The plan of ``structure`` split across ``spec.placement.tensor_parallel`` ranks."""
    ranks = spec.placement.tensor_parallel
    if not any(b.split_bytes for b in structure.blocks):
        raise PlanInfeasible(f"{structure.architecture} declares no tensor-parallel plan in transformers: it cannot "
                             "be split across ranks; set tensor_parallel to 1", field=FIELD)
    devices = _rank_devices(spec, inventory, ranks)
    tokens = spec.placement.kv_cache.tokens if spec.placement.kv_cache else 0
    cache = tokens * sum(-(-b.kv_bytes_per_token // ranks) + b.logits_bytes_per_token for b in structure.blocks)
    weights = rank_weight_bytes(structure, ranks)
    blocks = compress_names([b.name for b in structure.blocks])
    plans, shortfall = [], {}
    for rank, (device, tier, budget) in enumerate(devices):
        need = weights[rank] + cache
        if budget is not None and need > budget:
            shortfall[f"cuda:{device}" if tier == "gpu" else str(device)] = need - budget
        plans.append(DevicePlan(device=device, tier=tier, bytes=need, weight_bytes=weights[rank], budget=budget,
                                blocks=blocks, load=need, ratio=1.0, target_share=round(1 / ranks, 6),
                                actual_share=round(weights[rank] / sum(weights), 6)))
    if shortfall:
        worst = max(shortfall, key=shortfall.__getitem__)
        raise PlanInfeasible(f"each of the {ranks} ranks needs {format_size(plans[0].bytes)} (its share of the "
                             f"weights{' and KV cache' if cache else ''}); {worst} is short by "
                             f"{format_size(shortfall[worst])}: add ranks, lower placement.reserve or use larger "
                             "devices", shortfall=shortfall, field=FIELD)
    first: Device = devices[0][0] if devices[0][1] == "gpu" else "cpu"
    device_map = {module: first for b in structure.blocks for module in b.modules}
    split = sum(b.split_bytes for b in structure.blocks)
    notes = (*structure.notes,
             f"tensor parallel: every block on each of {ranks} ranks; {format_size(split)} of weights split "
             f"{ranks} ways, {format_size(structure.weight_bytes - split)} replicated on every rank")
    return Plan(name=name, architecture=structure.architecture, dtype=structure.dtype,
                balance=spec.placement.balance, device_map=device_map, devices=tuple(plans),
                bottleneck_factor=round(max(p.actual_share or 0 for p in plans) * ranks, 6),
                total_bytes=sum(p.bytes for p in plans), kv_cache_tokens=tokens or None, notes=notes,
                digest=_digest(name, structure, device_map, ranks))


RankDevice = tuple[Device, Literal["gpu", "cpu"], int | None]


def _rank_devices(spec: Spec, inventory: Inventory, ranks: int) -> list[RankDevice]:
    """(device, tier, budget) of each rank: the listed GPUs, else worker processes sharing the host RAM."""
    gpus = [g.index for g in inventory.gpus] if spec.placement.gpus == "all" else list(spec.placement.gpus)
    if not gpus:
        budget = inventory.cpu // ranks if inventory.cpu is not None else None
        return [(f"cpu:{r}", "cpu", budget) for r in range(ranks)]
    if len(gpus) != ranks:
        raise PlanInfeasible(f"tensor_parallel {ranks} needs one GPU per rank; placement.gpus gives {len(gpus)} "
                             f"on this inventory ({inventory.describe()})", field=FIELD)
    out: list[RankDevice] = []
    for g in gpus:
        gpu = inventory.gpu(g)
        if gpu is None:
            raise PlanInfeasible(f"GPU {g} not in the inventory ({inventory.describe()})",
                                 field="spec.placement.gpus")
        out.append((g, "gpu", max(0, gpu.memory - spec.placement.reserve)))
    return out


def _digest(name: str, structure: Structure, device_map: dict[str, Device], ranks: int) -> str:
    decided = {"name": name, "architecture": structure.architecture, "dtype": structure.dtype,
               "device_map": list(device_map.items()), "tensor_parallel": ranks}
    return "sha256:" + hashlib.sha256(json.dumps(decided, separators=(",", ":")).encode()).hexdigest()
