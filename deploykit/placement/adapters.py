"""Where a deployment's LoRA adapters live and how many bytes they take: each adapted module's A and B
matrices (from the adapter's safetensors header, at the base's dtype: peft casts them to it) on the
device that holds the layer it adapts. Pure apart from reading headers; no torch.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, PlanInfeasible
from ..spec.adapters import AdapterFileError, AdapterFiles, read_adapter
from ..units import format_size
from .plan import AdapterPlan, Device, Plan


def plan_adapters(plan: Plan, adapters: list[tuple[str, Path]]) -> tuple[AdapterPlan, ...]:
    """Each (name, directory) placed as ``plan`` places the layers it adapts. PlanInfeasible when a device's
    adapters do not fit in what its budget leaves."""
    planned = tuple(_plan_one(plan, name, directory) for name, directory in adapters)
    _check_room(plan, planned)
    return planned


def _plan_one(plan: Plan, name: str, directory: Path) -> AdapterPlan:
    try:
        files = read_adapter(directory)
    except AdapterFileError as exc:
        raise CheckpointError(f"adapter {name!r}: {exc}") from None
    per_device: dict[Device, int] = {}
    for module, parts in files.modules().items():
        device = _device_of(plan.device_map, module)
        one = AdapterFiles(files.config, {k: v for k, v in files.tensors.items()
                                          if k.startswith(f"base_model.model.{module}.lora_")})
        per_device[device] = per_device.get(device, 0) + one.bytes_at(plan.dtype)
    tiers = {d.device: d.tier for d in plan.devices}
    on_disk = sorted(str(m) for m in files.modules() if tiers.get(_device_of(plan.device_map, m)) == "disk")
    if on_disk:
        raise PlanInfeasible(f"adapter {name!r} adapts {on_disk[0]!r}, which the plan offloads to disk: adapters are "
                             "served on layers held in memory only (raise spec.offload.cpu.max_memory)")
    order = {d.device: i for i, d in enumerate(plan.devices)}
    devices = tuple(sorted(per_device.items(), key=lambda item: order.get(item[0], len(order))))
    return AdapterPlan(name, str(directory), sum(per_device.values()), devices)


def _device_of(device_map: dict[str, Device], module: str) -> Device:
    """The device of the device_map entry holding ``module`` (the longest key that is it or a parent)."""
    best = max((k for k in device_map if k == "" or module == k or module.startswith(k + ".")), key=len,
               default=None)
    if best is None:
        raise CheckpointError(f"no device holds {module!r} in the plan")
    return device_map[best]


def _check_room(plan: Plan, adapters: tuple[AdapterPlan, ...]) -> None:
    need: dict[Device, int] = {}
    for adapter in adapters:
        for device, size in adapter.devices:
            need[device] = need.get(device, 0) + size
    short = {str(d.device): d.bytes + need[d.device] - d.budget for d in plan.devices
             if d.budget is not None and d.device in need and d.bytes + need[d.device] > d.budget}
    if short:
        said = ", ".join(f"{device} short by {format_size(n)}" for device, n in short.items())
        raise PlanInfeasible(f"the adapters do not fit beside the model: {said}", shortfall=short)
