"""int8 and int4 (``spec.model.quantization``) on the GPU against the same model at bfloat16: the plan's bytes
against the GPU memory the loaded model holds, teacher-forced logits and greedy answers against bfloat16's,
and decode speed (one batched ``generate`` over deploykit's loaded model: its quantized linears run their
CUDA kernels, ``engine/quantized.py``; ``quantized_kernels`` times one layer of each path).

The two quantizing layouts are written by ``deploykit apply`` processes started at once, in parallel (CPU
work), while the bfloat16 reference loads; the speed runs wait until both are done, so nothing else uses the
GPU while one is timed.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from typing import Any

from .. import baseline, manifests
from ..context import ROOT, Context, open_deployment
from ..gpu import mib, torch_memory
from ..record import Recorder
from ..servers import prompts

MODEL = "llama-3.2-1b"
SCHEMES = ("none", "int8", "int4")
PROMPT = "The lighthouse keeper counted the ships that passed in the night, one by one, until dawn."
SLACK = 32 << 20


def run(ctx: Context, rec: Recorder) -> None:
    paths = {s: _manifest(ctx, s) for s in SCHEMES}
    applies = {s: _start_apply(ctx, s, paths[s]) for s in SCHEMES if s != "none"}
    rows: dict[str, Any] = {}
    reference = rec.attempt(_measure, ctx, rec, "none", paths["none"], applies)
    if reference is None:
        _settle(applies, timeout=0)
        return
    rows["none"] = _row(reference, reference)
    _judge_memory(ctx, rec, "none", rows["none"])
    for scheme, proc in applies.items():
        with rec.step(f"{scheme}: deploykit apply (quantizing layout, load, health check)") as step:
            _wait_apply(proc, scheme, timeout=150)
            step.detail = f"exit {proc.returncode}"
        found = rec.attempt(_measure, ctx, rec, scheme, paths[scheme], {})
        if found is not None:
            rows[scheme] = _row(found, reference)
            _judge(ctx, rec, scheme, rows[scheme])
        rec.metric("schemes", rows)
    rec.metric("schemes", rows)


def _manifest(ctx: Context, scheme: str) -> Any:
    spec = manifests.Spec(name=f"quant-{scheme}", model=ctx.model(MODEL), dtype=ctx.dtype,
                          gpus=() if ctx.dry else (0,), quantization=scheme)
    return manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")


def _state(ctx: Context, scheme: str) -> Any:
    return ctx.work / f"state-quant-{scheme}"


def _start_apply(ctx: Context, scheme: str, path: Any) -> subprocess.Popen[bytes]:
    log = open(ctx.work / "logs" / f"apply-{scheme}.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "deploykit.cli", "apply", str(path), "-q"], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT, env=ctx.env(DEPLOYKIT_STATE=str(_state(ctx, scheme))))


def _wait_apply(proc: subprocess.Popen[bytes], scheme: str, *, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise TimeoutError(f"deploykit apply of {scheme} took more than {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"deploykit apply of {scheme} exited {proc.returncode} (see apply-{scheme}.log)")


def _settle(pending: dict[str, subprocess.Popen[bytes]], timeout: float = 150) -> None:
    """Wait for the applies still running (a step per scheme reports how each ended)."""
    deadline = time.monotonic() + timeout
    for proc in pending.values():
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _measure(ctx: Context, rec: Recorder, scheme: str, path: Any, pending: dict[str, Any]) -> dict[str, Any]:
    """Load ``scheme`` through the library (for a quantized scheme: the layout the CLI wrote), then measure."""
    with rec.step(f"{scheme}: Deployment.from_manifest") as step:
        start = time.monotonic()
        dep = open_deployment(path, state_dir=_state(ctx, scheme))
        step.detail = f"{time.monotonic() - start:.1f} s"
    try:
        with dep.acquire_loaded() as loaded:
            found = _inspect(ctx, loaded)
            _settle(pending)  # time nothing while a layout still loads on the GPU
            found.update(_speed(ctx, loaded))
    finally:
        dep.close()
    gc.collect()
    if not ctx.dry:
        import torch

        torch.cuda.empty_cache()
    return found


def _inspect(ctx: Context, loaded: Any) -> dict[str, Any]:
    import torch

    plan = loaded.plan
    found: dict[str, Any] = {"plan_bytes": plan.total_bytes, "quantization": plan.quantization,
                             "plan_gpu_bytes": sum(d.bytes for d in plan.devices if d.device == 0)}
    if not ctx.dry:
        found["allocated"] = torch_memory()["allocated"]
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]], device=loaded.input_device)
    with torch.no_grad():
        found["logits"] = loaded.model(ids).logits.float().cpu()
    return found


def _speed(ctx: Context, loaded: Any) -> dict[str, Any]:
    clients, tokens = (4, 16) if ctx.dry else (16, 64)
    tok = loaded.tokenizer
    ids = [baseline.chat_ids(tok, t) for t in prompts(clients)]
    baseline.generate_batch(loaded.model, tok, ids[:2], max_new_tokens=2)  # warm-up
    out, seconds = baseline.generate_batch(loaded.model, tok, ids, max_new_tokens=tokens)
    generated = sum(map(len, out))
    return {"tok_s": round(generated / seconds, 1), "tokens": generated, "batch": clients,
            "answers": [baseline.text_of(tok, o) for o in out]}


def _row(found: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = found["logits"], reference["logits"]
    answers = baseline.agreement(found["answers"], reference["answers"])
    return {"plan_bytes": found["plan_bytes"], "plan_gpu_bytes": found["plan_gpu_bytes"],
            "allocated": found.get("allocated"), "tok_s": found["tok_s"],
            "speed_vs_reference": round(found["tok_s"] / reference["tok_s"], 3),
            "bytes_vs_reference": round(found["plan_bytes"] / reference["plan_bytes"], 3),
            "logits_relative_error": float((ours - theirs).norm() / theirs.norm()),
            "logits_finite": bool(ours.isfinite().all()),
            "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
            "answers_equal": f"{answers['equal']}/{answers['of']}",
            "mean_same_prefix": _mean_prefix(found["answers"], reference["answers"])}


def _mean_prefix(ours: list[str], theirs: list[str]) -> float:
    return round(sum(baseline.common_prefix(a, b) for a, b in zip(ours, theirs)) / max(1, len(ours)), 1)


def _judge(ctx: Context, rec: Recorder, scheme: str, row: dict[str, Any]) -> None:
    rec.expect(f"{scheme}: finite logits", row["logits_finite"], f"relative error to bfloat16 "
               f"{row['logits_relative_error']:.3f}, top-1 agreement {row['top1_agreement']:.3f}")
    rec.note(f"{scheme}: against {ctx.dtype}", f"{row['bytes_vs_reference']}x the bytes, {row['speed_vs_reference']}x "
             f"the speed ({row['tok_s']} tok/s), answers equal {row['answers_equal']}, mean same prefix "
             f"{row['mean_same_prefix']} tokens")
    _judge_memory(ctx, rec, scheme, row)


def _judge_memory(ctx: Context, rec: Recorder, scheme: str, row: dict[str, Any]) -> None:
    if ctx.dry:
        rec.skip(f"{scheme}: GPU memory within the plan's bytes", "dry run: no GPU")
        return
    planned, allocated = row["plan_gpu_bytes"], row["allocated"]
    rec.expect(f"{scheme}: GPU memory within the plan's bytes", abs(allocated - planned) <= 0.03 * planned + SLACK,
               f"allocated {mib(allocated)} for a plan of {mib(planned)}")
