"""What the serving generation holds, given back to the inventory a change is planned against.

A probed host reports the memory it has free now, so while a generation serves, its own bytes are missing
from the probe. A change that replaces it in place (a recreate: the old one is freed before the new one
loads) or keeps its base (a live change of ``spec.adapters``) is planned against the host with those bytes
added back: planned against the probe alone, a model over half a tier could never be recreated, and a
live adapter change would record a more-offloaded device map than the one that serves. A simulated
inventory (``--devices``) already is the whole host: it is used as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ...placement.inventory import Gpu, Inventory
from ..budget.tiers import plan_tiers

if TYPE_CHECKING:
    from .pool import Generation


def inventory_freed(inventory: Inventory, gen: Generation | None) -> Inventory:
    """``inventory`` with what ``gen`` holds added back where it was probed (see the module docstring)."""
    if gen is None or gen.plan is None or inventory.simulated:
        return inventory
    held = plan_tiers(gen.plan)
    gpus = tuple(Gpu(g.index, g.memory + held.get(f"gpu{g.index}", 0), g.name) for g in inventory.gpus)
    cpu = None if inventory.cpu is None else inventory.cpu + held.get("cpu", 0)
    return replace(inventory, gpus=gpus, cpu=cpu)
