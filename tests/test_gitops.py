"""GitOps with a real git repository: CI validates and diffs, a host serves the manifests directory,
`git pull` reloads, `git revert` rolls back; and `apply DIR` with `--prune`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploykit.control.revisions.state import StateStore
from manifests import manifest_text


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), "-c", "user.name=ci", "-c", "user.email=ci@example.com",
                             *args], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def deploykit(*args: str, state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=300)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(predicate, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return False


@pytest.fixture
def upstream(tiny_model, tmp_path) -> Path:
    repo = tmp_path / "upstream"
    (repo / "manifests").mkdir(parents=True)
    model = shutil.copytree(tiny_model("llama"), tmp_path / "models" / "tiny")
    (repo / "manifests" / "tiny.yaml").write_text(manifest_text(Path(model)).replace(
        "path: shards", f"path: {tmp_path / 'host-shards'}"))
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "tiny: all on CPU")
    return repo


def test_pull_reloads_and_revert_rolls_back(upstream, tmp_path):
    ci_state = tmp_path / "ci-state"
    # CI on a pull request: validate (schema only: CI has no model files) and diff
    ci = deploykit("validate", "--schema-only", str(upstream / "manifests" / "tiny.yaml"), state=ci_state)
    assert ci.returncode == 0, ci.stderr
    assert "not deployed yet" in deploykit("diff", str(upstream / "manifests"), state=ci_state).stdout

    host = tmp_path / "host"
    subprocess.run(["git", "clone", "-q", str(upstream), str(host)], check=True)
    state, port = tmp_path / "host-state", free_port()
    server = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "serve", str(host / "manifests"),
                               "--port", str(port), "--debounce", "0.2"],
                              env={**os.environ, "DEPLOYKIT_STATE": str(state)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def status() -> dict:
        return json.loads(get(port, "/status")[1])[0]

    try:
        assert wait_for(lambda: get(port, "/readyz")[0] == 200)
        assert get(port, "/healthz")[0] == 200
        first = status()
        assert (first["generation"], first["revision"], first["phase"]) == (1, 1, "Ready")
        assert first["git_commit"] == git(host, "rev-parse", "HEAD")

        manifest = upstream / "manifests" / "tiny.yaml"
        manifest.write_text(manifest.read_text().replace("max_memory: 1GiB", "max_memory: 300000"))
        git(upstream, "commit", "-qam", "tiny: part of the model on disk")
        git(host, "pull", "-q")
        assert wait_for(lambda: status()["generation"] == 2)
        second = status()
        assert second["revision"] == 2 and second["git_commit"] == git(upstream, "rev-parse", "HEAD")
        assert "disk" in {d["device"] for d in second["plan"]["devices"]}

        git(upstream, "revert", "--no-edit", "HEAD")
        git(host, "pull", "-q")
        # the new generation serves a moment before its reload is counted: wait for both
        assert wait_for(lambda: (s := status())["generation"] == 3 and s["reloads"]["total"] == 2)
        store = StateStore(state)
        assert store.get("tiny", 3).plan.device_map == store.get("tiny", 1).plan.device_map
        assert store.get("tiny", 3).manifest_digest == store.get("tiny", 1).manifest_digest

        metrics = get(port, "/metrics")[1]
        assert 'deploykit_generation{deployment="tiny"} 3.0' in metrics
        assert 'deploykit_reloads_total{deployment="tiny"} 2.0' in metrics
        assert 'deploykit_device_bytes{deployment="tiny",device="cpu"}' in metrics
    finally:
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert "stopped" in err


def test_apply_directory_and_prune(tiny_model, tmp_path):
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    for name in ("b-model", "a-model"):
        (manifests / f"{name}.yaml").write_text(manifest_text(tiny_model("llama"), name=name))
    state = tmp_path / "state"
    result = deploykit("apply", str(manifests), "-q", state=state)
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines() if l.startswith("applied")]
    assert [l.split()[1] for l in lines] == ["a-model:", "b-model:"]  # stable (file name) order
    (manifests / "b-model.yaml").unlink()
    kept = deploykit("apply", str(manifests), "-q", state=state)
    assert "pruned" not in kept.stdout and StateStore(state).names() == ["a-model", "b-model"]
    b_shards = Path(StateStore(state).current("b-model").shards_path)
    assert b_shards.is_dir()
    pruned = deploykit("apply", str(manifests), "--prune", "-q", state=state)
    assert "pruned b-model" in pruned.stdout
    assert StateStore(state).names() == ["a-model"]
    assert not b_shards.exists()  # its shards went with it; a-model's stay
    assert Path(StateStore(state).current("a-model").shards_path).is_dir()
