"""Planning one machine: the longest prefix of blocks its GPUs can hold, split exactly across them
(``partition.min_max_partition``), then the rest to its CPU tier and then its disk tier, each up to its
budget. ``PlanInfeasible`` says what is missing after each tier when the model does not fit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import PlanInfeasible
from ..model.structure import Block, Structure
from ..spec.schema import Spec
from ..spec.speculative import verification_positions
from ..units import format_size
from .capacity import BlockSizes, block_sizes, gpu_budgets, offload_tiers, resolve_gpus
from .inventory import Inventory
from .keys import compress_names
from .partition import longest_prefix, min_max_partition
from .plan import Device, DevicePlan, Plan, bottleneck_factor, plan_digest


def plan_host(structure: Structure, spec: Spec, inventory: Inventory, *, name: str = "") -> Plan:
    """One machine: GPUs (exact split of the longest prefix that fits), then CPU, then disk."""
    blocks = structure.blocks
    sizes = block_sizes(structure, spec)
    gpus, ratios = resolve_gpus(spec, inventory)
    budgets = gpu_budgets(spec, inventory, gpus)
    held, gpu_ends = _split_gpus(structure, spec, sizes, gpus, ratios, budgets)
    tiers = offload_tiers(spec, inventory)
    tier_ends = _fill_tiers(structure, sizes.offload, held, gpus, budgets, tiers)
    gpu_devices, factor = _gpu_devices(blocks, sizes, gpus, ratios, budgets, gpu_ends)
    devices = gpu_devices + _tier_devices(blocks, sizes, tiers, tier_ends)
    runs = [(g, gpu_ends.get(g, (0, 0))) for g in gpus] + [(tier, tier_ends[tier]) for tier, _b in tiers]
    device_map = _device_map(blocks, runs)
    return Plan(
        name=name, architecture=structure.architecture, dtype=structure.dtype,
        balance=spec.placement.balance, device_map=device_map, devices=tuple(devices),
        bottleneck_factor=factor, total_bytes=sum(d.bytes for d in devices),
        kv_cache_tokens=sizes.tokens or None, notes=tuple(_notes(structure, sizes, ratios, held, spec)),
        quantization=spec.model.quantization,
        digest=plan_digest(name, structure.architecture, structure.dtype, device_map,
                           quantization=spec.model.quantization))


def _split_gpus(structure: Structure, spec: Spec, sizes: BlockSizes, gpus: list[int], ratios: list[float],
                budgets: dict[int, int]) -> tuple[int, dict[int, tuple[int, int]]]:
    """How many leading blocks the GPUs hold (the longest prefix that fits), and the run [start, end) of
    each active GPU: the exact min-max split of that prefix, the embeddings on the first active GPU."""
    active = [i for i, g in enumerate(gpus) if ratios[i] > 0]
    if not active:
        return 0, {}
    min_first = structure.embedding_block + 1
    act_budgets = [budgets[gpus[i]] for i in active]
    held = longest_prefix(sizes.gpu, act_budgets, min_first=min_first)
    if held < 0:
        first, reserve = gpus[active[0]], spec.placement.reserve
        need = sum(sizes.gpu[:min_first])
        raise PlanInfeasible(
            f"GPU {first} cannot hold the input embeddings: they need {format_size(need)}, its "
            f"budget is {format_size(budgets[first])} (memory - reserve {format_size(reserve)})",
            shortfall={f"cuda:{first}": need - budgets[first]}, field="spec.placement.gpus")
    ends, _ = min_max_partition(sizes.loads[:held], sizes.gpu[:held], [ratios[i] for i in active],
                                act_budgets, min_first=min_first)
    gpu_ends: dict[int, tuple[int, int]] = {}
    start = 0
    for i, end in zip(active, ends):
        gpu_ends[gpus[i]] = (start, end)
        start = end
    return held, gpu_ends


def _fill_tiers(structure: Structure, offload_sizes: list[int], held: int, gpus: list[int],
                budgets: dict[int, int], tiers: list[tuple[str, int | None]]) -> dict[str, tuple[int, int]]:
    """The blocks past the GPUs' ``held`` to each tier in order, as many as its budget takes: the run
    [start, end) of each tier. ``PlanInfeasible`` with the shortfall after each tier when some are left."""
    blocks = structure.blocks
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
        raise PlanInfeasible(_infeasible_message(structure, gpus, budgets, tiers, shortfall),
                             shortfall=shortfall, field="spec.offload")
    return tier_ends


def _infeasible_message(structure: Structure, gpus: list[int], budgets: dict[int, int],
                        tiers: list[tuple[str, int | None]], shortfall: dict[str, int]) -> str:
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


def _gpu_devices(blocks: Sequence[Block], sizes: BlockSizes, gpus: list[int], ratios: list[float],
                 budgets: dict[int, int],
                 gpu_ends: dict[int, tuple[int, int]]) -> tuple[list[DevicePlan], float | None]:
    """What each GPU holds, its target share (of the ratios) and actual share (of the GPUs' load), and
    the plan's bottleneck factor."""
    loads = sizes.loads
    gpu_load = sum(sum(loads[a:b]) for a, b in gpu_ends.values())
    ratio_sum = sum(r for r in ratios if r > 0)
    devices: list[DevicePlan] = []
    shares: list[tuple[float, float]] = []
    for g, ratio in zip(gpus, ratios):
        a, b = gpu_ends.get(g, (0, 0))
        load = sum(loads[a:b])
        target = ratio / ratio_sum if ratio_sum else 0.0
        actual = load / gpu_load if gpu_load else 0.0
        shares.append((target, actual))
        devices.append(DevicePlan(
            device=g, tier="gpu", bytes=sum(sizes.gpu[a:b]),
            weight_bytes=sum(bl.weight_bytes for bl in blocks[a:b]), budget=budgets[g],
            blocks=compress_names([bl.name for bl in blocks[a:b]]), load=load, ratio=ratio,
            target_share=round(target, 6), actual_share=round(actual, 6)))
    return devices, bottleneck_factor(shares, gpu_load, bool(gpus))


def _tier_devices(blocks: Sequence[Block], sizes: BlockSizes, tiers: list[tuple[str, int | None]],
                  tier_ends: dict[str, tuple[int, int]]) -> list[DevicePlan]:
    """What each offload tier holds: weights only."""
    devices: list[DevicePlan] = []
    for tier, budget in tiers:
        a, b = tier_ends[tier]
        devices.append(DevicePlan(
            device=tier, tier=tier, bytes=sum(sizes.offload[a:b]),  # type: ignore[arg-type]
            weight_bytes=sum(sizes.offload[a:b]), budget=budget,
            blocks=compress_names([bl.name for bl in blocks[a:b]]), load=sum(sizes.loads[a:b])))
    return devices


def _device_map(blocks: Sequence[Block], runs: Iterable[tuple[Device, tuple[int, int]]]) -> dict[str, Device]:
    """Every module of every block to the device whose run [start, end) holds the block."""
    assignment: list[Device] = [""] * len(blocks)
    for device, (a, b) in runs:
        for i in range(a, b):
            assignment[i] = device
    device_map: dict[str, Device] = {}
    for block, device in zip(blocks, assignment):
        for module in block.modules:
            device_map[module] = device
    return device_map


def _notes(structure: Structure, sizes: BlockSizes, ratios: list[float], held: int, spec: Spec) -> list[str]:
    """The structure's notes, one when some blocks (or all: no active GPU) are offloaded, and one for
    speculative decoding's verification positions."""
    notes = list(structure.notes)
    extra = verification_positions(spec)
    if extra:
        notes.append(f"speculative decoding ({spec.speculative.method if spec.speculative else ''}): up to {extra} "
                     "more KV positions while drafts are verified"
                     + (" (counted in the KV cache's tokens)" if sizes.tokens else ""))
    count = len(structure.blocks)
    if not any(r > 0 for r in ratios):
        notes.append("no GPU in placement: every block runs from the CPU and disk tiers")
    elif held < count:
        notes.append(f"{count - held} of {count} blocks do not fit on the GPUs and are "
                     f"offloaded ({format_size(sum(sizes.offload[held:]))})")
    return notes
