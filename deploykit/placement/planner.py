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

The modules: ``capacity`` (block sizes, GPU and tier budgets), ``partition`` (the exact splits),
``host`` (one machine: steps 2-4), ``nodes`` (pipeline stages over several machines), ``plan`` (the
``Plan`` it returns) and ``keys`` (block names in a device_map).

accelerate's ``infer_auto_device_map`` fills devices greedily and ``get_balanced_memory`` only
estimates per-GPU caps, so their split is not optimal; the exact partition (``partition``) is written
here because no library computes one.
"""

from __future__ import annotations

from ..model.structure import Structure
from ..spec.schema import Spec
from .host import plan_host
from .inventory import Inventory
from .nodes import plan_nodes
from .plan import Plan


def plan(structure: Structure, spec: Spec, inventory: Inventory, *, name: str = "") -> Plan:
    """Place ``structure`` on the devices ``spec`` allows within ``inventory``. Pure."""
    if spec.placement.nodes > 1:
        return plan_nodes(structure, spec, inventory, name=name)
    return plan_host(structure, spec, inventory, name=name)
