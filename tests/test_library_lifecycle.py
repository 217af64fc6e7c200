"""``lifecycle`` without a host budget: a library ``Deployment`` (no ``host=``) loads, rolls out and unloads
through an unlimited host, so ``load: on-demand`` and ``keep_alive`` mean what they say there too. Real
Deployments of a tiny real chat model, real threads."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from chatmodel import build_chat_model
from deploykit.control.live.deployment import Deployment
from deploykit.control.live.supervisor import Supervisor
from deploykit.control.revisions.state import StateStore
from deploykit.errors import ApplyError
from deploykit.spec.manifest import load_manifests
from helpers import wait_until
from manifests import replace_like_an_editor


def text(model: Path, *, load: str = "eager", keep_alive: str = "forever", max_tokens: int = 64,
         strategy: str = "auto") -> str:
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: chat}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  rollout: {{strategy: {strategy}}}\n"
            f"  serving: {{max_tokens: {max_tokens}, prefix_cache: {{enabled: false}}}}\n"
            f"  lifecycle: {{load: {load}, keep_alive: {keep_alive}}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture
def deploy(tmp_path, chat_model):
    deps: list[Deployment] = []

    def make(**kwargs) -> Deployment:
        path = tmp_path / "chat.yaml"
        path.write_text(text(chat_model, **kwargs))
        deps.append(Deployment.from_manifest(path, store=StateStore(tmp_path / "state")))
        return deps[-1]

    yield make
    for dep in deps:
        dep.close()


def test_an_on_demand_deployment_without_a_budget_stays_unloaded_until_its_first_request(deploy):
    dep = deploy(load="on-demand")
    status = dep.status()
    assert dep.pool.current is None and status["loaded"] == "unloaded"
    assert status["serving"] is True and status["last_error"] is None  # it serves: at its first request
    assert status["budget"] is None  # no budget was set: none is shown
    assert dep.generate("hi", max_tokens=2).text is not None  # the first request loads it (generate pins)
    assert dep.pool.current is not None and dep.status()["loaded"] == "loaded"
    gen = dep.pin()
    try:
        assert gen is dep.pool.current
    finally:
        dep.unpin(gen)


def keep_alive_threads() -> int:
    return sum(t.name == "deploykit-keep-alive" and t.is_alive() for t in threading.enumerate())


def test_keep_alive_without_a_budget_unloads_when_idle_and_the_next_request_loads_it_again(deploy):
    before = keep_alive_threads()
    dep = deploy(keep_alive="1s")
    assert dep.status()["loaded"] == "loaded"  # eager: loaded at start
    first = dep.pool.current
    assert dep.generate("hi", max_tokens=2).text is not None
    wait_until(lambda: dep.status()["loaded"] == "unloaded", what="the idle deployment unloaded after its keep-alive")
    assert dep.pool.current is None and dep.status()["serving"] is True
    assert dep.generate("hi", max_tokens=2).text is not None  # loaded again for this request
    assert dep.pool.current is not None and dep.pool.current is not first
    assert dep.status()["last_error"] is None
    assert keep_alive_threads() == before + 1  # its own host's
    dep.close()
    assert keep_alive_threads() == before  # joined by close


def test_a_change_of_an_unloaded_on_demand_deployment_is_applied_by_its_next_request(deploy, tmp_path, chat_model):
    dep = deploy(load="on-demand")
    replace_like_an_editor(tmp_path / "chat.yaml", text(chat_model, load="on-demand", max_tokens=32))
    assert dep.reload() is False and dep.status()["last_error"] is None
    assert dep.pool.current is None  # nothing loaded for the change: its next request applies it
    assert dep.generate("hi", max_tokens=2).text is not None
    assert dep.pool.current.runtime.limits.max_tokens == 32


@pytest.mark.parametrize("strategy,expected", [("auto", "blue-green"), ("blue-green", "blue-green"),
                                               ("recreate", "recreate")])
def test_a_reload_without_a_budget_rolls_out_as_its_strategy_says(deploy, tmp_path, chat_model, strategy, expected):
    dep = deploy(strategy=strategy)
    replace_like_an_editor(tmp_path / "chat.yaml", text(chat_model, strategy=strategy, max_tokens=32))
    assert dep.reload() is True
    assert dep.reloads[-1].strategy == expected and dep.generation == 2
    assert dep.reload() is False and dep.generation == 2  # nothing changed: a no-op


def test_a_supervisor_without_a_budget_loads_on_demand_and_shows_no_budget(tmp_path, chat_model):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "chat.yaml").write_text(text(chat_model, load="on-demand"))
    supervisor = Supervisor(tmp_path / "m", store=StateStore(tmp_path / "state"))
    try:
        supervisor.start()
        assert not supervisor.host.limited
        [status] = supervisor.statuses()
        assert (status["loaded"], status["budget"], status["serving"]) == ("unloaded", None, True)
        dep = supervisor.get("chat")
        assert dep.pool.current is None
        assert dep.generate("hi", max_tokens=2).text is not None
        [status] = supervisor.statuses()
        assert (status["loaded"], status["budget"], status["phase"]) == ("loaded", None, "Ready")
    finally:
        supervisor.close()


def test_a_pin_during_a_recreate_without_a_budget_says_a_recreate_reloads_it(deploy, tmp_path, chat_model):
    """A recreate holds no generation while its new one loads: a ``pin`` that times out then says so (as
    it did before every deployment had a host), not that the deployment is still loading."""
    dep = deploy(strategy="recreate")
    (tmp_path / "chat.yaml").write_text(text(chat_model, strategy="recreate", max_tokens=32))
    [loaded] = load_manifests(tmp_path / "chat.yaml")
    loading, release = threading.Event(), threading.Event()

    def on_step(step: str) -> None:
        if step == "load":  # drained: the old generation is gone, the new one not in yet
            loading.set()
            release.wait(30)

    results: list[str] = []
    roll = threading.Thread(target=lambda: results.append(dep.roll_to(loaded, on_step=on_step).strategy))
    roll.start()
    try:
        assert loading.wait(30), "the recreate reached its load"
        assert dep.pool.current is None
        with pytest.raises(ApplyError, match=r"has no model ready after 0\.2s \(a recreate rollout is "
                                             r"reloading it\)"):
            dep.pin(timeout=0.2)
    finally:
        release.set()
        roll.join(30)
    assert results == ["recreate"] and dep.generation == 2


def test_a_closed_deployment_without_a_budget_shows_nothing_loaded(deploy):
    dep = deploy()
    assert dep.status()["loaded"] == "loaded"
    dep.close()
    status = dep.status()
    assert (status["phase"], status["serving"], status["loaded"]) == ("Closed", False, "unloaded")
    assert dep.pool.current is None


def test_keep_alive_without_a_budget_shows_in_the_model_metrics_but_no_budget(tmp_path, chat_model):
    """Without a budget a keep-alive still unloads: ``/metrics`` counts it (``deploykit_model_*``) as under
    one, and shows no ``deploykit_budget_*``, which only a budget has."""
    from fastapi.testclient import TestClient

    from deploykit.serve.app import create_app

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "chat.yaml").write_text(text(chat_model, keep_alive="1s"))
    supervisor = Supervisor(tmp_path / "m", store=StateStore(tmp_path / "state"))
    try:
        supervisor.start()
        dep = supervisor.get("chat")
        wait_until(lambda: dep.status()["loaded"] == "unloaded", what="the idle deployment unloaded")
        metrics = TestClient(create_app(supervisor)).get("/metrics").text
        assert 'deploykit_model_unloads_total{model="chat",reason="idle"} 1.0' in metrics
        assert 'deploykit_model_loaded{model="chat"} 0.0' in metrics
        assert "deploykit_budget_" not in metrics
    finally:
        supervisor.close()


class HeldAtPlan(StateStore):
    """Holds the change thread where revision 2's plan is recorded (``held``) until ``release``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.held, self.release = threading.Event(), threading.Event()

    def set_plan(self, name, revision, **kwargs):  # type: ignore[no-untyped-def]
        if revision == 2:
            self.held.set()
            self.release.wait(30)
        return super().set_plan(name, revision, **kwargs)


