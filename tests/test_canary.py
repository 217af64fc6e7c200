"""Gated rollouts end to end: a real `deploykit serve` of SmolLM2 under continuous load from the official
`openai` client, and the library ``Deployment``.

- a bad change (the same weights with one layer perturbed: it passes the health check) fails
  max_nll_increase before any traffic moves, and the old generation serves every request;
- a good change (float32 -> int8) passes the golden gates, walks the canary's steps with the split the
  response headers show close to the configured one, and is promoted (the old generation freed);
- a traffic gate that cannot pass (max_ttft_p95 below what this CPU can do) rolls back at the first step;
- every request answers (0 failed) throughout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import wait_until
from servers import Server, get
from helpers import smollm2_file
from traffic import Load

from deploykit.control.revisions.state import StateStore

GOLDEN_PROMPTS = [  # recorded with up to 40 tokens each: over the 128 reference tokens the gates below ask for
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [{"role": "user", "content": "Name three colours."}]},
    {"prompt": "The quick brown fox"},
    {"prompt": "Water boils at a temperature of"},
    {"prompt": "To bake bread, you first"},
    {"prompt": "The planets of the solar system are"},
]


def manifest(path: Path | str, *, quantization: str = "none", steps: str = "[30, 100]", gates: str,
             step_seconds: str = "2s", min_requests: int = 10) -> str:
    """A canary whose every step waits for ``min_requests`` of the new generation (up to 280 s): what a test
    counts in a step is there however slow this machine is at the moment."""
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smollm2}}\nspec:\n"
            f"  model: {{path: {path}, task: causal-lm, dtype: float32, quantization: {quantization}}}\n"
            f"  placement: {{gpus: []}}\n"
            f"  serving: {{max_concurrent: 4}}\n"
            f"  rollout:\n    strategy: canary\n    canary: {{steps: {steps}, step_seconds: {step_seconds}, "
            f"min_requests: {min_requests}, max_step_seconds: 280s}}\n"
            f"    gates: {{{gates}}}\n")


# 128 reference tokens rather than the default 256: recording them is SmolLM2 generating on a busy CPU
GOLDEN_GATES = "golden: golden.jsonl, min_golden_tokens: 128, max_nll_increase: 0.10, min_top1_agreement: 0.80"


def status(server: Server) -> dict[str, Any]:
    code, body = get(f"{server.url}/status")
    assert code == 200
    return next(s for s in body if s.get("name") == "smollm2")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    gguf = smollm2_file()
    root = tmp_path_factory.mktemp("canary")
    (root / "golden.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')  # replaced below, recorded
    (root / "smollm2.yaml").write_text(manifest(gguf, gates=GOLDEN_GATES))
    server = Server(root / "smollm2.yaml", root / "state", ready_timeout=300)
    with server:
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in GOLDEN_PROMPTS))
        recorded = subprocess.run([sys.executable, "-m", "deploykit.cli", "golden", "smollm2", "--prompts",
                                   str(prompts), "--max-tokens", "40", "--server", server.url],
                                  env=server.env, capture_output=True, check=False,
                                  text=True, timeout=600)
        assert recorded.returncode == 0, recorded.stderr
        lines = [json.loads(line) for line in recorded.stdout.splitlines()]
        assert len(lines) == len(GOLDEN_PROMPTS) and all(line["completion"] for line in lines)
        assert "own greedy answers" in recorded.stderr and "regression check" in recorded.stderr
        (root / "golden.jsonl").write_text(recorded.stdout)
        yield server, root


def roll(server: Server, root: Path, text: str, *, revision: int, phase: str) -> list[dict[str, Any]]:
    """Write the manifest (the server watches it) and wait until ``revision`` reaches ``phase``."""
    (root / "smollm2.yaml").write_text(text)
    store = StateStore(root / "state")

    def reached() -> bool:
        found = store.get("smollm2", revision)
        return found is not None and found.phase == phase

    try:
        wait_until(reached, timeout=600, what=f"revision {revision} is {phase}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; history {[(r.revision, r.phase, r.reason) for r in store.history('smollm2')]}, "
                             f"rollout {status(server)['rollout']}") from None
    wait_until(lambda: status(server)["rollout"]["stage"] in ("promoted", "rolled-back"), timeout=30,
               what="the rollout ended")
    return [{"revision": r.revision, "phase": r.phase, "reason": r.reason} for r in store.history("smollm2")]


def perturbed_copy(served_dir: Path, to: Path) -> Path:
    """The same checkpoint with one block's MLP output weights perturbed: loads and answers, badly."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(served_dir, to)
    for file in sorted(to.glob("*.safetensors")):
        weights = load_file(file)
        key = "model.layers.15.mlp.down_proj.weight"
        if key in weights:
            w = weights[key]
            noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.float().std() * 2
            weights[key] = (w.float() + noise).to(w.dtype)
            save_file(weights, file, metadata={"format": "pt"})
            return to
    raise AssertionError(f"no layer 15 in {served_dir}")


