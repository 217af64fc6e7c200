"""The library ``Deployment`` runs the same gated rollouts: a perturbed checkpoint fails its golden gate
while callers keep being served by the old generation; a good change walks its steps and is promoted; an
abort (what `deploykit rollback` sends) ends a canary mid-way."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from chatmodel import GOLDEN, build_chat_model
from helpers import wait_until

from deploykit import Deployment
from deploykit.control.revisions.state import Revision, StateStore



def manifest(path: Path, *, shard: str = "2GiB", steps: str = "[50, 100]", seconds: str = "1s",
             min_requests: int = 10) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
            f"  model: {{path: {path}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n"
            f"  rollout:\n    strategy: canary\n    canary: {{steps: {steps}, step_seconds: {seconds}, min_requests: {min_requests}}}\n"
            f"    gates: {{golden: golden.jsonl, max_nll_increase: 0.05, min_top1_agreement: 0.9}}\n")


def perturbed(good: Path, to: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(good, to)
    weights = load_file(to / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    noise = torch.randn(weights[key].shape, generator=torch.Generator().manual_seed(1))
    weights[key] = weights[key] + noise * weights[key].abs().mean() * 20
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


@pytest.fixture
def deployed(tmp_path: Path):
    good = build_chat_model(tmp_path / "good")
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(good))
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        yield dep, path, good
    finally:
        dep.close()


class Callers:
    """Threads calling ``dep.generate`` until stopped; every failure kept."""

    def __init__(self, dep: Deployment) -> None:
        self.dep, self.done, self.failures = dep, 0, []  # type: ignore[var-annotated]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._call, daemon=True) for _ in range(2)]  # joined
        for thread in self.threads:
            thread.start()

    def _call(self) -> None:
        while not self.stop.is_set():
            try:
                self.dep.generate("Hello", max_tokens=2)
                self.done += 1
            except Exception as exc:  # noqa: BLE001 - counted: the test asserts there are none
                self.failures.append(repr(exc))

    def join(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)


def test_a_perturbed_checkpoint_fails_its_golden_gate_and_a_good_change_is_promoted(deployed, tmp_path: Path) -> None:
    dep, path, good = deployed
    callers = Callers(dep)
    path.write_text(manifest(perturbed(good, tmp_path / "bad")))
    assert dep.reload() is False
    status = dep.status()
    assert status["generation"] == 1 and status["revision"] == 1
    assert status["last_error"].startswith(("gate max_nll_increase: +", "gate min_top1_agreement: ")), status
    failed = next(g for g in status["rollout"]["gates"] if not g["passed"])
    if failed["gate"] == "max_nll_increase":  # the per-case paired differences, and the interval that decided
        assert len(failed["per_case"]) == len(GOLDEN) and failed["interval"][1] > 0.05
    assert status["rollout"]["stage"] == "rolled-back" and status["rollout"]["step"] == 0
    assert [(r.revision, r.phase) for r in dep.store.history("chat")] == [(1, "Ready"), (2, "Failed")]
    old = dep.pool.current
    assert old is not None
    path.write_text(manifest(good, shard="1MiB"))  # the same weights laid out otherwise: a good change
    assert dep.reload() is True
    wait_until(lambda: old.loaded is None, timeout=30, what="the old generation is freed")
    callers.join()
    assert callers.failures == [] and callers.done > 0
    status = dep.status()
    assert status["revision"] == 3 and status["last_error"] is None and status["rollout"]["stage"] == "promoted"
    gates = {g["gate"]: g["value"] for g in status["rollout"]["gates"]}
    assert gates == {"max_nll_increase": pytest.approx(0.0, abs=1e-5), "min_top1_agreement": 1.0}
    assert dep.pool.candidate is None and status["generation"] == dep.pool.current.number  # type: ignore[union-attr]


def test_golden_references_with_too_few_tokens_are_refused_before_anything_loads(deployed, tmp_path: Path) -> None:
    """Golden gates need evidence: references of 2 short cases (44 tokens) are refused at the apply, naming
    the field, how many tokens there are and the minimum; nothing is recorded or loaded, the old one serves."""
    dep, path, good = deployed
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in (
        {"prompt": "The capital of France is", "completion": " Paris, on the Seine."},
        {"messages": [{"role": "user", "content": "Say hi"}], "completion": "Hi! How are you?"})))
    path.write_text(manifest(good, shard="1MiB"))
    assert dep.reload() is False
    error = dep.status()["last_error"]
    assert f"{path}:11:" in error and "spec.rollout.gates.golden" in error, error
    assert "holds 37 reference tokens in 2 cases" in error and "the 256 the golden gates need" in error, error
    assert "min_golden_tokens" in error
    assert [(r.revision, r.phase) for r in dep.store.history("chat")] == [(1, "Ready")]
    assert dep.pool.candidate is None and dep.status()["generation"] == 1
    path.write_text(manifest(good, shard="1MiB").replace("min_top1_agreement: 0.9}", "min_top1_agreement: 0.9, "
                                                                                     "min_golden_tokens: 32}"))
    callers = Callers(dep)  # the canary's steps need their requests
    try:
        assert dep.reload() is True  # the operator lowered the minimum: the same references decide
    finally:
        callers.join()
    assert callers.failures == [] and dep.status()["revision"] == 2


def test_an_abort_ends_a_canary_mid_way(deployed) -> None:
    dep, path, good = deployed
    path.write_text(manifest(good, shard="1MiB", steps="[10, 100]", seconds="60s"))
    result: list[bool] = []
    reloading = threading.Thread(target=lambda: result.append(dep.reload()))
    reloading.start()
    wait_until(lambda: dep.rolling and (dep.status()["rollout"] or {}).get("stage") == "traffic", timeout=60,
               what="the canary's first step")
    candidate = dep.pool.candidate
    assert dep.pool.share == 10 and candidate is not None
    pins = [dep.pin() for _ in range(10)]  # one in ten new pins goes to the candidate
    assert [g.number for g in pins].count(candidate.number) == 1
    held = next(g for g in pins if g is candidate)
    for gen in pins:
        if gen is not held:
            dep.unpin(gen)
    assert dep.abort_rollout("rolled back by hand") is True
    reloading.join(timeout=30)
    assert result == [False]
    assert candidate.loaded is not None  # a request running on it finishes on it
    assert dep.pin().number == 1 and candidate.refs == 1  # new ones go to the serving generation
    dep.unpin(dep.pool.current)  # type: ignore[arg-type]
    dep.unpin(held)
    wait_until(lambda: candidate.loaded is None, timeout=30, what="the new generation is freed")
    assert dep.pool.candidate is None and dep.status()["revision"] == 1
    last = dep.store.history("chat")[-1]
    assert (last.phase, last.reason) == ("Failed", "canary aborted at step 1 (10%): rolled back by hand")
    assert dep.abort_rollout("again") is False  # nothing in progress


def test_close_in_the_middle_of_a_canary_step_returns_within_seconds(deployed) -> None:
    """``close`` ends the canary (the revision is Failed, naming why) instead of queueing behind its 300 s step."""
    dep, path, good = deployed
    path.write_text(manifest(good, shard="1MiB", steps="[10, 100]", seconds="300s"))
    result: list[bool] = []
    reloading = threading.Thread(target=lambda: result.append(dep.reload()))
    reloading.start()
    wait_until(lambda: (dep.status()["rollout"] or {}).get("stage") == "traffic", timeout=60,
               what="the canary's first step")
    assert dep.status()["phase"] == "Progressing"
    candidate = dep.pool.candidate
    assert candidate is not None
    closing = time.monotonic()
    dep.close()
    assert time.monotonic() - closing < 10
    reloading.join(timeout=30)
    assert not reloading.is_alive() and result == [False]
    assert candidate.loaded is None and dep.pool.current is None  # both freed
    last = dep.store.history("chat")[-1]
    assert (last.revision, last.phase) == (2, "Failed")
    assert last.reason == "canary aborted at step 1 (10%): the deployment is closing"
    assert not [t for t in threading.enumerate() if t.name == "deploykit-change-chat"]


def test_a_newer_change_ends_a_canary_step_and_is_applied(deployed, tmp_path: Path) -> None:
    """A save of the manifest in the middle of a canary's long step ends that canary at once (recorded
    Failed: superseded) and rolls out the newer manifest, rather than waiting for the step."""
    dep, path, good = deployed
    path.write_text(manifest(good, shard="1MiB", steps="[10, 100]", seconds="300s"))
    dep.request_reload()
    wait_until(lambda: (dep.status()["rollout"] or {}).get("stage") == "traffic", timeout=60,
               what="the canary's first step")
    callers = Callers(dep)  # the newer change's canary needs its requests
    path.write_text(manifest(good, shard="512KiB", steps="[100]", seconds="1s", min_requests=2))
    dep.request_reload()
    wait_until(lambda: dep.status()["revision"] == 3, timeout=60, what="the newer change serves")
    callers.join()
    assert callers.failures == []
    history = [(r.revision, r.phase, r.reason) for r in dep.store.history("chat")]
    assert history[1] == (2, "Failed", "canary aborted at step 1 (10%): superseded by a newer change of the manifest")
    assert history[2][:2] == (3, "Ready")


class AbortedAtTheLastMoment(Deployment):
    """A deployment whose rollback comes in after its canary's last step has its requests, while the step
    shows them: the moment after which nothing used to check the abort before promoting."""

    aborted: list[bool] = []

    def _publish(self, progress) -> None:  # type: ignore[no-untyped-def]
        super()._publish(progress)
        if progress is not None and progress.stage == "traffic" and progress.requests and not self.aborted:
            self.aborted.append(self.abort_rollout("rolled back by hand"))


def test_an_abort_that_returns_true_is_never_followed_by_the_promotion(tmp_path: Path) -> None:
    good = build_chat_model(tmp_path / "good")
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(good, steps="[100]", seconds="1s", min_requests=1))
    dep = AbortedAtTheLastMoment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        callers = Callers(dep)
        path.write_text(manifest(good, shard="1MiB", steps="[100]", seconds="1s", min_requests=1))
        assert dep.reload() is False
        callers.join()
        assert dep.aborted == [True]
        last = dep.store.history("chat")[-1]
        assert (last.revision, last.phase) == (2, "Failed"), last
        assert dep.status()["revision"] == 1 and dep.store.current("chat").revision == 1  # type: ignore[union-attr]
    finally:
        dep.close()


class FullAtReady(StateStore):
    """The state store on a disk that fills up as the canary's revision is recorded Ready."""

    def finish_revision(self, name: str, revision: int, *, ready: bool, reason: str | None = None,
                        timings: dict[str, float] | None = None) -> None:
        if ready and revision == 2:
            raise sqlite3.OperationalError("database or disk is full")
        super().finish_revision(name, revision, ready=ready, reason=reason, timings=timings)


