"""One snapshot of a deployment answers every view: the library's ``status()``, ``/status``, ``/readyz``,
``/v1/models`` and the metrics never disagree about what serves, its phase, or which revision the serving
generation is. Real Deployments of tiny real models, the real ASGI app (``create_app``), a real supervisor
following a real directory.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from chatmodel import build_chat_model
from helpers import wait_until
from deploykit.control.budget import Budget
from deploykit.control.budget.host import Host
from deploykit.control.live.deployment import Deployment
from deploykit.control.live.status import served_status
from deploykit.control.revisions.state import StateStore
from deploykit.serve.app import Deployments, create_app
from deploykit.spec.manifest import load_manifests
from manifests import manifest_text, write_manifest
from test_supervisor_faults import watched  # noqa: F401  (a fixture)


def on_demand(model: Path, name: str) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: 8, prefix_cache: {{enabled: false}}}}\n"
            f"  lifecycle: {{load: on-demand, keep_alive: forever}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


def test_an_on_demand_deployment_is_ready_in_every_view(tmp_path, chat_model):
    """Unloaded, it serves (its next request loads it): the library, /readyz, /status, the conditions and
    /v1/models all say so, before and after a request loads it."""
    (tmp_path / "lazy.yaml").write_text(on_demand(chat_model, "lazy"))
    store = StateStore(tmp_path / "state")
    host = Host(Budget({"cpu": 64 << 20}))
    dep = Deployment.from_manifest(tmp_path / "lazy.yaml", store=store, host=host)
    try:
        client = TestClient(create_app(Deployments([dep])))
        for loaded in ("unloaded", "loaded"):
            snap = dep.state()
            assert snap.serving and snap.phase.value == "Ready" and snap.loaded == loaded
            assert client.get("/readyz").status_code == 200  # as a supervisor says (not "not ready")
            [status] = client.get("/status").json()
            assert status["phase"] == "Ready" and status["serving"] and status["loaded"] == loaded
            report = served_status(store, "lazy", dep.state())
            ready = next(c for c in report["conditions"] if c["type"] == "Ready")
            assert report["phase"] == "Ready" and ready["status"] is True, report
            [card] = client.get("/v1/models").json()["data"]
            assert card["state"] == loaded and card["loaded"] == (loaded == "loaded")
            answer = client.post("/v1/completions", json={"model": "lazy", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        assert report["revision"] == 1 and ready["reason"] == "Revision1Ready"
    finally:
        dep.close()


def test_a_conflict_shows_in_the_phase_and_the_conditions_alike(model, tmp_path, watched):
    directory, supervisor = watched
    supervisor.start()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    [given] = load_manifests(write_manifest(elsewhere, model))
    supervisor.apply_manifest(given)  # the control API owns "tiny"
    file = write_manifest(directory, model, shard="300KiB")  # then a watched file declares it too
    dep = supervisor.get("tiny")
    assert dep is not None
    wait_until(lambda: str(file) in (dep.status()["last_error"] or ""), what="the conflict to show")
    [report] = supervisor.statuses()
    failed = next(c for c in report["conditions"] if c["type"] == "Failed")
    ready = next(c for c in report["conditions"] if c["type"] == "Ready")
    assert report["phase"] == "Failed" and failed["status"] is True and failed["reason"] == "OwnershipConflict"
    assert str(file) in failed["message"] and failed["message"] == report["last_error"]
    assert ready["status"] is True and report["serving"]  # what the API deployed still serves
    assert supervisor.ready() == (True, [])  # and /readyz agrees: it can serve


def test_status_read_through_reloads_pairs_each_generation_with_one_revision(model, tmp_path):
    """Polled as hard as it goes while the deployment reloads: every answer is whole (no exception), and
    a generation is always shown with the revision it serves."""
    path = write_manifest(tmp_path, model)
    dep = Deployment.from_manifest(path, store=StateStore(tmp_path / "state"))
    seen: set[tuple[int, int | None, bool]] = set()
    errors: list[BaseException] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                snap = dep.state()
                seen.add((snap.generation, snap.revision, snap.serving))
                served_status(dep.store, "tiny", snap)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

    pollers = [threading.Thread(target=poll) for _ in range(2)]
    for t in pollers:
        t.start()
    try:
        for shard in ("300KiB", "400KiB", "500KiB"):
            path.write_text(manifest_text(model, shard=shard))
            assert dep.reload()
    finally:
        done.set()
        for t in pollers:
            t.join()
        dep.close()
    assert not errors, errors[:3]
    revision_of: dict[int, set[int | None]] = {}
    for generation, revision, serving in seen:
        if serving:
            revision_of.setdefault(generation, set()).add(revision)
    assert revision_of == {1: {1}, 2: {2}, 3: {3}, 4: {4}}, revision_of
