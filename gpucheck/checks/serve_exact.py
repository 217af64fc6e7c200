"""``deploykit serve``'s greedy answers equal ``generate``'s, exactly, at float32: SmolLM2-135M's config
(random weights) on the GPU, 16 requests sent at once through ``/v1/completions`` (token-id prompts, so
both sides read the same ids) and batched by deploykit, against ``generate`` one prompt at a time. At
float32 a batch's padding moves the logits by rounding only, far below the gap between a random model's
top two tokens, so any difference is a bug (masks, positions, cache)."""

from __future__ import annotations

import threading

from .. import baseline, manifests
from ..context import Context
from ..record import Recorder
from ..servers import complete, deploykit_serve, prompts

MODEL = "smollm2-135m"
NAME = "serve-exact"


def run(ctx: Context, rec: Recorder) -> None:
    clients, tokens = (4, 12) if ctx.dry else (16, 24)
    with rec.step("plain transformers: greedy answers one prompt at a time (float32)") as step:
        model, tok = baseline.load(ctx.model(MODEL), dtype="float32", device=ctx.device)
        ids = [baseline.chat_ids(tok, t) for t in prompts(clients)]
        reference = [baseline.text_of(tok, baseline.generate_one(model, tok, i, max_new_tokens=tokens)) for i in ids]
        step.detail = f"{clients} prompts, {tokens} tokens each"
    del model
    answers = _served(ctx, rec, ids, tokens)
    found = baseline.agreement(answers, reference)
    rec.metric("agreement", found)
    rec.expect(f"{clients} concurrent answers equal generate's (float32)", found["equal"] == found["of"],
               f"{found['equal']}/{found['of']} equal {found['first_differences'][:2]}")


def _served(ctx: Context, rec: Recorder, ids: list[list[int]], tokens: int) -> list[str]:
    spec = manifests.Spec(name=NAME, model=ctx.model(MODEL), dtype="float32", gpus=() if ctx.dry else (0,),
                          serving={"max_concurrent": 16})
    path = manifests.write(spec, ctx.work / "manifests", shards=ctx.work / "shards")
    server = deploykit_serve(path, env=ctx.env(DEPLOYKIT_STATE=str(ctx.work / f"state-{NAME}")), ready_timeout=120,
                             log=ctx.work / "logs" / f"{NAME}.server.log")
    answers = [""] * len(ids)
    errors: list[str] = []

    def one(i: int, url: str) -> None:
        try:
            answers[i] = complete(url, NAME, ids[i], max_tokens=tokens, timeout=120)
        except Exception as exc:  # noqa: BLE001 - counted below
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    with rec.step(f"deploykit serve: {len(ids)} requests at once") as step, server:
        threads = [threading.Thread(target=one, args=(i, server.url)) for i in range(len(ids))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        step.detail = f"ready in {server.ready_s:.1f} s"
    rec.expect("every request answered", not errors, "; ".join(errors[:2]) or f"{len(ids)} answered")
    return answers