class FailingAfterReady(StateStore):
    """The state store failing once right after the canary's revision is recorded Ready (when the shards no
    revision needs are looked up)."""

    failing = False

    def finish_revision(self, name: str, revision: int, *, ready: bool, reason: str | None = None,
                        timings: dict[str, float] | None = None) -> None:
        super().finish_revision(name, revision, ready=ready, reason=reason, timings=timings)
        self.failing = ready and revision == 2

    def history(self, name: str) -> list[Revision]:
        if self.failing:
            self.failing = False
            raise sqlite3.OperationalError("disk I/O error")
        return super().history(name)


@pytest.mark.parametrize(("store_type", "serving", "phase"), [(FullAtReady, 1, "Failed"),
                                                             (FailingAfterReady, 2, "Ready")])
def test_a_store_failure_at_the_promotion_leaves_no_candidate_and_serves_what_the_store_says(
        store_type: type[StateStore], serving: int, phase: str, tmp_path: Path) -> None:
    """A failure before the revision is recorded Ready rolls back (the candidate given up and freed, the
    revision Failed); one after it promotes (the store's current revision is what serves). Either way no
    candidate is left staged, and the store never names as current a revision that does not serve."""
    good = build_chat_model(tmp_path / "good")
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(good, steps="[100]", min_requests=1))
    dep = Deployment.from_manifest(path, store=store_type(tmp_path / "state"))
    callers = Callers(dep)
    try:
        path.write_text(manifest(good, shard="1MiB", steps="[100]", min_requests=1))
        try:
            assert dep.reload() is (serving == 2)
        finally:
            callers.join()
        assert callers.failures == []
        assert dep.pool.candidate is None
        current = dep.pool.current
        assert current is not None and current.revision == serving
        assert dep.store.current("chat").revision == serving  # type: ignore[union-attr]
        assert [(r.revision, r.phase) for r in dep.store.history("chat")] == [(1, "Ready"), (2, phase)]
        other = 2 if serving == 1 else 1
        wait_until(lambda: other in [n for n, _ in dep.pool.memory], timeout=30,
                   what=f"generation {other} (revision {other}) is freed")
        assert dep.status()["revision"] == serving
    finally:
        dep.close()


