"""A gated rollout applied through the control API (a ``Supervisor`` without a path, as `deploykit serve`
holds API-owned names) gives way at once to what comes next for its name: a rollback while its candidate
loads ends that rollout (never the revision before the serving one), and a new apply, a delete or a
`rollback --to-revision` in the middle of a 300 s step ends the canary and runs, instead of waiting for the
canary's turn. Every wait is on an event (a hook in the state store, the deployment's status), never a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chatmodel import build_chat_model
from helpers import wait_until

from deploykit.control.live.supervisor import Supervisor
from deploykit.control.revisions.state import StateStore
from deploykit.spec.manifest import LoadedManifest, load_manifests


def manifest(model: Path, *, shard: str, rollout: str) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
            f"  model: {{path: {model}, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n  rollout:\n{rollout}")


CANARY = "    strategy: canary\n    canary: {steps: [10, 100], step_seconds: 300s, min_requests: 1}\n"
BLUE_GREEN = "    strategy: blue-green\n"


def given(directory: Path, text: str) -> LoadedManifest:
    """A manifest handed to the control API (its file is not watched)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "chat.yaml"
    path.write_text(text)
    [loaded] = load_manifests(path)
    return loaded


class Background:
    """``fn`` on a thread of its own; what it returned or raised kept."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,))
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - kept for the test to assert on
            self.error = exc

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


class PausedAtLoad(StateStore):
    """A state store that holds the apply of revision 2 right after its plan is recorded (its candidate is
    about to load) until ``go`` is set; ``loading`` says it got there."""

    pause = False

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.loading, self.go = threading.Event(), threading.Event()

    def set_plan(self, name: str, revision: int, **fields: Any) -> None:
        super().set_plan(name, revision, **fields)
        if self.pause and revision == 2:
            self.loading.set()
            assert self.go.wait(120)


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return build_chat_model(tmp_path / "good")


def test_a_rollback_while_the_candidate_loads_ends_that_rollout_not_the_serving_revision(good, tmp_path):
    store = PausedAtLoad(tmp_path / "state")
    supervisor = Supervisor(None, store=store)
    try:
        supervisor.apply_manifest(given(tmp_path / "one", manifest(good, shard="2GiB", rollout=CANARY)))
        store.pause = True
        applying = Background(lambda: supervisor.apply_manifest(
            given(tmp_path / "two", manifest(good, shard="1MiB", rollout=CANARY))))
        assert store.loading.wait(120)
        asked = threading.Event()  # the rollback ended the rollout (and waits for it), or it returned
        steps: list[str] = []

        def on_step(step: str) -> None:
            steps.append(step)
            asked.set()

        rolling_back = Background(lambda: supervisor.rollback("chat", on_step=on_step))
        wait_until(lambda: asked.is_set() or not rolling_back.thread.is_alive(), 60, "the rollback asks")
        store.go.set()
        assert rolling_back.join(120) and applying.join(120)
        assert rolling_back.error is None, rolling_back.error
        target, _ = rolling_back.result
        assert target.revision == 1 and steps == ["abort the rollout"]
        assert applying.error is not None and "aborted" in str(applying.error), applying.error
        assert [(r.revision, r.phase) for r in store.history("chat")] == [(1, "Ready"), (2, "Failed")]
        assert store.current("chat").revision == 1  # type: ignore[union-attr]
        assert supervisor.get("chat").status()["revision"] == 1  # type: ignore[union-attr]
    finally:
        store.go.set()
        supervisor.close()


@pytest.mark.parametrize("what", ["apply", "delete", "rollback-to-revision"])
def test_a_change_of_the_name_ends_an_api_canary_mid_step_instead_of_waiting_for_its_turn(good, tmp_path, what):
    store = StateStore(tmp_path / "state")
    supervisor = Supervisor(None, store=store)
    try:  # revision 1 is blue-green: a rollback to it is not a canary of its own
        supervisor.apply_manifest(given(tmp_path / "one", manifest(good, shard="2GiB", rollout=BLUE_GREEN)))
        canary = Background(lambda: supervisor.apply_manifest(
            given(tmp_path / "two", manifest(good, shard="1MiB", rollout=CANARY))))
        dep = supervisor.get("chat")
        assert dep is not None
        wait_until(lambda: (dep.status()["rollout"] or {}).get("stage") == "traffic", 120,
                   "the canary's first (300 s) step")
        if what == "apply":
            change = Background(lambda: supervisor.apply_manifest(
                given(tmp_path / "three", manifest(good, shard="512KiB", rollout=BLUE_GREEN))))
        elif what == "delete":
            change = Background(lambda: supervisor.delete("chat"))
        else:
            change = Background(lambda: supervisor.rollback("chat", to_revision=1))
        assert change.join(120), f"the {what} waited for the canary's step"
        assert canary.join(60)
        assert change.error is None, change.error
        assert canary.error is not None and "aborted at step 1 (10%)" in str(canary.error), canary.error
        history = [(r.revision, r.phase) for r in store.history("chat")]
        if what == "delete":
            assert supervisor.get("chat") is None and store.current("chat") is None
            return
        assert history == [(1, "Ready"), (2, "Failed"), (3, "Ready")], history
        current = store.current("chat")
        assert current is not None and current.revision == 3
        assert supervisor.get("chat").status()["revision"] == 3  # type: ignore[union-attr]
        if what == "rollback-to-revision":
            assert current.manifest_digest == store.get("chat", 1).manifest_digest  # type: ignore[union-attr]
    finally:
        supervisor.close()
