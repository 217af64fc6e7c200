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
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from ..errors import PlanInfeasible
from .inventory import Inventory
from ..spec.schema import Spec
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
        return cls(**{**data, "devices": devices, "notes": tuple(data.get("notes", ())), "nodes": nodes,
                      "device_nodes": tuple(data.get("device_nodes", ())),
                      "node_map": dict(data.get("node_map", {}))})


def _digest(name: str, architecture: str, dtype: str, device_map: dict[str, Device],
            node_map: dict[str, int] | None = None, quantization: str = "none") -> str:
    decided: dict[str, Any] = {"name": name, "architecture": architecture, "dtype": dtype,
                               "device_map": list(device_map.items())}
    if node_map:  # only multi-node plans: one-node digests stay what they were
        decided["node_map"] = list(node_map.items())
    if quantization != "none":  # only quantized plans: others keep their digest
        decided["quantization"] = quantization
    payload = json.dumps(decided, separators=(",", ":"))
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
    n = len(loads)
    lp, sp = _prefix(loads), _prefix(sizes)

    def run_ok(a: int, b: int, k: int) -> bool:
        return sp[b] - sp[a] <= budgets[k] and (k > 0 or b >= min_first)

    def value(a: int, b: int, k: int) -> float:
        return (lp[b] - lp[a]) / ratios[k]

    def pairs(k: int) -> Iterator[tuple[int, int]]:
        for b in range(n + 1):
            for a in range(b, -1, -1):
                if sp[b] - sp[a] > budgets[k]:
                    break  # longer runs only get bigger
                if run_ok(a, b, k):
                    yield a, b

    return _two_stage_split(n, lp, ratios, pairs)


def _two_stage_split(n: int, lp: Sequence[int], ratios: Sequence[float],
                     pairs: Callable[[int], Iterable[tuple[int, int]]]) -> tuple[list[int], float]:
    """The exact split both planners share: run k may be [a, b) for each (a, b) of ``pairs(k)`` (in the
    order given, which breaks ties). Stage 1 finds the smallest max(load_k / ratio_k); stage 2, among
    splits that reach it, the smallest sum(load_k^2 / ratio_k). Returns (end of each run, optimum)."""
    m = len(ratios)
    best = [[_INF] * (n + 1) for _ in range(m + 1)]  # best[k][b]: smallest max of runs 0..k-1 over [0, b)
    best[0][0] = 0.0
    for k in range(m):
        for a, b in pairs(k):
            if best[k][a] != _INF:
                best[k + 1][b] = min(best[k + 1][b], max(best[k][a], (lp[b] - lp[a]) / ratios[k]))
    optimum = best[m][n]
    if optimum == _INF:
        raise ValueError("no feasible split")
    cost = [[_INF] * (n + 1) for _ in range(m + 1)]
    back = [[0] * (n + 1) for _ in range(m + 1)]
    cost[0][0] = 0.0
    for k in range(m):
        for a, b in pairs(k):
            load = lp[b] - lp[a]
            if cost[k][a] == _INF or load / ratios[k] > optimum:
                continue
            c = cost[k][a] + load * load / ratios[k]
            if c < cost[k + 1][b]:
                cost[k + 1][b], back[k + 1][b] = c, a
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
    if spec.placement.nodes > 1:
        return _plan_nodes(structure, spec, inventory, name=name)
    return _plan_host(structure, spec, inventory, name=name)


def _plan_host(structure: Structure, spec: Spec, inventory: Inventory, *, name: str = "") -> Plan:
    """One machine: GPUs (exact split of the longest prefix that fits), then CPU, then disk."""
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
        kv_cache_tokens=tokens or None, notes=tuple(notes), quantization=spec.model.quantization,
        digest=_digest(name, structure.architecture, structure.dtype, device_map,
                       quantization=spec.model.quantization))


# ---------------------------------------------------------------------------------------------------
# Several nodes: pipeline stages, node-major.


