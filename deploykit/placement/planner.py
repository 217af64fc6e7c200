"""Pure placement planning: ``plan(structure, spec, inventory) -> Plan``.

No I/O, no torch, no clock: the same inputs give the same plan, byte for byte, so a plan can be
computed anywhere (CI, a laptop, against a simulated inventory) and compared by digest.

The algorithm (docs/planning.md has a worked example):

1. Each block's *footprint* is its weights, plus its KV cache and logits when ``placement.kv_cache``
   is set. Its *load* is the footprint (``balance: memory``) or its FLOPs per token (``compute``).
2. The GPUs take the longest prefix of blocks (in execution order) that fits their budgets
   (memory - reserve) as contiguous runs. Greedy filling finds that prefix; offloading is far costlier
   than imbalance, so the GPUs hold as much as they can.
3. That prefix is split into one contiguous run per GPU minimising max(load_i / ratio_i) exactly, by
   dynamic programming over (GPU, block) with the capacity and "embeddings on the first GPU"
   constraints. Among the optimal splits, a second DP picks the one with the smallest
   sum(load_i^2 / ratio_i), i.e. the most even one (loads proportional to ratios where blocks allow).
4. The remaining blocks go to the CPU tier up to its budget, then to disk. If some still do not fit,
   ``PlanInfeasible`` says how much is missing after each tier.

accelerate's ``infer_auto_device_map`` fills devices greedily and ``get_balanced_memory`` only
estimates per-GPU caps, so their split is not optimal; the exact partition is written here because no
library computes one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ..errors import PlanInfeasible
from .inventory import Inventory
from ..spec.manifest import Spec
from ..model.structure import Block, Structure
from ..units import format_size

Device = int | str  # accelerate's convention: GPU index, "cpu" or "disk"
_INF = float("inf")


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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = [asdict(d) for d in self.devices]
        data["notes"] = list(self.notes)
        for d in data["devices"]:
            d["blocks"] = list(d["blocks"])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        devices = tuple(DevicePlan(**{**d, "blocks": tuple(d["blocks"])}) for d in data["devices"])
        return cls(**{**data, "devices": devices, "notes": tuple(data.get("notes", ()))})


def _digest(name: str, architecture: str, dtype: str, device_map: dict[str, Device]) -> str:
    payload = json.dumps({"name": name, "architecture": architecture, "dtype": dtype,
                          "device_map": list(device_map.items())}, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------
# The partition core: small pure functions over plain lists, tested against brute force.


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def longest_prefix(sizes: Sequence[int], budgets: Sequence[int], *, min_first: int = 0) -> int:
    """How many leading blocks the devices can hold as contiguous runs (greedy fill is optimal).

    Returns -1 when the first device cannot hold the first ``min_first`` blocks.
    """
    pos = 0
    for k, budget in enumerate(budgets):
        used = 0
        while pos < len(sizes) and used + sizes[pos] <= budget:
            used += sizes[pos]
            pos += 1
        if k == 0 and pos < min_first:
            return -1
    return pos


def min_max_partition(loads: Sequence[int], sizes: Sequence[int], ratios: Sequence[float],
                      budgets: Sequence[int], *, min_first: int = 0) -> tuple[list[int], float]:
    """Split all blocks into len(ratios) contiguous (possibly empty) runs.

    Minimises max(sum(loads of run k) / ratios[k]) subject to sum(sizes of run k) <= budgets[k] and
    the first run holding at least ``min_first`` blocks; among optimal splits, minimises
    sum(load_k^2 / ratio_k). Returns (the end index of each run, the optimal max). Raises ValueError
    when no split is feasible.
    """
    n, m = len(loads), len(ratios)
    lp, sp = _prefix(loads), _prefix(sizes)

    def run_ok(a: int, b: int, k: int) -> bool:
        return sp[b] - sp[a] <= budgets[k] and (k > 0 or b >= min_first)

    def value(a: int, b: int, k: int) -> float:
        return (lp[b] - lp[a]) / ratios[k]

    # Stage 1: exact min-max. best[k][b]: smallest max over runs 0..k-1 covering blocks [0, b).
    best = [[_INF] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for k in range(m):
        cur, nxt = best[k], best[k + 1]
        for b in range(n + 1):
            for a in range(b, -1, -1):
                if sp[b] - sp[a] > budgets[k]:
                    break  # longer runs only get bigger
                if cur[a] == _INF or not run_ok(a, b, k):
                    continue
                v = max(cur[a], value(a, b, k))
                if v < nxt[b]:
                    nxt[b] = v
    optimum = best[m][n]
    if optimum == _INF:
        raise ValueError("no feasible split")

    # Stage 2: among splits whose every run is <= optimum, the most even one.
    cost = [[_INF] * (n + 1) for _ in range(m + 1)]
    back = [[0] * (n + 1) for _ in range(m + 1)]
    cost[0][0] = 0.0
    for k in range(m):
        cur, nxt = cost[k], cost[k + 1]
        for b in range(n + 1):
            for a in range(b, -1, -1):
                if sp[b] - sp[a] > budgets[k]:
                    break
                if cur[a] == _INF or not run_ok(a, b, k) or value(a, b, k) > optimum:
                    continue
                load = lp[b] - lp[a]
                c = cur[a] + load * load / ratios[k]
                if c < nxt[b]:
                    nxt[b], back[k + 1][b] = c, a
    ends = [n]
    for k in range(m, 1, -1):
        ends.append(back[k][ends[-1]])
    return ends[::-1], optimum


# ---------------------------------------------------------------------------------------------------
# From manifest + structure + inventory to a Plan.


def compress_names(names: Sequence[str]) -> tuple[str, ...]:
    """["model.layers.0", "model.layers.1", "model.norm"] -> ("model.layers.0-1", "model.norm")."""
    out: list[str] = []
    run_prefix, run_start, run_end = None, 0, 0
    for name in names:
        match = re.match(r"^(.*\.)(\d+)$", name)
        if match and match.group(1) == run_prefix and int(match.group(2)) == run_end + 1:
            run_end += 1
            out[-1] = f"{run_prefix}{run_start}-{run_end}"
            continue
        out.append(name)
        run_prefix, run_start, run_end = (match.group(1), int(match.group(2)),
                                          int(match.group(2))) if match else (None, 0, 0)
    return tuple(out)


def placement_key(name: str, device_map: Mapping[str, Any]) -> str | None:
    """The device_map key that places module or tensor ``name``: the longest key equal to it or a dotted
    prefix of it. Checkpoints saved from a base model may carry one extra leading component
    (``bert.encoder...``), tried second."""
    candidates = [name] + ([name.split(".", 1)[1]] if "." in name else [])
    for candidate in candidates:
        parts = candidate.split(".")
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if key in device_map:
                return key
    return "" if "" in device_map else None


def _footprint(block: Block, tokens: int) -> int:
    return block.weight_bytes + tokens * (block.kv_bytes_per_token + block.logits_bytes_per_token)


def _resolve_gpus(spec: Spec, inventory: Inventory) -> tuple[list[int], list[float]]:
    placement = spec.placement
    if placement.gpus == "all":
        gpus = [g.index for g in inventory.gpus]
    else:
        gpus = list(placement.gpus)
    missing = [g for g in gpus if inventory.gpu(g) is None]
    if missing:
        have = ", ".join(str(g.index) for g in inventory.gpus) or "none"
        raise PlanInfeasible(
            f"GPU {', '.join(map(str, missing))} not in the inventory ({inventory.describe()}; "
            f"GPU indices available: {have})", field="spec.placement.gpus")
    ratios = list(placement.ratios) if placement.ratios is not None else [1.0] * len(gpus)
    return gpus, ratios


def _tier_budget(limit: int | None, host: int | None) -> int | None:
    values = [v for v in (limit, host) if v is not None]
    return min(values) if values else None


def plan(structure: Structure, spec: Spec, inventory: Inventory, *, name: str = "") -> Plan:
    """Place ``structure`` on the devices ``spec`` allows within ``inventory``. Pure."""
    blocks = structure.blocks
    tokens = spec.placement.kv_cache.tokens if spec.placement.kv_cache else 0
    gpu_sizes = [_footprint(b, tokens) for b in blocks]
    offload_sizes = [b.weight_bytes for b in blocks]  # caches live where the layer executes
    loads = gpu_sizes if spec.placement.balance == "memory" else [b.flops_per_token for b in blocks]
    gpus, ratios = _resolve_gpus(spec, inventory)
    reserve = spec.placement.reserve
    budgets = {g: max(0, inventory.gpu(g).memory - reserve) for g in gpus}  # type: ignore[union-attr]
    active = [i for i, g in enumerate(gpus) if ratios[i] > 0]
    notes = list(structure.notes)

    # 1. The longest prefix the GPUs can hold; 2. its exact min-max split.
    gpu_ends: dict[int, tuple[int, int]] = {}
    held = 0
    if active:
        act_budgets = [budgets[gpus[i]] for i in active]
        held = longest_prefix(gpu_sizes, act_budgets, min_first=structure.embedding_block + 1)
        if held < 0:
            first = gpus[active[0]]
            need = sum(gpu_sizes[: structure.embedding_block + 1])
            raise PlanInfeasible(
                f"GPU {first} cannot hold the input embeddings: they need {format_size(need)}, its "
                f"budget is {format_size(budgets[first])} (memory - reserve {format_size(reserve)})",
                shortfall={f"cuda:{first}": need - budgets[first]}, field="spec.placement.gpus")
        ends, _ = min_max_partition(loads[:held], gpu_sizes[:held], [ratios[i] for i in active],
                                    act_budgets, min_first=structure.embedding_block + 1)
        start = 0
        for i, end in zip(active, ends):
            gpu_ends[gpus[i]] = (start, end)
            start = end

    # 3. The rest to CPU, then disk, in order.
    tiers: list[tuple[str, int | None]] = []
    if spec.offload.cpu is not None:
        tiers.append(("cpu", _tier_budget(spec.offload.cpu.max_memory, inventory.cpu)))
    if spec.offload.disk is not None:
        tiers.append(("disk", _tier_budget(spec.offload.disk.max_size, inventory.disk)))
    tier_ends: dict[str, tuple[int, int]] = {}
    pos = held
    shortfall = {"gpu": sum(offload_sizes[held:])}
    for tier, budget in tiers:
        start, used = pos, 0
        while pos < len(blocks) and (budget is None or used + offload_sizes[pos] <= budget):
            used += offload_sizes[pos]
            pos += 1
        tier_ends[tier] = (start, pos)
        shortfall[tier] = sum(offload_sizes[pos:])
    if pos < len(blocks):
        raise PlanInfeasible(_infeasible_message(structure, pos, held, gpus, budgets, tiers, shortfall),
                             shortfall=shortfall, field="spec.offload")
    if not active:
        notes.append("no GPU in placement: every block runs from the CPU and disk tiers")
    elif held < len(blocks):
        notes.append(f"{len(blocks) - held} of {len(blocks)} blocks do not fit on the GPUs and are "
                     f"offloaded ({format_size(sum(offload_sizes[held:]))})")

    return _assemble(structure, spec, name=name, gpus=gpus, ratios=ratios, budgets=budgets,
                     gpu_ends=gpu_ends, tiers=tiers, tier_ends=tier_ends, gpu_sizes=gpu_sizes,
                     offload_sizes=offload_sizes, loads=loads, tokens=tokens, notes=notes)


def _infeasible_message(structure: Structure, pos: int, held: int, gpus: list[int],
                        budgets: dict[int, int], tiers: list[tuple[str, int | None]],
                        shortfall: dict[str, int]) -> str:
    total = structure.weight_bytes
    parts = [f"the model needs {format_size(total)} of weights and does not fit: "
             f"GPUs {gpus or 'none'} (budget {format_size(sum(budgets.values()))}) leave "
             f"{format_size(shortfall['gpu'])}"]
    for tier, budget in tiers:
        cap = "unlimited" if budget is None else format_size(budget)
        parts.append(f"then {tier} (budget {cap}) leaves {format_size(shortfall[tier])}")
    if not tiers:
        parts.append("and no offload tier is enabled")
    hint = ("add GPUs, lower placement.reserve, raise offload.cpu.max_memory or add an "
            "offload.disk tier")
    return "; ".join(parts) + f". {format_size(shortfall[list(shortfall)[-1]])} do not fit ({hint})"


def _assemble(structure: Structure, spec: Spec, *, name: str, gpus: list[int], ratios: list[float],
              budgets: dict[int, int], gpu_ends: dict[int, tuple[int, int]],
              tiers: list[tuple[str, int | None]], tier_ends: dict[str, tuple[int, int]],
              gpu_sizes: list[int], offload_sizes: list[int], loads: list[int], tokens: int,
              notes: list[str]) -> Plan:
    blocks = structure.blocks
    assignment: list[Device] = [""] * len(blocks)
    devices: list[DevicePlan] = []
    gpu_load = sum(sum(loads[a:b]) for a, b in gpu_ends.values())
    ratio_sum = sum(r for r in ratios if r > 0)
    factor: float | None = None
    for g, ratio in zip(gpus, ratios):
        a, b = gpu_ends.get(g, (0, 0))
        for i in range(a, b):
            assignment[i] = g
        load = sum(loads[a:b])
        target = ratio / ratio_sum if ratio_sum else 0.0
        actual = load / gpu_load if gpu_load else 0.0
        if target > 0:
            factor = max(factor or 0.0, actual / target)
        devices.append(DevicePlan(
            device=g, tier="gpu", bytes=sum(gpu_sizes[a:b]),
            weight_bytes=sum(bl.weight_bytes for bl in blocks[a:b]), budget=budgets[g],
            blocks=compress_names([bl.name for bl in blocks[a:b]]), load=load, ratio=ratio,
            target_share=round(target, 6), actual_share=round(actual, 6)))
    for tier, budget in tiers:
        a, b = tier_ends[tier]
        for i in range(a, b):
            assignment[i] = tier
        devices.append(DevicePlan(
            device=tier, tier=tier, bytes=sum(offload_sizes[a:b]),  # type: ignore[arg-type]
            weight_bytes=sum(offload_sizes[a:b]), budget=budget,
            blocks=compress_names([bl.name for bl in blocks[a:b]]), load=sum(loads[a:b])))
    device_map: dict[str, Device] = {}
    for block, device in zip(blocks, assignment):
        for module in block.modules:
            device_map[module] = device
    factor = round(factor, 6) if factor is not None and gpu_load else (1.0 if gpus else None)
    return Plan(
        name=name, architecture=structure.architecture, dtype=structure.dtype,
        balance=spec.placement.balance, device_map=device_map, devices=tuple(devices),
        bottleneck_factor=factor, total_bytes=sum(d.bytes for d in devices),
        kv_cache_tokens=tokens or None, notes=tuple(notes),
        digest=_digest(name, structure.architecture, structure.dtype, device_map))