def test_a_bad_change_fails_its_golden_gate_and_the_old_generation_serves_every_request(
        served: tuple[Server, Path], tmp_path: Path) -> None:
    server, root = served
    current = StateStore(root / "state").current("smollm2")
    assert current is not None and current.shards_path
    bad = perturbed_copy(Path(current.shards_path), tmp_path / "bad")
    before = status(server)["generation"]
    load = Load(server.url).run()
    wait_until(lambda: len(load.served) >= 3, timeout=60, what="the load runs")
    history = roll(server, root, manifest(bad, gates=GOLDEN_GATES), revision=current.revision + 1, phase="Failed")
    seen = len(load.served)
    wait_until(lambda: len(load.served) >= seen + 3, timeout=60, what="requests after the rollback")
    load.join()
    assert load.failures == []
    assert {(r, g) for _, r, g in load.served} == {(current.revision, before)}  # never the bad one
    assert history[-1]["reason"].startswith("gate max_nll_increase: +"), history[-1]
    now = status(server)
    assert now["rollout"]["stage"] == "rolled-back" and now["rollout"]["step"] == 0  # no traffic moved
    assert now["serving_revision"] == current.revision and now["generation"] == before
    assert "gate max_nll_increase" in (now["last_error"] or "")


def test_a_good_change_walks_the_steps_and_is_promoted(served: tuple[Server, Path]) -> None:
    server, root = served
    store = StateStore(root / "state")
    old_revision = store.current("smollm2").revision  # type: ignore[union-attr]
    new_revision = store.latest("smollm2").revision + 1  # type: ignore[union-attr]
    steps: list[tuple[float, int]] = []  # (when seen, step)
    load = Load(server.url).run(clients=4)
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            rollout = status(server)["rollout"]
            if rollout and rollout["revision"] == new_revision and (not steps or steps[-1][1] != rollout["step"]):
                steps.append((time.monotonic(), rollout["step"]))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        history = roll(server, root, manifest(smollm2_file(), quantization="int8", gates=GOLDEN_GATES, step_seconds="4s"),
                       revision=new_revision, phase="Ready")
    finally:
        watching.set()
        watcher.join()
    seen = len(load.served)
    wait_until(lambda: len(load.served) >= seen + 3, timeout=60, what="requests after the promotion")
    load.join()
    assert load.failures == []
    assert history[-1]["reason"].startswith("gate max_nll_increase: +0.0"), history[-1]
    step_one = [t for t, s in steps if s == 1]
    step_two = [t for t, s in steps if s == 2]
    assert step_one and step_two, steps
    # requests that started well inside step 1 (30%): the new revision's share of them, from the headers
    inside = [r for t, r, _ in load.served if step_one[0] + 0.2 < t < step_two[0] - 0.2]
    share = sum(r == new_revision for r in inside) / len(inside)
    assert len(inside) >= 10 and abs(share - 0.30) <= 0.12, (share, len(inside))
    after = [r for t, r, _ in load.served if t > step_two[0] + 0.2]
    assert after and set(after) == {new_revision}
    assert {r for _, r, _ in load.served} == {old_revision, new_revision}
    now = status(server)
    assert now["serving_revision"] == new_revision and now["rollout"]["stage"] == "promoted"
    assert server.metric("deploykit_rollout_traffic_share", deployment="smollm2") == 100


