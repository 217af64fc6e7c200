"""The budget with a ``gpu0`` tier: ``deploykit serve --budget gpu0=<1.5 plans>`` holding two on-demand
deployments of SmolLM2-135M's config (bfloat16) that never fit together. A request to the first loads it;
a request to the second unloads the first (pressure) and loads the second; the second unloads itself after
its keep-alive (idle). The GPU's used memory (``nvidia-smi``: the server process's context, its allocator's
cache and its tensors) is read at each stage: after an unload it must fall by the plan's bytes, which
happens only when torch's allocator cache is emptied as well. The dry run does the same under a ``cpu`` tier.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .. import manifests
from ..context import Context
from ..gpu import MIB, device_used_mib
from ..record import Recorder
from ..servers import Server, complete, deploykit_serve, metric, model_states

MODEL = "smollm2-135m"
FIRST, SECOND = "budget-a", "budget-b"
KEEP_ALIVE_S = 3
SLACK_MIB = 64  # allocator rounding and the CUDA context's own growth


def run(ctx: Context, rec: Recorder) -> None:
    folder = ctx.work / "budget-manifests"
    paths = {name: _manifest(ctx, folder, name, keep_alive) for name, keep_alive in
             ((FIRST, None), (SECOND, f"{KEEP_ALIVE_S}s"))}
    tier = "cpu" if ctx.dry else "gpu0"
    need = _plan_bytes(ctx, rec, paths[FIRST], tier)
    budget = f"{tier}={int(need * 1.5)}"
    server = deploykit_serve(folder, env=ctx.env(DEPLOYKIT_STATE=str(ctx.work / "state-budget")), ready_timeout=90,
                             log=ctx.work / "logs" / "budget.server.log",
                             args=("--budget", budget, "--budget-timeout", "60"))
    with rec.step(f"deploykit serve --budget {budget}: started") as step:
        server.start()
        step.detail = f"ready in {server.ready_s:.1f} s"
    try:
        used = _stages(ctx, rec, server)
    finally:
        server.stop()
    rec.metric("memory_mib", {**used, "plan_mib": round(need / MIB, 1), "tier": tier, "budget": budget})
    _judge(ctx, rec, used, need)


def _manifest(ctx: Context, folder: Path, name: str, keep_alive: str | None) -> Path:
    lifecycle: dict[str, Any] = {"load": "on-demand"}
    if keep_alive:
        lifecycle["keep_alive"] = keep_alive
    spec = manifests.Spec(name=name, model=ctx.model(MODEL), dtype=ctx.dtype, gpus=() if ctx.dry else (0,),
                          serving={"max_tokens": 16}, lifecycle=lifecycle)
    return manifests.write(spec, folder, shards=ctx.work / "shards")


def _plan_bytes(ctx: Context, rec: Recorder, path: Path, tier: str) -> int:
    with rec.step(f"deploykit plan: the {tier} bytes of one deployment") as step:
        done = ctx.deploykit("plan", str(path), "-o", "json", timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"exit {done.returncode}: {done.stderr[-600:]}")
        plan = json.loads(done.stdout)
        want = "cpu" if tier == "cpu" else 0
        need = sum(d["bytes"] for d in plan["devices"] if d["device"] == want)
        step.detail = f"{need / MIB:.1f} MiB"
    if need <= 0:
        raise RuntimeError(f"the plan holds nothing in {tier}: {plan['devices']}")
    return int(need)


def _stages(ctx: Context, rec: Recorder, server: Server) -> dict[str, Any]:
    used: dict[str, Any] = {"started": device_used_mib()}
    rec.expect("both start unloaded", set(model_states(server.url).values()) == {"unloaded"},
               str(model_states(server.url)))
    complete(server.url, FIRST, [5, 6, 7], max_tokens=4, timeout=90)
    used["first_loaded"] = device_used_mib()
    rec.expect("a request loads the first on demand", model_states(server.url)[FIRST] == "loaded",
               str(model_states(server.url)))
    complete(server.url, SECOND, [5, 6, 7], max_tokens=4, timeout=90)
    used["second_loaded"] = device_used_mib()
    states = model_states(server.url)
    evicted = metric(server.url, "deploykit_model_unloads_total", model=FIRST, reason="pressure")
    rec.expect("a request to the second evicts the first", states == {FIRST: "unloaded", SECOND: "loaded"}
               and evicted == 1, f"{states}; unloads of {FIRST} for pressure: {evicted:.0f}")
    rec.expect("the second unloads after its keep-alive", _wait_unloaded(server.url, SECOND, KEEP_ALIVE_S + 10),
               f"keep_alive {KEEP_ALIVE_S}s: {model_states(server.url)}")
    time.sleep(1.0)  # the unload's free runs after the state changes
    used["second_unloaded"] = device_used_mib()
    return used


def _wait_unloaded(url: str, name: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if model_states(url).get(name) == "unloaded":
            return True
        time.sleep(0.25)
    return False


def _judge(ctx: Context, rec: Recorder, used: dict[str, Any], need: int) -> None:
    if ctx.dry or None in used.values():
        rec.skip("GPU memory returned after each unload", "dry run: no GPU memory to read")
        return
    plan = need / MIB
    one = used["first_loaded"] - used["started"]
    rec.expect("evicting the first returned its GPU memory before the second loaded",
               used["second_loaded"] - used["started"] <= one + SLACK_MIB,
               f"used above the start: {one} MiB with the first, {used['second_loaded'] - used['started']} MiB "
               f"after the swap (one plan: {plan:.0f} MiB)")
    rec.expect("unloading the last returned its GPU memory (allocator emptied)",
               used["second_loaded"] - used["second_unloaded"] >= 0.9 * plan,
               f"{used['second_loaded']} -> {used['second_unloaded']} MiB after the unload (one plan: {plan:.0f} MiB)")
