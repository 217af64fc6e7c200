"""apply with ``gpus: [0]`` and a CPU and a disk tier: the plan's three tiers, the loaded model's placement
(``hf_device_map``, embeddings on ``cuda:0``), its GPU memory against the plan's bytes, and its logits
against accelerate's own ``load_checkpoint_and_dispatch`` of the same ``device_map`` on the same weights.

The GPU is given a third of the model (a simulated inventory ``1x<bytes>``, as ``deploykit plan --devices``
takes; the blocks still load on the real GPU 0), the CPU tier a third, the disk the rest. The dry run plans
the same manifest, then loads and compares a CPU + disk plan (the same steps, no GPU).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

from .. import manifests
from ..context import Context, open_deployment
from ..gpu import device_used_mib, mib, torch_memory
from ..record import Recorder

MODEL = "llama-3.2-1b"
PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, until dawn."
SLACK = 32 << 20  # bytes: buffers and allocator rounding beyond the planned weights


def run(ctx: Context, rec: Recorder) -> None:
    size = int(ctx.models[MODEL]["bytes"])
    devices = f"1x{size // 3}"
    gpu_manifest = _manifest(ctx, size, gpus=(0,))
    plan = _plan(ctx, rec, gpu_manifest, devices)
    if ctx.dry:
        rec.skip("load on cuda:0", "dry run (no CUDA): the CPU + disk plan is loaded and compared instead")
        target, devices_arg = _manifest(ctx, size, gpus=()), None
    else:
        target, devices_arg = gpu_manifest, devices
    ours = _load_deploykit(ctx, rec, target, devices_arg, cli_map=None if ctx.dry else plan["device_map"])
    theirs = _load_accelerate(ctx, rec, ours["device_map"])
    _compare(rec, ours["logits"], theirs["logits"])
    if not ctx.dry:
        _memory_verdict(rec, ours, theirs)


def _manifest(ctx: Context, size: int, *, gpus: tuple[int, ...]) -> Path:
    name = "tiers-gpu" if gpus else "tiers-cpu"
    spec = manifests.Spec(name=name, model=ctx.model(MODEL), dtype=ctx.dtype, gpus=gpus, cpu=size // 3,
                          disk=ctx.work / f"offload-{name}")
    return manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")


def _plan(ctx: Context, rec: Recorder, manifest: Path, devices: str) -> dict[str, Any]:
    with rec.step(f"deploykit plan --devices {devices}") as step:
        done = ctx.deploykit("plan", str(manifest), "--devices", devices, "-o", "json", timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr[-600:]}")
        plan: dict[str, Any] = json.loads(done.stdout)
        step.detail = ", ".join(f"{d['device']}: {mib(d['bytes'])}" for d in plan["devices"])
    rec.metric("plan_devices", {str(d["device"]): d["bytes"] for d in plan["devices"]})
    tiers = set(plan["device_map"].values())
    rec.expect("the plan uses GPU 0, the CPU and the disk", {0, "cpu", "disk"} <= tiers,
               f"tiers: {sorted(map(str, tiers))}")
    rec.expect("the plan puts the embeddings on GPU 0", plan["device_map"].get("model.embed_tokens") == 0,
               f"model.embed_tokens -> {plan['device_map'].get('model.embed_tokens')!r}")
    return plan


def _load_deploykit(ctx: Context, rec: Recorder, manifest: Path, devices: str | None,
                    cli_map: dict[str, Any] | None) -> dict[str, Any]:
    import torch

    found: dict[str, Any] = {"before_mib": device_used_mib()}
    if not ctx.dry:
        torch.cuda.init()
        torch.empty(1, device="cuda:0")
        found["context_mib"] = (device_used_mib() or 0) - (found["before_mib"] or 0)
    with rec.step("Deployment.from_manifest (reshard, load, health check)") as step:
        start = time.monotonic()
        dep = open_deployment(manifest, devices=devices, state_dir=ctx.work / "state-tiers")
        step.detail = f"{time.monotonic() - start:.1f} s"
    try:
        with dep.acquire_loaded() as loaded:
            _placement(ctx, rec, loaded, cli_map)
            found.update(device_map=dict(loaded.plan.device_map), plan_gpu=_gpu_bytes(loaded.plan))
            if not ctx.dry:
                found.update(torch_memory(), used_mib=device_used_mib())
                torch.cuda.reset_peak_memory_stats()
            found["logits"] = _logits(loaded.model, loaded.tokenizer, loaded.input_device)
            if not ctx.dry:
                found["forward_peak"] = torch_memory()["peak_allocated"]
        del loaded  # the check's own reference: after close, deploykit must hold none
    finally:
        dep.close()
    if not ctx.dry:
        gc.collect()
        _clear_cublas_workspaces()  # torch's own per-thread cache (32 MiB each on Hopper), not deploykit's
        found["after_close"] = torch_memory()["allocated"]
    return found


def _clear_cublas_workspaces() -> None:
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _placement(ctx: Context, rec: Recorder, loaded: Any, cli_map: dict[str, Any] | None) -> None:
    hf = dict(loaded.model.hf_device_map)
    planned = dict(loaded.plan.device_map)
    differing = sorted(k for k in set(hf) | set(planned) if hf.get(k) != planned.get(k))
    first = differing[0] if differing else ""
    rec.expect("hf_device_map equals the plan", not differing, f"{len(hf)} modules" if not differing else
               f"{len(differing)} differ, first {first}: {hf.get(first)!r} vs {planned.get(first)!r}")
    if cli_map is not None:
        rec.expect("the loaded plan equals `deploykit plan`'s", planned == cli_map, f"{len(planned)} modules")
    weight = loaded.model.get_input_embeddings().weight.device
    if ctx.dry:
        rec.skip("embeddings on cuda:0", f"dry run: embeddings on {weight}")
        return
    rec.expect("embeddings on cuda:0", str(weight) == "cuda:0" and loaded.input_device == "cuda:0",
               f"weight on {weight}, inputs to {loaded.input_device}")


def _gpu_bytes(plan: Any) -> int:
    return sum(d.bytes for d in plan.devices if d.device == 0)


def _logits(model: Any, tokenizer: Any, device: str) -> Any:
    import torch

    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]], device=device)
    with torch.no_grad():
        return model(ids).logits.float().cpu()


def _load_accelerate(ctx: Context, rec: Recorder, device_map: dict[str, Any]) -> dict[str, Any]:
    """accelerate's own big-model loading of the source checkpoint, placed by the same map."""
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = ctx.model(MODEL)
    found: dict[str, Any] = {}
    if not ctx.dry:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        found["baseline"] = torch_memory()["allocated"]
    with rec.step("accelerate load_checkpoint_and_dispatch, same device_map") as step:
        start = time.monotonic()
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                                     dtype=getattr(torch, ctx.dtype))
        model.tie_weights()
        model = load_checkpoint_and_dispatch(model, str(source), device_map=device_map, dtype=getattr(torch, ctx.dtype),
                                             offload_folder=str(ctx.work / "offload-accelerate"))
        model.eval()
        step.detail = f"{time.monotonic() - start:.1f} s"
    if not ctx.dry:
        found["allocated"] = torch_memory()["allocated"] - found["baseline"]
    device = "cuda:0" if not ctx.dry else "cpu"
    found["logits"] = _logits(model, AutoTokenizer.from_pretrained(source), device)
    del model
    gc.collect()
    return found


