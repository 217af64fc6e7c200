"""``deploykit serve`` on the GPU, against ``transformers serve --continuous-batching`` and plain batched
``generate``, on the same ~1.2B random-weight model at bfloat16, in the same run.

Each server answers 16 concurrent streaming chat clients (greedy, 64 tokens each): tokens/s over the wall
time, time to first token, failed requests, and the GPU's used memory while serving (above what it held
before the server started). deploykit's greedy answers are compared with ``generate``'s: alone (four
prompts, one at a time, through ``/v1/completions`` with the same token ids) and under load (the 16
concurrent answers against one batched ``generate``). At bfloat16 a batch's shape can flip a near tie, so
these are reported; the exact comparison is the float32 check, ``serve_exact``.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from .. import baseline, manifests
from ..context import Context
from ..gpu import UsedSampler, device_used_mib
from ..record import Recorder
from ..servers import Server, complete, deploykit_serve, free_port, load, prompts, stream_chat

MODEL = "llama-3.2-1b"
TRANSFORMERS_CLI = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"


def sizes(ctx: Context) -> dict[str, int]:
    """Clients, tokens per answer, prompts compared one at a time, tokens per compared answer."""
    return {"clients": 4, "tokens": 16, "alone": 2, "alone_tokens": 8} if ctx.dry else \
        {"clients": 16, "tokens": 64, "alone": 4, "alone_tokens": 32}


def run(ctx: Context, rec: Recorder) -> None:
    n = sizes(ctx)
    texts = prompts(n["clients"])
    reference = _generate(ctx, rec, texts, n)
    systems: dict[str, Any] = {"generate (batched)": reference["speed"]}
    for batching in ("padded", "continuous"):
        systems[f"deploykit serve ({batching})"] = rec.attempt(_deploykit, ctx, rec, texts, n, reference, batching)
        rec.metric("systems", systems)
    systems["transformers serve --continuous-batching"] = rec.attempt(_transformers, ctx, rec, texts, n)
    rec.metric("systems", systems)


def _generate(ctx: Context, rec: Recorder, texts: list[str], n: dict[str, int]) -> dict[str, Any]:
    with rec.step("plain transformers: load, greedy answers, batched generate") as step:
        model, tok = baseline.load(ctx.model(MODEL), dtype=ctx.dtype, device=ctx.device)
        ids = [baseline.chat_ids(tok, t) for t in texts]
        baseline.generate_one(model, tok, ids[0], max_new_tokens=2)  # warm-up: kernels, allocator
        alone = [baseline.text_of(tok, baseline.generate_one(model, tok, i, max_new_tokens=n["alone_tokens"]))
                 for i in ids[: n["alone"]]]
        _, first = baseline.generate_batch(model, tok, ids, max_new_tokens=1)
        batch, seconds = baseline.generate_batch(model, tok, ids, max_new_tokens=n["tokens"])
        tokens = sum(map(len, batch))
        speed = {"clients": len(texts), "tokens": tokens, "wall_s": round(seconds, 3),
                 "tok_s": round(tokens / seconds, 1), "ttft_p50_s": round(first, 3), "ttft_p95_s": round(first, 3),
                 "note": "one batch; time to first token = the batch's prefill (max_new_tokens=1)"}
        step.detail = f"{speed['tok_s']} tok/s for {len(texts)} prompts in one batch"
    del model
    _free(ctx)
    return {"ids": ids, "alone": alone, "batch": [baseline.text_of(tok, b) for b in batch], "speed": speed}


def _free(ctx: Context) -> None:
    gc.collect()
    if not ctx.dry:
        import torch

        torch.cuda.empty_cache()


def _deploykit(ctx: Context, rec: Recorder, texts: list[str], n: dict[str, int], reference: dict[str, Any],
               batching: str) -> dict[str, Any]:
    name = f"serve-{batching}"
    spec = manifests.Spec(name=name, model=ctx.model(MODEL), dtype=ctx.dtype, gpus=() if ctx.dry else (0,),
                          serving={"max_tokens": 256, "max_concurrent": 16, "batching": batching})
    path = manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")
    server = deploykit_serve(path, env=ctx.env(DEPLOYKIT_STATE=str(ctx.work / f"state-{name}")), ready_timeout=150,
                             log=ctx.work / "logs" / f"{name}.server.log")
    before = device_used_mib()
    with rec.step(f"deploykit serve ({batching}): start, answer, {len(texts)} clients") as step, \
            UsedSampler() as gpu, server:
        serving_idle = device_used_mib()
        alone = [complete(server.url, name, ids, max_tokens=n["alone_tokens"], timeout=120)
                 for ids in reference["ids"][: n["alone"]]]
        stream_chat(server.url, name, "Say hello.", max_tokens=4, timeout=120)  # warm-up
        gpu.reset()
        result = load(server.url, name, texts, max_tokens=n["tokens"], timeout=180)
        step.detail = f"ready in {server.ready_s:.1f} s; {result['tok_s']} tok/s, {result['failed']} failed"
    result.update(ready_s=round(server.ready_s, 1), **_memory(before, serving_idle, gpu.peak))
    _judge(ctx, rec, f"deploykit serve ({batching})", result, alone, reference)
    return result


def _memory(before: int | None, idle: int | None, peak: int | None) -> dict[str, Any]:
    """GPU memory the server added: once loaded, and at its peak under load (MiB; None without a GPU)."""
    if before is None or idle is None:
        return {"gpu_mib_loaded": None, "gpu_mib_peak": None}
    return {"gpu_mib_loaded": idle - before, "gpu_mib_peak": (peak or idle) - before}


def _judge(ctx: Context, rec: Recorder, system: str, result: dict[str, Any], alone: list[str],
           reference: dict[str, Any]) -> None:
    rec.expect(f"{system}: every request answered", result["failed"] == 0,
               f"{result['failed']} of {result['clients']} failed {result['errors'][:1]}")
    one = baseline.agreement(alone, reference["alone"])
    result["agreement_alone"] = one
    detail = f"{one['equal']}/{one['of']} equal at {ctx.dtype} {one['first_differences'][:2]}"
    if ctx.dtype == "float32":
        rec.expect(f"{system}: greedy answers alone equal generate's", one["equal"] == one["of"], detail)
    else:  # a near tie may flip between two kernels at bfloat16: reported; serve_exact judges float32
        rec.note(f"{system}: greedy answers alone against generate's", detail + " (reported, not judged)")
    many = baseline.agreement(result.pop("texts"), reference["batch"])
    result["agreement_under_load"] = many
    rec.note(f"{system}: 16 concurrent answers against batched generate",
             f"{many['equal']}/{many['of']} equal at {ctx.dtype} (reported, not judged: batch shapes differ)")


def _transformers(ctx: Context, rec: Recorder, texts: list[str], n: dict[str, int]) -> dict[str, Any]:
    path = ctx.model(MODEL)
    port = free_port()
    cmd = [sys.executable, "-c", TRANSFORMERS_CLI, "serve", str(path), "--continuous-batching", "--device",
           ctx.device, "--dtype", ctx.dtype, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if ctx.dry:  # on the CPU its paged cache is sized from the host's RAM by default (several GiB)
        cmd += ["--cb-num-blocks", "64"]
    env = ctx.env(HF_HUB_CACHE=str(_empty(ctx.work / "hf-hub")))
    before = device_used_mib()
    with rec.step(f"transformers serve --continuous-batching: start, {len(texts)} clients") as step, \
            UsedSampler() as gpu, \
            Server(cmd, port=port, log=ctx.work / "logs" / "transformers-serve.log", env=env, ready_path="/health",
                   ready_timeout=150) as server:
        idle = device_used_mib()
        stream_chat(server.url, str(path), "Say hello.", max_tokens=4, timeout=120)  # warm-up
        gpu.reset()
        result = load(server.url, str(path), texts, max_tokens=n["tokens"], timeout=180)
        step.detail = f"ready in {server.ready_s:.1f} s; {result['tok_s']} tok/s, {result['failed']} failed"
    result.update(ready_s=round(server.ready_s, 1), **_memory(before, idle, gpu.peak))
    result.pop("texts")
    rec.expect("transformers serve: every request answered", result["failed"] == 0,
               f"{result['failed']} of {result['clients']} failed {result['errors'][:1]}")
    return result


def _empty(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
