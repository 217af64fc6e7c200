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
    planned = tuple(_plan_one(plan, i, name, directory) for i, (name, directory) in enumerate(adapters))
    _check_room(plan, planned)
    return planned


def _plan_one(plan: Plan, index: int, name: str, directory: Path) -> AdapterPlan:
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
    _refuse_offloaded(plan, index, name, files)
    order = {d.device: i for i, d in enumerate(plan.devices)}
    devices = tuple(sorted(per_device.items(), key=lambda item: order.get(item[0], len(order))))
    return AdapterPlan(name, str(directory), sum(per_device.values()), devices)


def _refuse_offloaded(plan: Plan, index: int, name: str, files: AdapterFiles) -> None:
    """Adapters are served on layers that compute where they are held: not on layers offloaded to disk,
    nor on layers a GPU plan holds in CPU memory (accelerate's hooks bring their weights to the GPU for each
    forward; peft's LoRA matrices of such a layer stay where its weights are held, on the meta device, and
    the adapter would compute garbage)."""
    tiers = {d.device: d.tier for d in plan.devices}
    gpu_plan = "gpu" in tiers.values()
    for module in sorted(files.modules()):
        tier = tiers.get(_device_of(plan.device_map, module))
        if tier == "disk" or (tier == "cpu" and gpu_plan):
            where = "to disk" if tier == "disk" else "to CPU memory (a GPU plan's offloaded layers)"
            raise PlanInfeasible(f"spec.adapters[{index}] (adapter {name!r}) adapts {module!r}, which the plan "
                                 f"offloads {where}: adapters are served on layers that run where they are held "
                                 "only (give the GPUs room for every layer the adapter adapts, or serve it on a "
                                 "CPU-only plan)")


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
