"""A canary in the middle of a long step, against a real `deploykit serve` under load (a tiny chat model):
what status says while it runs, and how stop and rollback end it.

- while a healthy canary runs, `/status`, `/control/v1/status` and `deploykit status` say Progressing with
  the step, the share and the requests so far: never Failed, never "interrupted";
- `deploykit rollback` in the middle of a 300 s step answers within seconds with the revision that served
  before, and every request that starts after it is answered by that revision;
- SIGTERM in the middle of a 300 s step ends the server within its drain time, with no thread left;
- `/status` polled 50 times a second through all of it never answers 5xx.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from chatmodel import build_chat_model
from helpers import wait_until
from servers import Server, get
from traffic import Load

from deploykit.control.revisions.state import StateStore

CLI = [sys.executable, "-m", "deploykit.cli"]


def manifest(model: Path, shard: str, *, step_seconds: str = "300s", limit: str = "") -> str:
    """A canary of two steps; ``limit``: its max_step_seconds."""
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
            f"  model: {{path: {model}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n"
            f"  rollout:\n    strategy: canary\n"
            f"    canary: {{steps: [50, 100], step_seconds: {step_seconds}, "
            + (f"max_step_seconds: {limit}, " if limit else "") + "min_requests: 1}\n")


def chat_status(server: Server) -> dict[str, Any]:
    code, body = get(f"{server.url}/status")
    assert code == 200, body
    return next(s for s in body if s.get("name") == "chat")


class Poller:
    """``/status`` asked 50 times a second on a thread; every answer that is not a 200 is kept."""

    def __init__(self, url: str) -> None:
        self.url, self.bad, self.answers = url, [], 0  # type: ignore[var-annotated]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop.wait(0.02):
            try:
                code, body = get(f"{self.url}/status")
            except OSError:  # the server is gone (the SIGTERM test)
                return
            self.answers += 1
            if code != 200:
                self.bad.append((code, body))

    def join(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


@pytest.fixture
def canary_server(tmp_path: Path):
    """A server of revision 1, under load, with a canary of revision 2 in its first (300 s) step."""
    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model, "2GiB"))
    with Server(path, tmp_path / "state") as server:
        load = Load(server.url, model="chat").run()
        poller = Poller(server.url)
        try:
            path.write_text(manifest(model, "1MiB"))  # the same weights laid out otherwise: a healthy change
            wait_until(lambda: (chat_status(server)["rollout"] or {}).get("stage") == "traffic", timeout=120,
                       what="the canary's first step")
            wait_until(lambda: any(r == 2 for _, r, _ in load.served), timeout=60, what="the new revision serves")
            yield server, load, poller, tmp_path / "state"
        finally:
            load.stop.set()
            poller.join()


def test_a_healthy_canary_shows_progressing_and_a_rollback_ends_its_step_within_seconds(canary_server) -> None:
    server, load, poller, state = canary_server
    now = chat_status(server)
    assert now["phase"] == "Progressing" and now["last_error"] is None, now
    conditions = {c["type"]: c for c in now["conditions"]}
    assert conditions["Failed"]["status"] is False, conditions
    assert conditions["Progressing"]["status"] is True and "canary" in conditions["Progressing"]["message"]
    assert (now["rollout"]["stage"], now["rollout"]["step"], now["rollout"]["share"]) == ("traffic", 1, 50)
    assert now["rollout"]["requests"].get("2", 0) >= 1  # the share's requests so far
    shown = subprocess.run([*CLI, "status", "chat", "-o", "json"], env=server.env, capture_output=True, text=True,
                           check=False, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["phase"] == "Progressing"
    asked = time.monotonic()
    rolled = subprocess.run([*CLI, "rollback", "chat"], env=server.env, capture_output=True, text=True,
                            check=False, timeout=120)
    answered = time.monotonic()
    assert rolled.returncode == 0, rolled.stderr
    assert answered - asked < 15, answered - asked  # the CLI's own start (imports) included
    assert "revision 1" in rolled.stdout, rolled.stdout
    wait_until(lambda: len(load.revisions_started_after(answered)) >= 5, timeout=60, what="requests after it")
    load.join()
    poller.join()
    assert load.failures == []
    assert set(load.revisions_started_after(answered)) == {1}
    assert poller.bad == [] and poller.answers > 20
    history = StateStore(state).history("chat")
    assert [(r.revision, r.phase) for r in history] == [(1, "Ready"), (2, "Failed")]
    assert chat_status(server)["serving_revision"] == 1


def test_sigterm_in_the_middle_of_a_canary_step_stops_the_server_within_its_drain_time(canary_server) -> None:
    server, load, poller, state = canary_server
    assert server.process is not None
    stopped = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError("deploykit serve still runs 30 s after SIGTERM in a canary step") from None
    took = time.monotonic() - stopped
    _, stderr = server.process.communicate()
    load.join()
    assert server.process.returncode == 0, stderr
    assert took < 30, took
    assert "threads still running" not in stderr, stderr
    assert "deploykit serve: stopped" in stderr
    last = StateStore(state).history("chat")[-1]
    assert (last.revision, last.phase) == (2, "Failed") and "stopping" in (last.reason or ""), last
