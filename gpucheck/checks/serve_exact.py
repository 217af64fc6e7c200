"""``deploykit serve``'s greedy answers equal ``generate``'s, exactly, at float32: SmolLM2-135M's config
(random weights), 16 requests sent at once through ``/v1/completions`` (token-id prompts, so both sides
read the same ids) and batched by deploykit, against ``generate`` one prompt at a time on the GPU. At
float32 a batch's padding moves the logits by rounding only, far below the gap between a random model's
top two tokens, so any difference is a bug (masks, positions, cache, a tensor on the wrong device).

Two placements, each its own server: the whole model on ``cuda:0`` (``gpus: [0]``, no offload: no
accelerate hooks move the inputs, so every tensor the engine makes must be made on the model's device),
and split over ``cuda:0`` and the CPU (the GPU given about half the model through a simulated inventory,
as ``deploykit plan --devices`` takes; the GPU layers still load on the real GPU 0). The dry run serves
the whole model on the CPU and skips the split."""

from __future__ import annotations

import threading

from .. import baseline, manifests
from ..context import Context
from ..record import Recorder
from ..servers import complete, deploykit_serve, prompts

MODEL = "smollm2-135m"
NAME = "serve-exact"
PLACEMENTS = {"whole": "cuda:0", "split": "cuda:0 + cpu"}


def run(ctx: Context, rec: Recorder) -> None:
    clients, tokens = (4, 12) if ctx.dry else (16, 24)
    with rec.step("plain transformers: greedy answers one prompt at a time (float32)") as step:
        model, tok = baseline.load(ctx.model(MODEL), dtype="float32", device=ctx.device)
        ids = [baseline.chat_ids(tok, t) for t in prompts(clients)]
        reference = [baseline.text_of(tok, baseline.generate_one(model, tok, i, max_new_tokens=tokens)) for i in ids]
        step.detail = f"{clients} prompts, {tokens} tokens each"
    del model
    found: dict[str, object] = {}
    for placement in PLACEMENTS:
        if ctx.dry and placement != "whole":
            rec.skip(f"{placement}: cuda:0 + cpu", "dry run (no CUDA): the whole model is served on the CPU")
            continue
        found[placement] = rec.attempt(_judged, ctx, rec, placement, ids, reference, tokens)
        rec.metric("agreement", found)


def _judged(ctx: Context, rec: Recorder, placement: str, ids: list[list[int]], reference: list[str],
            tokens: int) -> dict[str, object]:
    answers = _served(ctx, rec, placement, ids, tokens)
    found = baseline.agreement(answers, reference)
    where = "cpu" if ctx.dry else PLACEMENTS[placement]
    rec.expect(f"{placement} ({where}): {len(ids)} concurrent answers equal generate's (float32)",
               found["equal"] == found["of"], f"{found['equal']}/{found['of']} equal {found['first_differences'][:2]}")
    return found


def _served(ctx: Context, rec: Recorder, placement: str, ids: list[list[int]], tokens: int) -> list[str]:
    name = f"{NAME}-{placement}"
    spec = manifests.Spec(name=name, model=ctx.model(MODEL), dtype="float32", gpus=() if ctx.dry else (0,),
                          serving={"max_concurrent": 16})
    path = manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")
    args: tuple[str, ...] = ()
    if placement == "split":  # the GPU holds about half the weights; the planner puts the rest on the CPU
        args = ("--devices", f"1x{int(ctx.models[MODEL]['bytes']) // 2}")
    server = deploykit_serve(path, env=ctx.env(DEPLOYKIT_STATE=str(ctx.work / f"state-{name}")), ready_timeout=120,
                             log=ctx.work / "logs" / f"{name}.server.log", args=args)
    answers = [""] * len(ids)
    errors: list[str] = []

    def one(i: int, url: str) -> None:
        try:
            answers[i] = complete(url, name, ids[i], max_tokens=tokens, timeout=120)
        except Exception as exc:  # noqa: BLE001 - counted below
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    with rec.step(f"deploykit serve, {placement}: {len(ids)} requests at once") as step, server:
        threads = [threading.Thread(target=one, args=(i, server.url)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        step.detail = f"ready in {server.ready_s:.1f} s"
    rec.expect("every request answered", not errors, "; ".join(errors[:2]) or f"{len(ids)} answered")
    return answers