@pytest.mark.parametrize(("gate", "says"), [
    ("max_ttft_p95: 1ms", "gate max_ttft_p95: "),
    # relative to the serving generation over the same step: the same model is never 100 times faster
    ("max_ttft_p95_ratio: 0.01", "gate max_ttft_p95_ratio: "),
])
def test_a_traffic_gate_that_fails_mid_way_rolls_back(served: tuple[Server, Path], gate: str, says: str) -> None:
    server, root = served
    store = StateStore(root / "state")
    current = store.current("smollm2")
    assert current is not None
    new_revision = store.latest("smollm2").revision + 1  # type: ignore[union-attr]
    load = Load(server.url).run()
    wait_until(lambda: len(load.served) >= 3, timeout=60, what="the load runs")
    history = roll(server, root, manifest(smollm2_file(), steps="[50, 100]", gates=gate),
                   revision=new_revision, phase="Failed")
    rolled_back = time.monotonic()
    wait_until(lambda: len(load.revisions_started_after(rolled_back)) >= 3, timeout=60,
               what="requests after the rollback")
    load.join()
    assert load.failures == []
    assert history[-1]["reason"].startswith(says), history[-1]
    if "ratio" in gate:  # what it compared: both generations' p95 over the step
        assert "(new " in history[-1]["reason"] and ", serving " in history[-1]["reason"], history[-1]
    assert any(r == new_revision for _, r, _ in load.served)  # it took traffic before the gate failed
    assert set(load.revisions_started_after(rolled_back)) == {current.revision}
    now = status(server)
    assert now["serving_revision"] == current.revision and now["rollout"]["step"] == 1
    assert server.metric("deploykit_rollout_gate_passed", deployment="smollm2", gate=gate.split(":")[0]) == 0


def test_deploykit_rollback_during_a_canary_aborts_it(tmp_path: Path) -> None:
    """Through a real server (a tiny chat model): `deploykit rollback` mid-canary ends it, the new revision is
    Failed, requests all answered, and the serving revision takes every request again."""
    from chatmodel import build_chat_model

    model = build_chat_model(tmp_path / "model")

    def tiny(shard: str) -> str:
        return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smollm2}}\nspec:\n"
                f"  model: {{path: {model}, dtype: float32}}\n  placement: {{gpus: []}}\n"
                f"  sharding: {{max_shard_size: {shard}}}\n"
                f"  rollout:\n    strategy: canary\n    canary: {{steps: [50, 100], step_seconds: 120s}}\n")

    path = tmp_path / "chat.yaml"
    path.write_text(tiny("2GiB"))
    with Server(path, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        with client.chat.completions.with_streaming_response.create(
                model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True) as streamed:
            assert (streamed.headers["x-deploykit-revision"], streamed.headers["x-deploykit-generation"]) == ("1", "1")
        load = Load(server.url).run()
        path.write_text(tiny("1MiB"))
        wait_until(lambda: (status(server)["rollout"] or {}).get("stage") == "traffic", timeout=120,
                   what="the canary's first step")
        wait_until(lambda: any(r == 2 for _, r, _ in load.served), timeout=60, what="the new revision serves")
        cli = [sys.executable, "-m", "deploykit.cli"]
        shown = subprocess.run([*cli, "rollout", "smollm2"], env=server.env, capture_output=True, text=True,
                               check=False, timeout=60)
        assert "step 1 of 2" in shown.stdout and "takes 50% of new requests" in shown.stdout, shown
        rolled = subprocess.run([*cli, "rollback", "smollm2"], env=server.env, capture_output=True, text=True,
                                check=False, timeout=120)
        assert rolled.returncode == 0, rolled.stderr
        rolled_back = time.monotonic()
        wait_until(lambda: len(load.revisions_started_after(rolled_back)) >= 5, timeout=60,
                   what="requests after the rollback")
        load.join()
        assert load.failures == []
        assert set(load.revisions_started_after(rolled_back)) == {1}
        history = StateStore(tmp_path / "state").history("smollm2")
        assert [(r.revision, r.phase) for r in history] == [(1, "Ready"), (2, "Failed")]
        assert history[-1].reason == "canary aborted at step 1 (50%): rolled back by `deploykit rollback`"
        assert status(server)["rollout"]["stage"] == "rolled-back"
