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
that buffer and makes no copy (its ``TENSOR_DUPLICATED`` rule). Pure: no I/O (``as_llama_cpp_places``).

The draft model of ``spec.speculative`` (``method: draft``, a GGUF file) is planned beside it
(``plan_draft``, which reads that file's header): its weights and the KV cache of its own layers for
``slots x context`` tokens (llama-server gives the draft a context as large as the serving model's), held
whole on one device: the GPU with the most room left beside the serving model's blocks, else the CPU
(``engine.llamacpp.flags`` gives llama-server ``--spec-draft-device`` and ``--spec-draft-ngl`` from it).
A draft that is missing, not a GGUF file, or whose vocabulary differs from the serving GGUF's (the serving
model checks the draft's token ids as its own) is refused at ``spec.speculative.draft.path``.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import CheckpointError, ManifestError, PlanInfeasible
from ..model.gguf import gguf_metadata, is_gguf, vocabulary_digest, vocabulary_size
from ..model.gguf_blocks import gguf_blocks, kv_bytes_per_token
from ..model.structure import Structure
from ..spec.manifest import LoadedManifest
from ..units import format_size
from .capacity import BlockSizes
from .keys import compress_names
from .plan import Device, DevicePlan, DraftPlan, Plan, bottleneck_factor, plan_digest

DRAFT_FIELD = "spec.speculative.draft.path"


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


def plan_draft(loaded: LoadedManifest, plan: Plan) -> Plan:
    """``plan`` with the draft model of a llama.cpp manifest's ``spec.speculative`` (none: ``plan`` itself),
    its bytes in ``total_bytes``; a draft file that cannot serve as one is refused where the manifest names it."""
    spec = loaded.manifest.spec
    speculative = spec.speculative
    if speculative is None or speculative.draft is None or speculative.draft.path is None:
        return plan
    problem = draft_problem(loaded)
    if problem is not None:
        raise ManifestError([loaded.issue(DRAFT_FIELD, problem)])
    path = loaded.resolve(speculative.draft.path).resolve()
    engine = spec.engine
    tokens = engine.slots * engine.context
    blocks = gguf_blocks(path, kv_tokens=tokens, batch_tokens=min(engine.batch_size, tokens)).blocks
    total = sum(b.weight_bytes for b in blocks)
    layers = [b for b in blocks if b.kind == "layer"]
    kv = kv_bytes_per_token(gguf_metadata(path)) * tokens * len(layers)  # per layer, as gguf_blocks counts it
    device = _draft_device(plan, total)
    draft = DraftPlan(str(path), total, total - kv, kv, len(layers), device)
    return replace(plan, draft=draft, total_bytes=plan.total_bytes + total)


def draft_problem(loaded: LoadedManifest) -> str | None:
    """Why the GGUF file ``spec.speculative.draft.path`` names cannot draft for the serving GGUF: missing, not a
    GGUF file, or another vocabulary (None: it can, or the manifest has no draft file). Reads headers only."""
    speculative = loaded.manifest.spec.speculative
    if speculative is None or speculative.draft is None or speculative.draft.path is None:
        return None
    path = loaded.resolve(speculative.draft.path).resolve()
    if not path.is_file():
        return f"the draft model {str(path)!r} does not exist or is not a file"
    if not is_gguf(path):
        return f"the draft model {str(path)!r} is not a GGUF file (it does not start with 'GGUF')"
    serving = loaded.model_path
    try:
        theirs = vocabulary_digest(path)
        ours = vocabulary_digest(serving) if is_gguf(serving) else None
    except CheckpointError as exc:
        return f"the draft model cannot be read: {exc}"
    if theirs is None:
        return f"the draft model {str(path)!r} carries no vocabulary (tokenizer.ggml.tokens)"
    if ours is not None and theirs != ours:
        sizes = (vocabulary_size(gguf_metadata(path), path), vocabulary_size(gguf_metadata(serving), serving))
        return (f"the draft model's vocabulary ({sizes[0]} tokens) is not the serving model's ({sizes[1]} tokens, "
                "or the same number of other tokens): a draft proposes token ids that the serving model checks "
                "as its own, so both must share one tokenizer")
    return None


def _draft_device(plan: Plan, size: int) -> Device:
    """The device that holds the whole draft: the GPU with the most room beside the plan's blocks and
    adapters, else the CPU; PlanInfeasible when none has room."""
    held: dict[Device, int] = {d.device: d.bytes for d in plan.devices}
    for adapter in plan.adapters:
        for device, n in adapter.devices:
            held[device] = held.get(device, 0) + n
    gpus = [d for d in plan.devices if d.tier == "gpu"]
    rooms = sorted(gpus, key=lambda d: -(d.budget - held[d.device]) if d.budget is not None else float("-inf"))
    for d in [*rooms, *(d for d in plan.devices if d.tier == "cpu")]:
        if d.budget is None or d.budget - held[d.device] >= size:
            return d.device
    cpu = next((d for d in plan.devices if d.tier == "cpu"), None)
    if cpu is None:
        return "cpu"  # a plan with no CPU entry: the CPU is not limited
    short = size - max(0, (cpu.budget or 0) - held[cpu.device])
    raise PlanInfeasible(f"the draft model ({format_size(size)}: weights and the KV of its own layers) fits on no "
                         f"device beside the serving model (the CPU is short by {format_size(short)})",
                         shortfall={"cpu": short}, field=DRAFT_FIELD)
