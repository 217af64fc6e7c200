"""kill -9 during `deploykit reshard`, at chosen points and at random moments: DST is always either
the previous complete checkpoint or the new complete one, and the next run finishes the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deploykit.model.checkpoint import LOCK
from deploykit.artifacts.verify import verify

MiB = 2**20


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    """64 MiB of real safetensors in 32 tensors, so a reshard into 2 MiB shards takes a while."""
    src = tmp_path_factory.mktemp("crash") / "src"
    src.mkdir()
    gen = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.weight": torch.randn(512, 1024, generator=gen) for i in range(32)}
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text('{"model_type": "llama"}')
    return src


def run(src: Path, dst: Path, size: str, *, failpoint: str | None = None,
        kill_after: float | None = None) -> subprocess.CompletedProcess | int:
    env = {**os.environ, "DEPLOYKIT_FAILPOINT": failpoint or ""}
    cmd = [sys.executable, "-m", "deploykit.cli", "reshard", str(src), str(dst), "--max-shard-size", size, "-q"]
    if kill_after is None:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    return proc.wait()


def layout_of(dst: Path) -> int | None:
    lock = json.loads((dst / LOCK).read_text())
    return lock["layout"]["max_shard_size"]


def assert_old_or_new(dst: Path, old: int, new: int) -> int:
    assert dst.is_dir(), "DST vanished"
    assert verify(dst) == [], verify(dst)
    assert not list(dst.glob("*.partial"))
    size = layout_of(dst)
    assert size in (old, new)
    return size


@pytest.mark.parametrize("failpoint", ["after-shard-1", "after-shard-9", "before-commit", "after-exchange"])
def test_kill_at_failpoint_then_resume(big_src, tmp_path, failpoint):
    dst = tmp_path / "dst"
    assert run(big_src, dst, "16MiB").returncode == 0  # the previous, good checkpoint
    killed = run(big_src, dst, "2MiB", failpoint=failpoint)
    assert killed.returncode == -signal.SIGKILL
    state = assert_old_or_new(dst, 16 * MiB, 2 * MiB)
    assert state == (2 * MiB if failpoint == "after-exchange" else 16 * MiB)
    again = run(big_src, dst, "2MiB")
    assert again.returncode == 0, again.stderr
    assert assert_old_or_new(dst, 16 * MiB, 2 * MiB) == 2 * MiB
    if failpoint == "after-shard-9":
        assert "resumed" in again.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["dst"]  # no staging or old trees left


def test_kill_at_random_moments(big_src, tmp_path):
    dst = tmp_path / "dst"
    assert run(big_src, dst, "16MiB").returncode == 0
    previous = 16 * MiB
    for i, delay in enumerate((0.15, 0.3, 0.45, 0.6, 0.8, 1.2)):
        target = (2 if i % 2 == 0 else 4) * MiB
        run(big_src, dst, f"{target // MiB}MiB", kill_after=delay)
        previous = assert_old_or_new(dst, previous, target)
    final = run(big_src, dst, "2MiB")
    assert final.returncode == 0
    assert assert_old_or_new(dst, 2 * MiB, 2 * MiB) == 2 * MiB


def test_first_run_killed_leaves_no_dst(big_src, tmp_path):
    dst = tmp_path / "dst"
    assert run(big_src, dst, "2MiB", failpoint="after-shard-3").returncode == -signal.SIGKILL
    assert not dst.exists()
    assert run(big_src, dst, "2MiB").returncode == 0 and verify(dst) == []