def test_library_calls_take_the_step_share_not_twice_it(deployed) -> None:
    """``generate`` pins once per call: at a 10% step one call in ten goes to the candidate."""
    dep, path, good = deployed
    path.write_text(manifest(good, shard="1MiB", steps="[10, 100]", seconds="300s"))
    result: list[bool] = []
    reloading = threading.Thread(target=lambda: result.append(dep.reload()))
    reloading.start()
    try:
        wait_until(lambda: (dep.status()["rollout"] or {}).get("stage") == "traffic", timeout=60,
                   what="the canary's first step")
        candidate, serving = dep.pool.candidate, dep.pool.current
        assert candidate is not None and serving is not None
        new_before, old_before = candidate.traffic.total, serving.traffic.total
        for _ in range(20):
            dep.generate("Hello", max_tokens=1)
        assert (candidate.traffic.total - new_before, serving.traffic.total - old_before) == (2, 18)
    finally:
        dep.abort_rollout("rolled back by hand")
        reloading.join(timeout=60)
    assert result == [False]


class AbortedWhileScoring(Deployment):
    """A deployment whose rollout is aborted as its golden references start to be scored."""

    def _publish(self, progress) -> None:  # type: ignore[no-untyped-def]
        super()._publish(progress)
        if progress is not None and progress.stage == "golden" and not progress.gates:
            self.abort_rollout("rolled back by hand")


