"""From a loaded manifest to a Plan: the glue between the manifest, the checkpoint's structure, the
inventory and the pure planner. Reads only config.json, or a GGUF file's metadata (no weights: a GGUF
manifest is planned without dequantizing anything).

It must never import torch or transformers itself: ``load_structure`` imports them only for a config it
has not seen before (its structure cache, in memory and on disk, answers the rest), so a warm
``deploykit plan`` / ``deploykit diff`` starts as fast as ``deploykit validate``.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import CheckpointError, PlanInfeasible
from ..units import format_size
from .capacity import block_sizes
from .inventory import Inventory, resolve
from .llamacpp import as_llama_cpp_places, plan_draft
from ..spec.manifest import LoadedManifest
from ..spec.schema import Spec
from .kv import DEFAULT_PREFIX_CACHE_CAP, MIN_KV_BYTES, default_prefix_cache, kv_budget, kv_shares
from .plan import Plan
from .planner import plan
from ..model.gguf import is_gguf
from ..model.gguf_blocks import gguf_blocks
from ..spec.engines import LLAMA_CPP
from ..model.structure import Structure, load_structure


def structure_for(loaded: LoadedManifest) -> Structure:
    """The manifest's model structure, from the structure cache when its config.json (or GGUF file) was
    seen before."""
    model, engine = loaded.manifest.spec.model, loaded.manifest.spec.engine
    if engine.name == LLAMA_CPP and is_gguf(loaded.model_path):  # what llama-server maps and allocates
        context = engine.slots * engine.context  # llama.cpp's micro-batch is at most its context
        return gguf_blocks(loaded.model_path, kv_tokens=context, batch_tokens=min(engine.batch_size, context))
    if not loaded.model_path.is_dir() and not is_gguf(loaded.model_path):
        raise CheckpointError(f"{loaded.source}: spec.model.path: {str(loaded.model_path)!r} is neither a "
                              "model directory nor a GGUF file")
    return load_structure(loaded.model_path, task=model.task, dtype=model.dtype,
                          trust_remote_code=model.trust_remote_code, quantization=model.quantization)


def inventory_for(loaded: LoadedManifest, devices: str | None) -> Inventory:
    disk = loaded.manifest.spec.offload.disk
    return resolve(devices, disk_path=loaded.resolve(disk.path) if disk else None)


def plan_manifest(loaded: LoadedManifest, *, devices: str | None = None,
                  inventory: Inventory | None = None) -> Plan:
    """Plan one manifest against ``inventory``, or ``devices`` (a simulated spec), or this host."""
    inv = inventory if inventory is not None else inventory_for(loaded, devices)
    spec = loaded.manifest.spec
    if spec.placement.tensor_parallel > 1:
        return _plan_tensor_parallel(loaded, inv)
    structure = structure_for(loaded)
    # the adapters first: the prefix cache is sized from (and checked against) the KV room they leave
    planned = _with_draft(_with_adapters(plan(structure, spec, inv, name=loaded.name), loaded), loaded)
    planned = with_prefix_cache(planned, spec, inv)
    if spec.engine.name == LLAMA_CPP and spec.placement.nodes == 1:  # the layers where llama.cpp holds them
        planned = plan_draft(loaded, as_llama_cpp_places(planned, structure, block_sizes(structure, spec)))
    return planned


def _with_adapters(planned: Plan, loaded: LoadedManifest) -> Plan:
    """``planned`` with ``spec.adapters`` on the devices of the layers they adapt (PlanInfeasible where they do
    not fit beside the weights)."""
    adapters_spec = loaded.manifest.spec.adapters
    if not adapters_spec:
        return planned
    from .adapters import plan_adapters

    adapters = plan_adapters(planned, [(a.name, loaded.resolve(a.path)) for a in adapters_spec])
    return replace(planned, adapters=adapters, total_bytes=planned.total_bytes + sum(a.bytes for a in adapters))


def _with_draft(planned: Plan, loaded: LoadedManifest) -> Plan:
    """``planned`` with the draft model of ``spec.speculative`` method draft (transformers engine): its weights
    (``draft.path``'s checkpoint at the model's dtype, or the model's own blocks quantized ``draft.quantized``)
    and its KV (every row's context, ``kv_cache_tokens``, in each of the draft's layers), on the device of the
    model's first layers; PlanInfeasible where that device's budget has no room for them."""
    spec = loaded.manifest.spec
    draft = spec.speculative.draft if spec.speculative is not None else None
    if draft is None or spec.engine.name == LLAMA_CPP:
        return planned
    model = spec.model
    source = loaded.resolve(draft.path) if draft.path is not None else loaded.model_path
    try:
        structure = load_structure(source, task=model.task, dtype=model.dtype, trust_remote_code=model.trust_remote_code,
                                   quantization=draft.quantized or "none")
    except CheckpointError as exc:
        raise CheckpointError(f"spec.speculative.draft: {exc}") from None
    weights = structure.weight_bytes
    per_token = sum(b.kv_bytes_per_token for b in structure.blocks)
    tokens = planned.kv_cache_tokens or spec.serving.max_concurrent * (spec.serving.context_length or 0)
    kv = per_token * tokens
    first = planned.devices[0]
    if first.budget is not None and first.bytes + weights + kv > first.budget:
        short = first.bytes + weights + kv - first.budget
        raise PlanInfeasible(f"the draft model of spec.speculative does not fit beside the model on {first.device}: "
                             f"{format_size(weights)} of weights and {format_size(kv)} of KV, short by "
                             f"{format_size(short)}", shortfall={str(first.device): short}, field="spec.speculative.draft")
    what = f"{draft.path} at {model.dtype}" if draft.path is not None else f"this checkpoint {draft.quantized}"
    note = (f"speculative draft model ({what}) on {first.device}: {format_size(weights)} of weights and "
            f"{format_size(kv)} of KV ({tokens} tokens x {format_size(per_token)}), {format_size(weights + kv)} in all")
    return replace(planned, draft_bytes=weights + kv, total_bytes=planned.total_bytes + weights + kv,
                   notes=planned.notes + (note,))


def keeps_prefixes(spec: Spec) -> bool:
    """Whether the deployment's engine keeps prompt prefixes: the padded loop of a causal LM in one process
    or Ray Serve replica. Not an embedding model, pipeline stages, tensor-parallel ranks, transformers'
    continuous batching, or the llama.cpp engine (llama-server keeps its slots' own prompts)."""
    return (spec.model.task == "causal-lm" and spec.serving.batching == "padded" and spec.placement.nodes == 1
            and spec.placement.tensor_parallel == 1 and spec.engine.name == "transformers")


def _kv_room(planned: Plan, inventory: Inventory | None) -> int | None:
    """``kv_budget`` of ``planned``; where the CPU holds KV, at most what the machine's memory
    (``inventory.cpu``: this host's, or ``--devices cpu=...``) and the host budget's CPU tier
    (``inventory.budget_cpu``) leave beside the weights there."""
    room = kv_budget(planned)
    share = kv_shares(planned).get("cpu")
    limits = [v for v in (inventory.cpu, inventory.budget_cpu) if v is not None] if inventory is not None else []
    if not share or not limits or (room is not None and inventory is not None and inventory.budget_cpu is None):
        return room
    held = sum(d.bytes for d in planned.devices if d.tier == "cpu")
    cpu_room = int(max(0, min(limits) - held) / share)
    return cpu_room if room is None else min(room, cpu_room)


def with_prefix_cache(planned: Plan, spec: Spec, inventory: Inventory | None = None) -> Plan:
    """``planned`` with the bytes its prefix cache holds (``spec.serving.prefix_cache``): 0 where it is off or
    where nothing keeps prefixes; ``max_bytes`` where set (``PlanInfeasible`` when it leaves the batch less
    than 64 MiB of KV beside the weights); else ``kv.default_prefix_cache`` of the room the KV has."""
    cache = spec.serving.prefix_cache
    if not cache.enabled or not keeps_prefixes(spec):
        return planned
    room = _kv_room(planned, inventory)
    if cache.max_bytes is None:
        held = default_prefix_cache(room)
        note = (f"prefix cache {format_size(held)}: a quarter of the {format_size(room)} of KV room, at most "
                f"{format_size(DEFAULT_PREFIX_CACHE_CAP)} (spec.serving.prefix_cache.max_bytes sets it)"
                if room is not None else f"prefix cache {format_size(held)}: the default where nothing limits the KV")
        return replace(planned, prefix_cache_bytes=held, notes=planned.notes + (note,))
    if inventory is not None and inventory.budget_cpu is not None:  # the budget bounds the default only: it
        room = _kv_room(planned, replace(inventory, budget_cpu=None))  # counts no KV of the running batch
    if room is not None and cache.max_bytes > room - MIN_KV_BYTES:
        raise PlanInfeasible(
            f"spec.serving.prefix_cache.max_bytes {format_size(cache.max_bytes)} does not fit: beside the weights "
            f"the devices holding the KV cache have {format_size(room)} left, and the running batch needs at least "
            f"{format_size(MIN_KV_BYTES)} of it; lower max_bytes (at most {format_size(max(0, room - MIN_KV_BYTES))}) "
            "or remove it for a default sized from the room",
            shortfall={"prefix_cache": cache.max_bytes - max(0, room - MIN_KV_BYTES)},
            field="spec.serving.prefix_cache.max_bytes")
    return replace(planned, prefix_cache_bytes=cache.max_bytes)


def _plan_tensor_parallel(loaded: LoadedManifest, inventory: Inventory) -> Plan:
    """Heads checked first (a located ManifestError, as ``validate`` gives), then each rank's share."""
    from ..errors import ManifestError
    from ..spec.tensor_parallel import heads_issues
    from .tensor_parallel import plan_tensor_parallel

    issues = heads_issues(loaded)
    if issues:
        raise ManifestError(issues)
    return plan_tensor_parallel(structure_for(loaded), loaded.manifest.spec, inventory, name=loaded.name)
