"""What a host offers and what each block needs: the sizes and loads of the blocks under a spec, the GPUs
a spec places on (and their ratios), each GPU's budget (memory - reserve) and the offload tiers' budgets.
Shared by single-host and multi-node planning."""

from __future__ import annotations

from typing import NamedTuple

from ..errors import PlanInfeasible
from ..model.structure import Block, Structure
from ..spec.schema import Spec
from ..spec.speculative import verification_positions
from .inventory import Inventory


class BlockSizes(NamedTuple):
    """Per block, in execution order: its size on a GPU, its size offloaded, and the load balanced."""

    tokens: int  # placement.kv_cache.tokens, 0 without a planned KV cache
    gpu: list[int]  # weights plus KV cache and logits
    offload: list[int]  # weights only: caches live where the layer executes
    loads: list[int]  # the GPU size (balance: memory) or FLOPs per token (balance: compute)


def block_sizes(structure: Structure, spec: Spec) -> BlockSizes:
    blocks = structure.blocks
    tokens = spec.placement.kv_cache.tokens if spec.placement.kv_cache else 0
    if tokens:  # speculative decoding's verification positions, beside the rows' own
        tokens += verification_positions(spec)
    gpu = [_footprint(b, tokens) for b in blocks]
    offload = [b.weight_bytes for b in blocks]
    loads = gpu if spec.placement.balance == "memory" else [b.flops_per_token for b in blocks]
    return BlockSizes(tokens, gpu, offload, loads)


def _footprint(block: Block, tokens: int) -> int:
    return block.weight_bytes + tokens * (block.kv_bytes_per_token + block.logits_bytes_per_token)


def resolve_gpus(spec: Spec, inventory: Inventory) -> tuple[list[int], list[float]]:
    """The GPU indices ``spec.placement.gpus`` names on ``inventory`` and their ratios (1.0 each unless
    given); ``PlanInfeasible`` for an index the inventory lacks."""
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


def gpu_budgets(spec: Spec, inventory: Inventory, gpus: list[int]) -> dict[int, int]:
    """Each GPU's budget: its memory minus ``placement.reserve`` (never below 0)."""
    reserve = spec.placement.reserve
    return {g: max(0, inventory.gpu(g).memory - reserve) for g in gpus}  # type: ignore[union-attr]


def offload_tiers(spec: Spec, inventory: Inventory) -> list[tuple[str, int | None]]:
    """The enabled offload tiers in order (cpu, then disk) and their budgets (None: not limited)."""
    tiers: list[tuple[str, int | None]] = []
    if spec.offload.cpu is not None:
        tiers.append(("cpu", _tier_budget(spec.offload.cpu.max_memory, inventory.cpu)))
    if spec.offload.disk is not None:
        tiers.append(("disk", _tier_budget(spec.offload.disk.max_size, inventory.disk)))
    return tiers


def _tier_budget(limit: int | None, host: int | None) -> int | None:
    values = [v for v in (limit, host) if v is not None]
    return min(values) if values else None


def host_capacity(spec: Spec, host: Inventory) -> tuple[list[int], list[int | None], float]:
    """(GPU budgets of the active GPUs in order, tier budgets in order, the node's ratio)."""
    gpus, ratios = resolve_gpus(spec, host)
    budgets = gpu_budgets(spec, host, gpus)
    active = [budgets[g] for g, r in zip(gpus, ratios) if r > 0]
    tiers = [budget for _tier, budget in offload_tiers(spec, host)]
    node_ratio = sum(r for r in ratios if r > 0) or 1.0
    return active, tiers, node_ratio
