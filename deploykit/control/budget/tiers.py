"""The host as a budget: how many bytes all deployments of one ``deploykit serve`` may hold together.

``--budget cpu=6GiB,gpu0=20GiB`` (or ``$DEPLOYKIT_BUDGET``) caps each tier; a tier not named is capped by
what the host has, as planning sees it (``host_budget``). A deployment's size in each tier is what its
plan places there (``plan_tiers``): GPU ``i`` is the tier ``gpu<i>``, the CPU RAM tier ``cpu``; disk
blocks are read in place and cost no budget. Pure values and parsing only: no torch, no clock.
"""

from __future__ import annotations

import re
from typing import Any
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ...errors import DeploykitError
from ...placement.inventory import Inventory
from ...placement.kv import default_prefix_cache, kv_shares, prefix_cache_tiers
from ...placement.plan import Plan
from ...units import SIZE_UNITS_TEXT, format_size, parse_size

_TIER_RE = re.compile(r"cpu|gpu[0-9]+")  # whole names only (fullmatch): no "cpu\n", no "gpu١"
BUDGET_ENV = "DEPLOYKIT_BUDGET"


class BudgetError(DeploykitError):
    """A budget is malformed, or a deployment cannot get room within it."""


@dataclass(frozen=True)
class Budget:
    """The most each tier (``cpu``, ``gpu0``...) may hold; a tier not listed is not limited (a simulated
    host without a CPU figure). ``source`` says where it came from."""

    tiers: Mapping[str, int]
    source: str = "host"

    def describe(self) -> str:
        tiers = ", ".join(f"{t}={format_size(b)}" for t, b in sorted(self.tiers.items()))
        return f"the budget ({tiers}; from {self.source})"

    def over(self, need: Mapping[str, int]) -> dict[str, int]:
        """Bytes by which ``need`` alone exceeds each tier (empty: it fits in an empty host)."""
        return {t: b - self.tiers[t] for t, b in need.items() if t in self.tiers and b > self.tiers[t]}


def parse_budget(text: str, *, source: str = "--budget") -> dict[str, int]:
    """``"cpu=6GiB,gpu0=20GiB"`` -> ``{"cpu": 6442450944, "gpu0": 21474836480}``. Raises BudgetError saying
    which item is wrong and why."""
    tiers: dict[str, int] = {}
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise BudgetError(f"{source}: empty; give TIER=SIZE items such as cpu=6GiB,gpu0=20GiB")
    for item in items:
        tier, sep, size = item.partition("=")
        tier = tier.strip().lower()
        if not sep or not tier:
            raise BudgetError(f"{source}: {item!r} is not TIER=SIZE (e.g. cpu=6GiB, gpu0=20GiB)")
        if not _TIER_RE.fullmatch(tier):
            raise BudgetError(f"{source}: unknown tier {tier!r} in {item!r}; tiers are cpu, gpu0, gpu1, ...")
        if tier in tiers:
            raise BudgetError(f"{source}: tier {tier!r} is given twice")
        try:
            tiers[tier] = parse_size(size.strip())
        except ValueError as exc:
            raise BudgetError(f"{source}: {tier}: {exc}") from None
        if tiers[tier] <= 0:
            raise BudgetError(f"{source}: {tier}: a budget must be above 0 ({SIZE_UNITS_TEXT})")
    return tiers


def host_budget(inventory: Inventory, given: Mapping[str, int] | None = None, *, source: str = "--budget") -> Budget:
    """``given`` tiers, the others capped by what ``inventory`` has (the host, or --devices). A tier
    the host does not have is refused rather than planned against."""
    host: dict[str, int] = {f"gpu{g.index}": g.memory for g in inventory.gpus}
    if inventory.cpu is not None:
        host["cpu"] = inventory.cpu
    unknown = sorted(set(given or {}) - set(host) - {"cpu"})  # cpu None: the host does not limit it
    if unknown:
        raise BudgetError(f"{source}: this host has no {', '.join(unknown)} (it has {', '.join(sorted(host)) or 'none'})")
    return Budget({**host, **(given or {})}, source if given else "host")


def serve_budget(text: str | None, devices: str | None, *, source: str = "--budget") -> Budget:
    """The budget of ``deploykit serve``: ``text`` (``--budget``) over the host (or ``devices``)."""
    from ...placement.inventory import resolve

    return host_budget(resolve(devices), parse_budget(text, source=source) if text else None, source=source)


def plan_tiers(plan: Plan) -> dict[str, int]:
    """What ``plan`` holds in each budget tier (disk blocks are read in place: no tier); its prefix cache
    counts where its KV lives, on the devices that run its layers (``placement.kv``)."""
    tiers: dict[str, int] = {}
    for device in plan.devices:
        if device.tier == "disk" or not device.bytes:
            continue
        tier = "cpu" if device.tier == "cpu" else f"gpu{device.device}"
        tiers[tier] = tiers.get(tier, 0) + device.bytes
    for tier, held in prefix_cache_tiers(plan).items():
        tiers[tier] = tiers.get(tier, 0) + held
    kinds: dict[Any, str] = {d.device: d.tier for d in plan.devices}
    for adapter in plan.adapters:  # held beside the layers they adapt
        for where, size in adapter.devices:
            tier = "cpu" if kinds.get(where, "cpu") == "cpu" else f"gpu{where}"
            tiers[tier] = tiers.get(tier, 0) + size
    if plan.draft is not None:  # speculative decoding's draft model, whole on one device
        where = plan.draft.device
        tier = "cpu" if kinds.get(where, "cpu") == "cpu" else f"gpu{where}"
        tiers[tier] = tiers.get(tier, 0) + plan.draft.bytes
    return tiers




def fit_prefix_cache(plan: Plan, left: Mapping[str, int]) -> Plan:
    """``plan`` with its prefix cache sized from ``left``, the room per budget tier the budget leaves it beside
    the others (a cache is evictable: it shrinks before a load is refused): the default rule
    (``kv.default_prefix_cache``, a quarter of the room beside the rest of the plan) on that room, never more
    than planned. ``plan`` itself where that changes nothing."""
    if not plan.prefix_cache_bytes:
        return plan
    base = plan_tiers(replace(plan, prefix_cache_bytes=0))
    rooms = [int(max(0, left[tier] - base.get(tier, 0)) / share)
             for tier, share in _cache_shares(plan).items() if tier in left and share > 0]
    if not rooms:
        return plan
    held = min(plan.prefix_cache_bytes, default_prefix_cache(min(rooms)))
    if held == plan.prefix_cache_bytes:
        return plan
    note = (f"prefix cache {format_size(held)} (planned {format_size(plan.prefix_cache_bytes)}): sized from the "
            "room the host budget left it beside the other deployments")
    return replace(plan, prefix_cache_bytes=held, notes=plan.notes + (note,))


def _cache_shares(plan: Plan) -> dict[str, float]:
    """The share of the prefix cache on each budget tier (its KV's: ``placement.kv.kv_shares``)."""
    shares: dict[str, float] = {}
    for device, share in kv_shares(plan).items():
        tier = "cpu" if device == "cpu" else f"gpu{device}"
        shares[tier] = shares.get(tier, 0.0) + share
    return shares