def min_max_stages(loads: Sequence[int], ratios: Sequence[float], max_end: Sequence[Sequence[int]],
                   *, min_first: int = 0) -> tuple[list[int], float]:
    """Split all blocks into len(ratios) contiguous, non-empty runs, run k = [a, b) allowed when
    b <= max_end[k][a] (what node k can hold starting at block a; monotone in b), the first run holding
    at least ``min_first`` blocks. Minimises max(load_k / ratio_k), then sum(load_k^2 / ratio_k) among
    the optimal splits. Returns (end of each run, optimal max); ValueError when infeasible."""
    n = len(loads)
    lp = _prefix(loads)

    def ok(a: int, b: int, k: int) -> bool:
        return a < b <= max_end[k][a] and (k > 0 or b >= min_first)

    def pairs(k: int) -> Iterator[tuple[int, int]]:
        for a in range(n):
            for b in range(a + 1, min(n, max_end[k][a]) + 1):
                if ok(a, b, k):
                    yield a, b

    return _two_stage_split(n, lp, ratios, pairs)


def _host_capacity(spec: Spec, host: Inventory) -> tuple[list[int], list[int | None], float]:
    """(GPU budgets of the active GPUs in order, tier budgets in order, the node's ratio)."""
    gpus, ratios = _resolve_gpus(spec, host)
    reserve = spec.placement.reserve
    gpu_budgets = [max(0, host.gpu(g).memory - reserve)  # type: ignore[union-attr]
                   for g, r in zip(gpus, ratios) if r > 0]
    tiers: list[int | None] = []
    if spec.offload.cpu is not None:
        tiers.append(_tier_budget(spec.offload.cpu.max_memory, host.cpu))
    if spec.offload.disk is not None:
        tiers.append(_tier_budget(spec.offload.disk.max_size, host.disk))
    node_ratio = sum(r for r in ratios if r > 0) or 1.0
    return gpu_budgets, tiers, node_ratio


def _max_end(start: int, gpu_sizes: Sequence[int], offload_sizes: Sequence[int], gpu_budgets: Sequence[int],
             tiers: Sequence[int | None], min_first: int) -> int:
    """The furthest block a node can hold from ``start``: its GPUs filled greedily (the first GPU
    holding the first ``min_first`` blocks), then its tiers. ``start`` when it cannot even do that."""
    pos, n = start, len(gpu_sizes)
    for k, budget in enumerate(gpu_budgets):
        used = 0
        while pos < n and used + gpu_sizes[pos] <= budget:
            used += gpu_sizes[pos]
            pos += 1
        if k == 0 and pos < min_first:
            return start
    for cap in tiers:
        used = 0
        while pos < n and (cap is None or used + offload_sizes[pos] <= cap):
            used += offload_sizes[pos]
            pos += 1
    return pos


def _layer_range(blocks: Sequence[Block]) -> tuple[int, int] | None:
    indices = [int(m.group(1)) for b in blocks if b.kind == "layer"
               for m in [re.search(r"\.(\d+)$", b.name)] if m]
    return (min(indices), max(indices)) if indices else None