def test_an_abort_during_golden_scoring_ends_it_before_the_references_are_scored(tmp_path: Path) -> None:
    """Scoring is interrupted between two forwards: no golden gate value is ever computed after the abort."""
    good = build_chat_model(tmp_path / "good")
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(good))
    dep = AbortedWhileScoring.from_manifest(path, state_dir=tmp_path / "state")
    try:
        path.write_text(manifest(good, shard="1MiB"))
        assert dep.reload() is False
        rollout = dep.status()["rollout"]
        assert rollout["stage"] == "rolled-back" and rollout["gates"] == [], rollout
        last = dep.store.history("chat")[-1]
        assert (last.revision, last.phase, last.reason) == (2, "Failed", "rollout aborted: rolled back by hand")
        assert dep.pool.candidate is None and dep.status()["revision"] == 1
    finally:
        dep.close()


def test_relative_gates_with_no_baseline_fail_the_canary(deployed) -> None:
    """``steps: [100]``: the serving generation takes no request, so the relative gates have nothing to
    compare with; the rollout fails naming the gate and "no baseline", never promoted on no evidence."""
    dep, path, good = deployed
    relative = manifest(good, shard="1MiB", steps="[100]", min_requests=4).replace(
        "gates: {golden: golden.jsonl, max_nll_increase: 0.05, min_top1_agreement: 0.9}",
        "gates: {max_error_rate_increase: 0.5}")
    path.write_text(relative)
    callers = Callers(dep)
    try:
        assert dep.reload() is False
    finally:
        callers.join()
    assert callers.failures == []
    last = dep.store.history("chat")[-1]
    assert last.phase == "Failed" and (last.reason or "").startswith("gate max_error_rate_increase: no baseline")
    gate = next(g for g in dep.status()["rollout"]["gates"] if g["gate"] == "max_error_rate_increase")
    assert gate["passed"] is False and gate["detail"].startswith("no baseline")
    assert dep.status()["revision"] == 1


class AbortedWhileLoading(StateStore):
    """The state store of a deployment whose rollout is aborted while its candidate loads (right after the
    candidate's plan is recorded, before its weights load)."""

    owner: Deployment | None = None
    aborted: list[bool] = []

    def set_plan(self, name: str, revision: int, **fields) -> None:  # type: ignore[no-untyped-def]
        super().set_plan(name, revision, **fields)
        if revision == 2 and self.owner is not None:
            self.aborted.append(self.owner.abort_rollout("rolled back by hand"))


def test_an_abort_while_the_candidate_loads_ends_that_rollout(tmp_path: Path) -> None:
    """A rollback while the candidate loads aborts it (armed from the start), instead of finding no rollout
    and going one revision back from the one that serves."""
    good = build_chat_model(tmp_path / "good")
    (tmp_path / "golden.jsonl").write_text("".join(json.dumps(c) + "\n" for c in GOLDEN))
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(good))
    store = AbortedWhileLoading(tmp_path / "state")
    dep = Deployment.from_manifest(path, store=store)
    store.owner = dep
    try:
        path.write_text(manifest(good, shard="1MiB"))
        assert dep.reload() is False
        assert store.aborted == [True]
        last = dep.store.history("chat")[-1]  # it stopped before loading the candidate's weights
        assert (last.revision, last.phase, last.reason) == (2, "Failed", "rollout aborted before its candidate "
                                                                         "loaded: rolled back by hand")
        assert dep.status()["revision"] == 1 and dep.pool.candidate is None
    finally:
        dep.close()