def test_a_live_adapter_change_without_a_budget_shows_the_deployment_loaded_throughout(lora, tmp_path):
    """``spec.adapters`` alone changes on the serving generation: it stays loaded and serving while the
    change runs (status, and ``/v1/models``' ``loaded``), not "loading" as if it had no model."""
    from fastapi.testclient import TestClient

    from deploykit.serve.app import Deployments, create_app
    from lora import adapters_manifest

    path = tmp_path / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate}))
    store = HeldAtPlan(tmp_path / "state")
    dep = Deployment.from_manifest(path, store=store)
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite}))
    [loaded] = load_manifests(path)
    results: list[str] = []
    roll = threading.Thread(target=lambda: results.append(dep.roll_to(loaded).strategy))
    roll.start()
    try:
        assert store.held.wait(30), "the live change reached its plan"
        assert (dep.status()["loaded"], dep.status()["serving"]) == ("loaded", True)
        card = TestClient(create_app(Deployments([dep]))).get("/v1/models/chat").json()
        assert (card["loaded"], card["state"]) == (True, "loaded")
    finally:
        store.release.set()
        roll.join(30)
        dep.close()
    assert results == ["live"]


def test_a_failed_change_leaves_the_serving_revisions_keep_alive(deploy, tmp_path, chat_model):
    """A change that fails (its health check: NaN weights) while asking for ``keep_alive: 1s`` leaves the
    serving revision's lifecycle as it was (forever): what serves is not unloaded for the failed change."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(chat_model, tmp_path / "nan-model"))
    weights = load_file(broken / "model.safetensors")
    weights["model.norm.weight"][:] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    dep = deploy(strategy="blue-green")
    replace_like_an_editor(tmp_path / "chat.yaml", text(broken, strategy="blue-green", keep_alive="0.1s"))
    assert dep.reload() is False and "not finite" in dep.status()["last_error"]
    assert dep.host.describe("chat").keep_alive is None  # forever, as the serving revision says
    assert dep.host.unload_expired() == [] and dep.status()["loaded"] == "loaded"


def test_a_forced_change_of_an_unloaded_deployment_is_applied_forced_by_its_next_request(deploy, tmp_path):
    """``force`` (lay out again, a new revision even of an unchanged manifest) is kept with the change an
    unloaded deployment defers: its next request applies it forced, as the caller was told (``deferred``)."""
    dep = deploy(load="on-demand", keep_alive="1s")
    assert dep.generate("hi", max_tokens=2).text is not None  # revision 1, loaded
    wait_until(lambda: dep.status()["loaded"] == "unloaded", what="the idle deployment unloaded")
    [loaded] = load_manifests(tmp_path / "chat.yaml")  # the same manifest, forced
    result = dep.roll_to(loaded, force=True)
    assert result.outcome.status == "deferred" and dep.pending is not None
    assert dep.generate("hi", max_tokens=2).text is not None  # the forced apply, at its first request
    assert [r.revision for r in dep.store.history("chat")] == [1, 2]
    assert dep.store.current("chat").revision == 2 and dep.pending is None
