"""Planning several nodes (``placement.nodes > 1``): pipeline stages, node-major. The blocks are split
into one contiguous run per node (``partition.min_max_stages``: exact min-max of the node loads over the
node ratios, each run feasible on its node), then each run is planned on its node as one host (GPUs,
then its own CPU and disk tiers); the embeddings go on the first node's first GPU."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from ..errors import PlanInfeasible
from ..model.structure import Block, Structure
from ..spec.schema import Spec
from ..units import format_size
from .capacity import BlockSizes, block_sizes, host_capacity
from .host import plan_host
from .inventory import Inventory, Node
from .keys import compress_names
from .partition import min_max_stages
from .plan import Device, DevicePlan, NodePlan, Plan, bottleneck_factor, plan_digest


def plan_nodes(structure: Structure, spec: Spec, inventory: Inventory, *, name: str) -> Plan:
    """Pipeline stages: one contiguous run of blocks per node, each planned on its node as one host."""
    machines = _machines(spec, inventory)
    sizes = block_sizes(structure, spec)
    ends, ratios = _stage_ends(structure, spec, inventory, machines, sizes)
    device_map: dict[str, Device] = {}
    node_map: dict[str, int] = {}
    devices: list[DevicePlan] = []
    device_nodes: list[int] = []
    nodes: list[NodePlan] = []
    notes = list(structure.notes)
    for k, (machine, start, end) in enumerate(zip(machines, [0, *ends], ends)):
        part = plan_host(_stage_structure(structure, k, start, end), spec,
                         machine.host(simulated=inventory.simulated), name=name)
        for key, device in part.device_map.items():
            device_map[key] = device
            node_map[key] = k
        devices.extend(part.devices)
        device_nodes.extend([k] * len(part.devices))
        notes.extend(f"{machine.name}: {note}" for note in part.notes)
        nodes.append(_node_plan(k, machine, structure.blocks[start:end], part, sizes.loads[start:end],
                                total_load=sum(sizes.loads) or 1, share=ratios[k] / sum(ratios)))
    rebased, factor = _rebase(devices)
    return Plan(
        name=name, architecture=structure.architecture, dtype=structure.dtype,
        balance=spec.placement.balance, device_map=device_map, devices=tuple(rebased),
        bottleneck_factor=factor, total_bytes=sum(d.bytes for d in rebased),
        kv_cache_tokens=sizes.tokens or None, notes=tuple(notes), quantization=spec.model.quantization,
        digest=plan_digest(name, structure.architecture, structure.dtype, device_map, node_map,
                           spec.model.quantization),
        node_map=node_map, nodes=tuple(nodes), device_nodes=tuple(device_nodes))


def _machines(spec: Spec, inventory: Inventory) -> tuple[Node, ...]:
    """The first ``placement.nodes`` machines of the inventory; ``PlanInfeasible`` when it has fewer."""
    count = spec.placement.nodes
    machines = inventory.nodes
    if len(machines) < count:
        have = inventory.describe_nodes() if machines else "a single host (no nodes)"
        found = len(machines) or 1
        raise PlanInfeasible(
            f"placement.nodes is {count}, but the inventory has {found} node{'s' if found != 1 else ''}: "
            f"{have}", field="spec.placement.nodes")
    return machines[:count]


def _stage_ends(structure: Structure, spec: Spec, inventory: Inventory, machines: Sequence[Node],
                sizes: BlockSizes) -> tuple[list[int], list[float]]:
    """Where each node's run of blocks ends (the exact min-max split), and each node's ratio."""
    count = len(structure.blocks)
    min_first = structure.embedding_block + 1
    capacity = [host_capacity(spec, m.host(simulated=inventory.simulated)) for m in machines]
    max_end = [[_max_end(a, sizes.gpu, sizes.offload, gb, tiers, min_first if k == 0 and a == 0 else 0)
                for a in range(count + 1)] for k, (gb, tiers, _r) in enumerate(capacity)]
    ratios = [r for _gb, _t, r in capacity]
    try:
        ends, _ = min_max_stages(sizes.loads, ratios, max_end, min_first=min_first)
    except ValueError:
        total = sum(sizes.offload)
        raise PlanInfeasible(
            f"the model ({format_size(total)} of weights, {count} blocks) does not fit in "
            f"{spec.placement.nodes} pipeline stages on {inventory.describe_nodes()}: each node holds one "
            "contiguous run of blocks (GPUs, then its own CPU and disk tiers); add nodes or GPUs, lower "
            "placement.reserve or enable an offload tier", field="spec.placement.nodes") from None
    return ends, ratios


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


def _stage_structure(structure: Structure, k: int, start: int, end: int) -> Structure:
    """The blocks [start, end) of stage ``k`` as a structure of their own (embeddings only on stage 0)."""
    return Structure(architecture=structure.architecture, model_type=structure.model_type,
                     dtype=structure.dtype, blocks=structure.blocks[start:end],
                     embedding_block=structure.embedding_block if k == 0 else -1,
                     no_split=structure.no_split)


def _node_plan(k: int, machine: Node, run: Sequence[Block], part: Plan, loads: Sequence[int], *,
               total_load: int, share: float) -> NodePlan:
    """Stage ``k``'s summary: its machine, its run of blocks and layers, its load against its share."""
    load = sum(loads)
    return NodePlan(
        node=k, name=machine.name, blocks=compress_names([b.name for b in run]),
        layers=_layer_range(run), bytes=part.total_bytes, load=load,
        target_share=round(share, 6), actual_share=round(load / total_load, 6),
        address=machine.address, id=machine.id)


def _layer_range(blocks: Sequence[Block]) -> tuple[int, int] | None:
    indices = [int(m.group(1)) for b in blocks if b.kind == "layer"
               for m in [re.search(r"\.(\d+)$", b.name)] if m]
    return (min(indices), max(indices)) if indices else None


def _rebase(devices: Sequence[DevicePlan]) -> tuple[list[DevicePlan], float | None]:
    """Every GPU's shares against all the GPUs of every node, and the bottleneck over them all."""
    gpu_devices = [d for d in devices if d.tier == "gpu"]
    gpu_load = sum(d.load for d in gpu_devices)
    all_ratios = sum(d.ratio or 0.0 for d in gpu_devices)
    shares: list[tuple[float, float]] = []
    rebased: list[DevicePlan] = []
    for d in devices:
        if d.tier == "gpu" and all_ratios:
            target = (d.ratio or 0.0) / all_ratios
            actual = d.load / gpu_load if gpu_load else 0.0
            shares.append((target, actual))
            d = replace(d, target_share=round(target, 6), actual_share=round(actual, 6))
        rebased.append(d)
    return rebased, bottleneck_factor(shares, gpu_load, bool(gpu_devices))
