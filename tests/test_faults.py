"""Regression tests for faults found in review: each failed before the layered core.

1. a restart served shards whose bytes were corrupted in place (same size): now verified, re-laid out
2. ``strategy: auto`` falling back to recreate recorded a false Failed revision
3. reads waited behind a writer's transaction
4. stale errors: a no-op apply did not clear them; readiness contradicted the docs
5. the CPU-only load path had no ``hf_device_map``
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deploykit.control.live.deployment import Deployment
from deploykit.control.revisions.reconciler import ApplyOptions, apply
from deploykit.control.revisions.report import status_report
from deploykit.control.revisions.state import StateStore
from deploykit.control.live.supervisor import Supervisor
from deploykit.errors import CheckpointError, DeploykitError
from deploykit.spec.manifest import load_manifests
from manifests import manifest_text, replace_like_an_editor, write_manifest
from test_runtime import IDS, reference_logits


def corrupt_in_place(path: Path) -> None:
    """Overwrite a tensor's bytes with NaNs, keeping the file's size and modification time."""
    stat = path.stat()
    with safe_open(str(path), "pt") as f:
        name = next(iter(f.keys()))
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    begin, end = json.loads(path.read_bytes()[8:8 + header_len])[name]["data_offsets"]
    with open(path, "r+b") as fh:
        fh.seek(8 + header_len + begin)
        fh.write(torch.full(((end - begin) // 4,), float("nan")).numpy().tobytes())
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


# ---- 1. restart verifies shards and health-checks -------------------------------------------------

def test_restart_lays_out_corrupted_shards_again_and_serves_correct_outputs(model, tmp_path):
    path = write_manifest(tmp_path, model)
    state = tmp_path / "state"
    Deployment.from_manifest(path, state_dir=state).close()
    store = StateStore(state)
    shards = Path(store.current("tiny").shards_path)
    victim = sorted(shards.glob("*.safetensors"))[1]
    corrupt_in_place(victim)

    dep = Deployment.from_manifest(path, state_dir=state)  # a restart
    try:
        with dep.acquire() as m, torch.no_grad():
            assert torch.equal(m(IDS).logits, reference_logits(model))
    finally:
        dep.close()
    history = StateStore(state).history("tiny")
    assert [r.phase for r in history] == ["Ready", "Ready"]
    events = " ".join(e.message for e in StateStore(state).events("tiny"))
    assert "not intact" in events and victim.name in events  # the damaged shard was named, then laid out again


def test_restart_with_corrupted_shards_and_the_source_gone_names_the_shard(model, tmp_path):
    path = write_manifest(tmp_path, model)
    state = tmp_path / "state"
    Deployment.from_manifest(path, state_dir=state).close()
    shards = Path(StateStore(state).current("tiny").shards_path)
    victim = sorted(shards.glob("*.safetensors"))[0]
    corrupt_in_place(victim)
    shutil.rmtree(model)
    with pytest.raises(DeploykitError, match=victim.name):
        Deployment.from_manifest(path, state_dir=state)


def test_a_checkpoint_used_in_place_and_changed_in_place_is_refused(model, tmp_path):
    path = write_manifest(tmp_path, model, shard="1GiB")  # the source layout fits: used in place
    state = tmp_path / "state"
    Deployment.from_manifest(path, state_dir=state).close()
    assert StateStore(state).current("tiny").shards_path == str(model.resolve())
    corrupt_in_place(model / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: content differs"):
        Deployment.from_manifest(path, state_dir=state)


# ---- 2. auto falls back to recreate as a decision --------------------------------------------------

def test_auto_fallback_to_recreate_records_one_ready_revision(model, tmp_path):
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    path = write_manifest(tmp_path, model, cpu="1GiB", strategy="auto")
    # room for one generation on the CPU tier, not two; disk is disabled by the inventory below
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state",
                                   devices=f"cpu={int(size * 1.5)},disk=0")
    try:
        replace_like_an_editor(path, manifest_text(model, cpu="1GiB", strategy="auto", shard="300KiB"))
        assert dep.reload()
        assert dep.reloads[-1].strategy == "recreate"
    finally:
        dep.close()
    history = StateStore(tmp_path / "state").history("tiny")
    assert [r.phase for r in history] == ["Ready", "Ready"]


# ---- 3. reads never wait behind writers ------------------------------------------------------------

def test_reads_do_not_wait_for_a_write_transaction(tmp_path):
    store = StateStore(tmp_path)
    number = store.begin_revision(name="m", manifest_path="/x/m.yaml", manifest_text="a: 1\n",
                                  manifest_digest="sha256:m", checkpoint_fingerprint="sha256:c", git_commit=None)
    store.finish_revision("m", number, ready=True)
    writer = sqlite3.connect(store.path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE revisions SET reason='being written' WHERE name='m'")
    try:
        result: dict = {}
        reader = threading.Thread(target=lambda: result.update(status_report(store, "m")))
        started = time.perf_counter()
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "a read waited for the writer"
        assert time.perf_counter() - started < 1.0
        assert result["phase"] == "Ready"
    finally:
        writer.execute("ROLLBACK")
        writer.close()


# ---- 4. stale errors and readiness -----------------------------------------------------------------

def test_a_no_op_apply_clears_a_stale_error(model, tmp_path):
    store = StateStore(tmp_path / "state")
    [good] = load_manifests(write_manifest(tmp_path, model))
    apply(good, store=store)
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    [bad] = load_manifests(write_manifest(tmp_path, broken))
    with pytest.raises(DeploykitError):
        apply(bad, store=store)
    assert status_report(store, "tiny")["last_error"]
    [good] = load_manifests(write_manifest(tmp_path, model))
    assert apply(good, store=store).status == "unchanged"
    report = status_report(store, "tiny")
    assert report["last_error"] is None and report["phase"] == "Ready"


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_readiness_follows_what_serves_not_what_failed(model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    path = write_manifest(directory, model)
    store = StateStore(tmp_path / "state")
    supervisor = Supervisor(directory, store=store, debounce=0.1)
    supervisor.start()
    try:
        assert supervisor.ready() == (True, [])
        replace_like_an_editor(path, path.read_text().replace("max_shard_size: 200KiB", "max_shard_sze: 1"))
        wait_for(lambda: supervisor.deployments["tiny"].status()["last_error"] is not None)
        # broken manifest pending, last good generation serving: ready, and the error is reported
        assert supervisor.ready() == (True, [])
        [report] = supervisor.statuses()
        assert "max_shard_sze" in report["last_error"] and report["serving_revision"] == 1
        assert "max_shard_sze" in status_report(store, "tiny")["last_error"]  # `deploykit status` too
        replace_like_an_editor(path, manifest_text(model, shard="300KiB"))  # a real fix
        wait_for(lambda: supervisor.deployments["tiny"].generation == 2)
        assert supervisor.ready() == (True, [])
        assert status_report(store, "tiny")["last_error"] is None
    finally:
        supervisor.close()


def test_not_ready_while_a_deployment_is_still_loading(model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    write_manifest(directory, model)
    supervisor = Supervisor(directory, store=StateStore(tmp_path / "state"), debounce=0.1)
    starter = threading.Thread(target=supervisor.start)
    starter.start()
    seen = []
    while starter.is_alive():
        ready, missing = supervisor.ready()
        seen.append(ready)
        if ready:
            assert [s["name"] for s in supervisor.statuses()] == ["tiny"]
        time.sleep(0.01)
    starter.join()
    try:
        assert seen and seen[0] is False
        assert supervisor.ready() == (True, [])
    finally:
        supervisor.close()


# ---- 5. hf_device_map on every load path ----------------------------------------------------------

def test_cpu_only_loads_have_an_hf_device_map_equal_to_the_plan(model, tmp_path):
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    [loaded] = load_manifests(write_manifest(tmp_path, model, cpu=total // 2))
    outcome = apply(loaded, store=StateStore(tmp_path / "state"), options=ApplyOptions(keep_model=True))
    assert outcome.loaded is not None
    assert outcome.loaded.model.hf_device_map == outcome.plan.device_map
    assert set(outcome.loaded.model.hf_device_map.values()) == {"cpu", "disk"}


@pytest.mark.parametrize("budgeted", [False, True], ids=["alone", "under-a-host-budget"])
def test_a_restart_while_the_file_holds_a_failing_change_serves_the_last_ready_revision(model, tmp_path, budgeted):
    """As `deploykit serve` restarts (always under a host budget) and as the library does without one."""
    from invariants.world import _nan_copy

    from deploykit.control.budget.host import Host
    from deploykit.control.budget.tiers import Budget

    def host() -> Host | None:
        return Host(Budget({"cpu": 1 << 30})) if budgeted else None

    directory, store = tmp_path / "manifests", StateStore(tmp_path / "state")
    directory.mkdir()
    file = write_manifest(directory, model)
    with Deployment.from_manifest(file, store=store, host=host()) as dep:
        assert dep.status()["serving"] and store.current("tiny").revision == 1
    broken = _nan_copy(model, tmp_path / "nan")  # plans, lays out and loads; fails its health check
    replace_like_an_editor(file, manifest_text(broken))
    with Deployment.from_manifest(file, store=store, host=host()) as dep:  # revision 1 serves, the error shows
        status = dep.status()
        assert status["serving"] and status["phase"] == "Failed", status
        assert "finite" in (status["last_error"] or ""), status
        assert store.current("tiny").revision == 1 and dep.state().revision == 1
        with dep.acquire() as served:  # revision 1's model answers
            assert served is not None
