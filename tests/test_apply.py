"""`apply` end to end on tiny real models: reshard, load across CPU and disk, health check, revisions."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploykit.errors import ApplyError
from deploykit.spec.manifest import load_manifests
from deploykit.control.revisions.reconciler import ApplyOptions, apply
from deploykit.artifacts.verify import verify
from deploykit.control.revisions.report import status_report
from deploykit.control.revisions.state import StateStore

from manifests import write_manifest


def deploykit(*args: str, state: Path, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEPLOYKIT_STATE": str(state), **kw.pop("env", {})}
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300, **kw)


@pytest.fixture
def store(tmp_path) -> StateStore:
    return StateStore(tmp_path / "state")


def logits(model_obj, ids=((1, 7, 42, 100, 3),)):
    with torch.no_grad():
        return model_obj(torch.tensor(ids)).logits


@pytest.mark.parametrize("fraction", [0.0, 0.35, 0.7, 1.0])
def test_outputs_equal_plain_from_pretrained_whatever_the_split(model, store, tmp_path, fraction):
    from transformers import AutoModelForCausalLM

    total = sum(t.numel() * 4 for t in load_file(model / "model.safetensors").values())
    cpu = max(1, int(total * fraction)) if fraction < 1 else "1GiB"
    [loaded] = load_manifests(write_manifest(tmp_path, model, cpu=cpu))
    outcome = apply(loaded, store=store, options=ApplyOptions(keep_model=True))
    devices = set(outcome.plan.device_map.values())
    assert devices == ({"cpu"} if fraction == 1.0 else {"disk"} if fraction == 0 else {"cpu", "disk"})
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    assert torch.equal(logits(reference), logits(outcome.loaded.model))
    assert outcome.revision == 1 and store.current("tiny").phase == "Ready"
    assert verify(outcome.shards) == []


def test_second_apply_is_a_no_op(model, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, model))
    first = apply(loaded, store=store)
    shards = sorted(p.stat().st_mtime_ns for p in first.shards.iterdir())
    again = apply(loaded, store=store)
    assert again.status == "unchanged" and again.revision == 1
    assert list(again.timings) == ["validate"]  # no plan, no reshard, no load
    assert len(store.history("tiny")) == 1
    assert sorted(p.stat().st_mtime_ns for p in first.shards.iterdir()) == shards


def test_no_op_cli_apply_imports_no_torch(model, tmp_path):
    manifest = write_manifest(tmp_path, model)
    state = tmp_path / "state"
    assert deploykit("apply", str(manifest), "-q", state=state).returncode == 0
    code = ("import sys\nfrom deploykit import cli\n"
            f"try:\n    cli.main(['apply', {str(manifest)!r}, '-q'])\nexcept SystemExit as e:\n    print(e.code)\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=60)
    assert "unchanged" in result.stdout and result.stdout.strip().splitlines()[-2:] == ["0", "False"]


def test_dry_run_changes_nothing(model, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, model))
    outcome = apply(loaded, store=store, options=ApplyOptions(dry_run=True))
    assert outcome.status == "dry-run" and outcome.plan is not None
    assert [a.step for a in outcome.actions][0] == "plan"
    assert store.history("tiny") == [] and not (tmp_path / "shards").exists()


def test_failed_apply_keeps_previous_revision_and_shards(model, store, tmp_path):
    [good] = load_manifests(write_manifest(tmp_path, model))
    first = apply(good, store=store)
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights are 128 wide
    (broken / "config.json").write_text(json.dumps(config))
    [bad] = load_manifests(write_manifest(tmp_path, broken, shard="300KiB"))
    with pytest.raises(ApplyError, match="do not match config.json: .*up_proj.weight is \\[128, 64\\]"):
        apply(bad, store=store)
    assert store.current("tiny").revision == 1
    assert store.latest("tiny").phase == "Failed" and store.latest("tiny").revision == 2
    assert verify(first.shards) == []  # revision 1's shards are intact
    status = status_report(store, "tiny")
    assert status["phase"] == "Failed" and status["conditions"][0]["status"] is True


def test_missing_weights_fail_before_ready(model, store, tmp_path):
    state = load_file(model / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    [loaded] = load_manifests(write_manifest(tmp_path, model))
    with pytest.raises(ApplyError, match="not in the checkpoint.*up_proj"):
        apply(loaded, store=store)
    assert store.current("tiny") is None


def test_health_check_catches_nan_weights(model, store, tmp_path):
    state = load_file(model / "model.safetensors")
    state["model.norm.weight"][:] = float("nan")
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    [loaded] = load_manifests(write_manifest(tmp_path, model))
    with pytest.raises(ApplyError, match="not finite"):
        apply(loaded, store=store)
    assert store.latest("tiny").phase == "Failed" and "not finite" in store.latest("tiny").reason


def test_gpu_plan_on_a_host_without_those_gpus(model, store, tmp_path):
    manifest = write_manifest(tmp_path, model)
    manifest.write_text(manifest.read_text().replace("gpus: []", "gpus: [0, 1]"))
    [loaded] = load_manifests(manifest)
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs")
    with pytest.raises(ApplyError, match="CUDA device"):
        apply(loaded, store=store, options=ApplyOptions(devices="2x4GiB"))
    assert store.latest("tiny") is None  # refused while deciding: nothing recorded, nothing touched


def test_other_tasks_apply(tiny_model, store, tmp_path):
    for name, task in (("bert", "feature-extraction"), ("t5", "seq2seq-lm"), ("gpt2", "causal-lm")):
        [loaded] = load_manifests(write_manifest(tmp_path, tiny_model(name), name=name, task=task,
                                                 cpu=150_000))
        outcome = apply(loaded, store=store)
        assert outcome.status == "applied" and "finite" in outcome.health, name


def test_kill_during_apply_then_next_apply_finishes(model, tmp_path):
    manifest = write_manifest(tmp_path, model, shard="50KiB")
    state = tmp_path / "state"
    killed = deploykit("apply", str(manifest), "-q", state=state, env={"DEPLOYKIT_FAILPOINT": "after-shard-2"})
    assert killed.returncode == -signal.SIGKILL
    store = StateStore(state)
    assert store.current("tiny") is None and status_report(store, "tiny")["phase"] == "Failed"
    done = deploykit("apply", str(manifest), "-q", state=state)
    assert done.returncode == 0, done.stderr
    history = store.history("tiny")
    assert [(r.revision, r.phase) for r in history] == [(1, "Failed"), (2, "Ready")]
    assert "interrupted" in history[0].reason


def test_concurrent_applies_are_serialised(model, tmp_path):
    manifest = write_manifest(tmp_path, model)
    state = tmp_path / "state"
    env = {**os.environ, "DEPLOYKIT_STATE": str(state)}
    procs = [subprocess.Popen([sys.executable, "-m", "deploykit.cli", "apply", str(manifest), "-q"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    texts = sorted(o[0].split()[0] for o in outputs)
    assert texts == ["applied", "unchanged"]
    assert [r.phase for r in StateStore(state).history("tiny")] == ["Ready"]


def test_rollback_history_and_git_commit(model, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    manifest = write_manifest(repo, model, cpu="1GiB")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    state = tmp_path / "state"
    assert deploykit("apply", str(manifest), "-q", state=state).returncode == 0
    manifest.write_text(manifest.read_text().replace("max_memory: 1GiB", "max_memory: 300000"))
    assert deploykit("apply", str(manifest), "-q", state=state).returncode == 0
    store = StateStore(state)
    assert store.get("tiny", 1).git_commit == head
    assert "disk" in store.get("tiny", 2).plan.device_map.values()
    result = deploykit("rollback", "tiny", "-q", state=state)
    assert result.returncode == 0, result.stderr
    assert "now revision 3" in result.stdout
    assert store.get("tiny", 3).plan.device_map == store.get("tiny", 1).plan.device_map
    assert store.get("tiny", 3).manifest_digest == store.get("tiny", 1).manifest_digest
    hist = deploykit("history", "tiny", "-o", "json", state=state)
    rows = json.loads(hist.stdout)
    assert [(r["revision"], r["phase"], r["current"]) for r in rows] == [
        (1, "Ready", False), (2, "Ready", False), (3, "Ready", True)]


def test_cli_status_diff_and_errors(model, tmp_path):
    manifest = write_manifest(tmp_path, model)
    state = tmp_path / "state"
    result = deploykit("apply", str(manifest), "-q", state=state)
    assert result.returncode == 0 and "revision 1 Ready" in result.stdout
    status = json.loads(deploykit("status", "tiny", "-o", "json", state=state).stdout)
    assert (status["name"], status["revision"], status["phase"]) == ("tiny", 1, "Ready")
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "Failed"}
    assert status["plan"]["devices"][0]["device"] == "cpu"
    manifest.write_text(manifest.read_text().replace("max_memory: 1GiB", "max_memory: 300000"))
    diff = deploykit("diff", str(manifest), state=state)
    assert diff.returncode == 0, diff.stderr
    assert "spec.offload.cpu.max_memory: 1073741824 -> 300000" in diff.stdout
    assert "-> disk" in diff.stdout and "reshard: needed" in diff.stdout
    missing = deploykit("status", "nope", state=state)
    assert missing.returncode == 1 and "no deployment named 'nope'" in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest.read_text().replace("dtype: float32", "dtype: fp32"))
    invalid = deploykit("apply", str(bad), state=state)
    assert invalid.returncode == 2 and "spec.model.dtype" in invalid.stderr


def test_new_content_with_the_same_layout_never_touches_the_current_shards(model, store, tmp_path):
    [good] = load_manifests(write_manifest(tmp_path, model))
    first = apply(good, store=store)
    before = {p.name: p.read_bytes() for p in first.shards.glob("*.safetensors")}
    poisoned = Path(shutil.copytree(model, tmp_path / "poisoned"))
    state = load_file(poisoned / "model.safetensors")
    state["model.norm.weight"][:] = float("nan")  # same names and shapes: the same layout
    save_file(state, poisoned / "model.safetensors", metadata={"format": "pt"})
    [bad] = load_manifests(write_manifest(tmp_path, poisoned))
    with pytest.raises(ApplyError, match="not finite"):
        apply(bad, store=store)
    assert {p.name: p.read_bytes() for p in first.shards.glob("*.safetensors")} == before
    assert Path(store.current("tiny").shards_path) == first.shards