def _compare(rec: Recorder, ours: Any, theirs: Any) -> None:
    diff = (ours - theirs).norm() / theirs.norm()
    top = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    exact = bool((ours == theirs).all())
    rec.metric("logits", {"relative_error": float(diff), "max_abs_diff": float((ours - theirs).abs().max()),
                          "top1_agreement": top, "exact": exact, "positions": int(ours.shape[1])})
    rec.expect("logits equal accelerate's (relative error <= 1e-2)", float(diff) <= 1e-2,
               f"relative error {float(diff):.2e}, top-1 agreement {top:.3f}, bitwise equal: {exact}")


def _memory_verdict(rec: Recorder, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    plan, allocated = ours["plan_gpu"], ours["allocated"]
    rec.metric("gpu_memory", {
        "plan_gpu_bytes": plan, "allocated_after_load": allocated, "reserved_after_load": ours["reserved"],
        "load_peak_allocated": ours["peak_allocated"], "forward_peak_allocated": ours["forward_peak"],
        "cuda_context_mib": ours.get("context_mib"),
        "device_used_mib_after_load": ours["used_mib"], "allocated_after_close": ours["after_close"],
        "accelerate_allocated_after_load": theirs["allocated"]})
    rec.expect("GPU memory after load within the plan's bytes", abs(allocated - plan) <= 0.02 * plan + SLACK,
               f"allocated {mib(allocated)} for a plan of {mib(plan)} (accelerate: {mib(theirs['allocated'])}); "
               f"runtime overhead: CUDA context {ours.get('context_mib')} MiB, allocator slack "
               f"{mib(ours['reserved'] - allocated)}, a {len(PROMPT)}-token forward peaks "
               f"{mib(ours['forward_peak'] - allocated)} above")
    rec.expect("GPU memory returned after close", ours["after_close"] <= SLACK,
               f"{mib(ours['after_close'])} still allocated")
