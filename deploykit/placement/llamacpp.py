"""A llama.cpp plan's layers where llama-server will hold them, so that its bytes per device are llama.cpp's.

The planner gives the GPUs the longest prefix of blocks that fits and the CPU the rest: the *last* layers
stay on the CPU. llama.cpp (``llama_model::load_tensors``) offloads the *last* slots instead: with
``--n-gpu-layers`` it keeps the *first* layers on the CPU, then gives each device of ``--tensor-split`` the
next run of layers in device order (``engine.llamacpp.flags`` turns the plan's counts into those flags).
Each layer's KV cache lives with its layer (llama.cpp allocates it on the layer's device), so the layers
cannot be pinned elsewhere by ``--override-tensor`` without splitting them from their cache. The counts
per device are the planner's; which layers they are is llama.cpp's: the CPU holds the first ``n`` layers,
each GPU the following run. Layers of a GGUF differ in size when its quantization mixes types (Q4_K_M's
``attn_v`` and ``ffn_down`` in Q6_K for some layers), so the bytes per device are summed again from the
blocks; a device that no longer fits its budget makes the plan infeasible, saying by how much.

The input embeddings and the output head stay where the plan put them: ``flags`` pins them there
(``--override-tensor``). A tied-embedding GGUF has no ``output.weight``: llama.cpp uses ``token_embd.weight``
as the head, under that name, so the pin of ``token_embd`` holds it too and llama.cpp finds it already in
that buffer and makes no copy (its ``TENSOR_DUPLICATED`` rule). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PlanInfeasible
from ..model.structure import Structure
from ..units import format_size
from .capacity import BlockSizes
from .keys import compress_names
from .plan import Device, DevicePlan, Plan, bottleneck_factor, plan_digest


def as_llama_cpp_places(plan: Plan, structure: Structure, sizes: BlockSizes) -> Plan:
    """``plan`` with its layers where llama.cpp puts the planned number of layers per device (see above)."""
    blocks = structure.blocks
    layers = [i for i, b in enumerate(blocks) if b.kind == "layer"]
    planned = [plan.device_map[blocks[i].modules[0]] for i in layers]
    gpus = list(dict.fromkeys(d for d in planned if isinstance(d, int)))  # the order of --device
    if not gpus or any(not isinstance(d, int) and d != "cpu" for d in planned):
        return plan  # all on the CPU (llama.cpp's own order too), or a tier llama.cpp does not have
    order: list[Device] = ["cpu"] * planned.count("cpu")
    for g in gpus:
        order += [g] * planned.count(g)
    if order == planned:
        return plan
    device_map = dict(plan.device_map)
    for i, device in zip(layers, order):
        for module in blocks[i].modules:
            device_map[module] = device
    devices = _devices(plan, structure, sizes, device_map)
    return replace(plan, device_map=device_map, devices=devices, total_bytes=sum(d.bytes for d in devices),
                   bottleneck_factor=bottleneck_factor(((d.target_share or 0.0, d.actual_share or 0.0)
                                                        for d in devices if d.tier == "gpu"),
                                                       sum(d.load for d in devices if d.tier == "gpu"), True),
                   digest=plan_digest(plan.name, plan.architecture, plan.dtype, device_map,
                                      quantization=plan.quantization))


def _devices(plan: Plan, structure: Structure, sizes: BlockSizes,
             device_map: dict[str, Device]) -> tuple[DevicePlan, ...]:
    """Each device's bytes, load and blocks again, from the blocks ``device_map`` gives it."""
    blocks = structure.blocks
    held = {d.device: [i for i, b in enumerate(blocks) if device_map[b.modules[0]] == d.device]
            for d in plan.devices}
    gpu_load = sum(sum(sizes.loads[i] for i in held[d.device]) for d in plan.devices if d.tier == "gpu")
    out = []
    for d in plan.devices:
        mine = held[d.device]
        size = sizes.gpu if d.tier == "gpu" else sizes.offload
        load = sum(sizes.loads[i] for i in mine)
        device = replace(d, bytes=sum(size[i] for i in mine), weight_bytes=sum(blocks[i].weight_bytes for i in mine),
                         blocks=compress_names([blocks[i].name for i in mine]), load=load,
                         actual_share=round(load / gpu_load, 6) if d.tier == "gpu" and gpu_load else d.actual_share)
        if d.budget is not None and device.bytes > d.budget:
            where = f"cuda:{d.device}" if d.tier == "gpu" else str(d.device)
            raise PlanInfeasible(
                f"{where}: llama.cpp keeps the first layers on the CPU and offloads the last ones, so it would "
                f"hold {format_size(device.bytes)} there (the GGUF's layers differ in size), over its budget "
                f"of {format_size(d.budget)}", shortfall={where: device.bytes - d.budget},
                field="spec.placement.gpus")
        out.append(device)
    return tuple(out)
