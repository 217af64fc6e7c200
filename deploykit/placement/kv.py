"""Where a plan's KV cache lives, and how much of it the plan leaves room for.

Each decoder layer keeps its keys and values on the device that runs it: its GPU; a layer the plan puts on
the CPU or disk tier runs, in a plan with GPUs, on the first GPU (accelerate's hooks bring its weights
there, and its KV is made from its outputs there), in a plan without GPUs on the CPU. So a batch's KV, and
the prefix cache's, is spread over those devices in proportion to their layers; charging it all to the
device of the input embeddings (as before) let a split model's cache outgrow the devices that hold it.
Pure: reads the plan only.
"""

from __future__ import annotations

import re
from collections import Counter

from .plan import Device, Plan

_LAYER = re.compile(r"\.\d+$")  # a decoder layer's device_map key: "model.layers.7", "transformer.h.3"


def kv_shares(plan: Plan) -> dict[Device, float]:
    """The share of the KV cache on each device that holds some (they add up to 1)."""
    gpus = sorted(d for d in set(plan.device_map.values()) if isinstance(d, int))
    runs_on = [d if isinstance(d, int) else gpus[0] if gpus else "cpu"
               for key, d in plan.device_map.items() if _LAYER.search(key)]
    if not runs_on:  # no numbered layers: where the first blocks are
        first = next((d.device for d in plan.devices if d.blocks), "cpu")
        return {first if isinstance(first, int) or not gpus else gpus[0]: 1.0}
    return {device: n / len(runs_on) for device, n in Counter(runs_on).items()}


def kv_budget(plan: Plan) -> int | None:
    """The most KV bytes (all layers together) that fit beside the weights, the LoRA adapters and the prefix
    cache on every device that holds a share of it; None when no such device has a budget."""
    budgets = {("cpu" if d.tier != "gpu" else d.device): d for d in plan.devices if d.tier != "disk"}
    adapters: dict[object, int] = {}
    for adapter in plan.adapters:  # on the devices of the layers they adapt; not in the devices' bytes
        for device, size in adapter.devices:
            adapters[device] = adapters.get(device, 0) + size
    room = []
    for device, share in kv_shares(plan).items():
        held = budgets.get(device)
        if held is not None and held.budget is not None:
            free = held.budget - held.bytes - adapters.get(device, 0) - plan.prefix_cache_bytes * share
            room.append(int(max(0.0, free) / share))
    return min(room) if room else None


DEFAULT_PREFIX_CACHE_SHARE = 4  # the default prefix cache takes a quarter of the room the KV would have...
DEFAULT_PREFIX_CACHE_CAP = 1 << 30  # ...at most 1 GiB
MIN_KV_BYTES = 64 << 20  # the least KV a batch is given (control.live.pool.kv_cache_budget)


def default_prefix_cache(room: int | None) -> int:
    """The prefix cache a manifest gets without ``max_bytes``: a quarter of ``room`` (the KV room its plan
    leaves: ``kv_budget`` of the plan without a prefix cache), at most 1 GiB, in whole MiB; 1 GiB where no
    device holding KV has a budget. A quarter leaves the running batch three times the cache's bytes."""
    if room is None:
        return DEFAULT_PREFIX_CACHE_CAP
    return min(DEFAULT_PREFIX_CACHE_CAP, room // DEFAULT_PREFIX_CACHE_SHARE) >> 20 << 20


def prefix_cache_tiers(plan: Plan) -> dict[str, int]:
    """The prefix cache's bytes on each budget tier ("cpu", "gpu0", ...), spread as its KV is."""
    return {("cpu" if device == "cpu" else f"gpu{device}"): round(plan.prefix_cache_bytes * share)
            for device, share in kv_shares(plan).items()} if plan.prefix_cache_bytes else {}