def _plan_nodes(structure: Structure, spec: Spec, inventory: Inventory, *, name: str) -> Plan:
    """Pipeline stages: blocks split node-major into one contiguous run per node (exact min-max of the
    node loads over node ratios, each run feasible on its node), then each run planned on its node as
    one host (GPUs, then its CPU and disk tiers); embeddings on the first node's first GPU."""
    count = spec.placement.nodes
    machines = inventory.nodes
    if len(machines) < count:
        have = inventory.describe_nodes() if machines else "a single host (no nodes)"
        found = len(machines) or 1
        raise PlanInfeasible(
            f"placement.nodes is {count}, but the inventory has {found} node{'s' if found != 1 else ''}: "
            f"{have}", field="spec.placement.nodes")
    machines = machines[:count]
    blocks = structure.blocks
    tokens = spec.placement.kv_cache.tokens if spec.placement.kv_cache else 0
    gpu_sizes = [_footprint(b, tokens) for b in blocks]
    offload_sizes = [b.weight_bytes for b in blocks]
    loads = gpu_sizes if spec.placement.balance == "memory" else [b.flops_per_token for b in blocks]
    min_first = structure.embedding_block + 1
    capacity = [_host_capacity(spec, m.host(simulated=inventory.simulated)) for m in machines]
    max_end = [[_max_end(a, gpu_sizes, offload_sizes, gb, tiers, min_first if k == 0 and a == 0 else 0)
                for a in range(len(blocks) + 1)] for k, (gb, tiers, _r) in enumerate(capacity)]
    ratios = [r for _gb, _t, r in capacity]
    try:
        ends, _ = min_max_stages(loads, ratios, max_end, min_first=min_first)
    except ValueError:
        total = sum(offload_sizes)
        raise PlanInfeasible(
            f"the model ({format_size(total)} of weights, {len(blocks)} blocks) does not fit in "
            f"{count} pipeline stages on {inventory.describe_nodes()}: each node holds one contiguous run "
            "of blocks (GPUs, then its own CPU and disk tiers); add nodes or GPUs, lower "
            "placement.reserve or enable an offload tier", field="spec.placement.nodes") from None

    device_map: dict[str, Device] = {}
    node_map: dict[str, int] = {}
    devices: list[DevicePlan] = []
    device_nodes: list[int] = []
    nodes: list[NodePlan] = []
    notes = list(structure.notes)
    total_load = sum(loads) or 1
    ratio_sum = sum(ratios)
    start = 0
    for k, (machine, end) in enumerate(zip(machines, ends)):
        sub = Structure(architecture=structure.architecture, model_type=structure.model_type,
                        dtype=structure.dtype, blocks=blocks[start:end],
                        embedding_block=structure.embedding_block if k == 0 else -1,
                        no_split=structure.no_split)
        part = _plan_host(sub, spec, machine.host(simulated=inventory.simulated), name=name)
        for key, device in part.device_map.items():
            device_map[key] = device
            node_map[key] = k
        devices.extend(part.devices)
        device_nodes.extend([k] * len(part.devices))
        notes.extend(f"{machine.name}: {note}" for note in part.notes)
        load = sum(loads[start:end])
        nodes.append(NodePlan(
            node=k, name=machine.name, blocks=compress_names([b.name for b in blocks[start:end]]),
            layers=_layer_range(blocks[start:end]), bytes=part.total_bytes, load=load,
            target_share=round(ratios[k] / ratio_sum, 6), actual_share=round(load / total_load, 6),
            address=machine.address, id=machine.id))
        start = end

    # The bottleneck over every GPU of every node, against its share of all the GPUs' ratios.
    gpu_devices = [d for d in devices if d.tier == "gpu"]
    gpu_load = sum(d.load for d in gpu_devices)
    all_ratios = sum(d.ratio or 0.0 for d in gpu_devices)
    factor: float | None = None
    rebased: list[DevicePlan] = []
    for d in devices:
        if d.tier == "gpu" and all_ratios:
            target = (d.ratio or 0.0) / all_ratios
            actual = d.load / gpu_load if gpu_load else 0.0
            if target > 0:
                factor = max(factor or 0.0, actual / target)
            d = replace(d, target_share=round(target, 6), actual_share=round(actual, 6))
        rebased.append(d)
    factor = round(factor, 6) if factor is not None and gpu_load else (1.0 if gpu_devices else None)
    return Plan(
        name=name, architecture=structure.architecture, dtype=structure.dtype,
        balance=spec.placement.balance, device_map=device_map, devices=tuple(rebased),
        bottleneck_factor=factor, total_bytes=sum(d.bytes for d in rebased),
        kv_cache_tokens=tokens or None, notes=tuple(notes), quantization=spec.model.quantization,
        digest=_digest(name, structure.architecture, structure.dtype, device_map, node_map,
                       spec.model.quantization),
        node_map=node_map, nodes=tuple(nodes), device_nodes=tuple(device_nodes))
