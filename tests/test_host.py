"""The host budget in process: real Deployments of a tiny real chat model under one ``Host``, real threads.

Each deployment's plan is 428,864 bytes: ``ONE`` holds one of them, ``TWO`` two.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from chatmodel import build_chat_model
from deploykit.control.budget import Budget, BudgetError
from deploykit.control.live.deployment import Deployment
from deploykit.control.budget.host import Host
from deploykit.control.revisions.state import StateStore
from deploykit.errors import DeploykitError
from manifests import replace_like_an_editor

ONE, TWO = 500_000, 900_000


def text(model: Path, name: str, *, strategy: str = "auto", priority: int = 0, max_tokens: int = 64,
         load: str = "eager", keep_alive: str = "forever") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  rollout: {{strategy: {strategy}}}\n"  # budgets of a few hundred KB: no room for a prefix cache
            f"  serving: {{max_tokens: {max_tokens}, prefix_cache: {{enabled: false}}}}\n"
            f"  lifecycle: {{load: {load}, priority: {priority}, keep_alive: {keep_alive}}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


class Fleet:
    def __init__(self, root: Path, model: Path, budget: int, *, wait: float = 30.0) -> None:
        self.root, self.model = root, model
        self.store = StateStore(root / "state")
        self.host = Host(Budget({"cpu": budget}), wait_timeout=wait)
        self.deps: dict[str, Deployment] = {}

    def add(self, name: str, **kwargs) -> Deployment:
        path = self.root / f"{name}.yaml"
        path.write_text(text(self.model, name, **kwargs))
        self.deps[name] = Deployment.from_manifest(path, store=self.store, host=self.host)
        return self.deps[name]

    def states(self) -> dict[str, str | None]:
        return {n: self.host.state(n) for n in self.deps}

    def close(self) -> None:
        for dep in self.deps.values():
            dep.close()


@pytest.fixture
def fleet(tmp_path, chat_model):
    fleets: list[Fleet] = []

    def make(budget: int, **kwargs) -> Fleet:
        fleets.append(Fleet(tmp_path, chat_model, budget, **kwargs))
        return fleets[-1]

    yield make
    for f in fleets:
        f.close()


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_pinned_generation_is_never_unloaded_for_another(fleet):
    f = fleet(ONE)
    a, b = f.add("a"), f.add("b", load="on-demand")
    held = a.pin()  # a request in flight on a
    done = threading.Event()
    answer: dict[str, object] = {}

    def ask_b() -> None:
        answer["text"] = b.generate("hi", max_tokens=2).text
        done.set()

    threading.Thread(target=ask_b, daemon=True).start()
    wait_until(lambda: f.host.describe("b").busy == 1)  # b's request waits for room
    assert f.states() == {"a": "loaded", "b": "unloaded"} and held.loaded is not None
    assert not done.is_set()
    a.pool.unpin(held)  # a's request ends: now a is idle, and b's request may have its room
    assert done.wait(60) and isinstance(answer["text"], str)
    assert f.states() == {"a": "unloaded", "b": "loaded"}
    assert f.host.unloads[("a", "pressure")] == 1 and f.host.loads[("b", "request")] == 1
    assert f.host.used() == {"cpu": 428_864}
    assert a.generate("hi", max_tokens=2).text is not None  # a comes back, b (idle) makes room
    assert f.states() == {"a": "loaded", "b": "unloaded"}


def test_an_unload_runs_on_the_owners_change_thread(fleet, caplog):
    """What a deployment has loaded changes on its own change thread only: an unload for another's room or
    for keep-alive is asked of its owner, which does it there (never on the thread that needs the room,
    nor on the keep-alive thread)."""
    caplog.set_level(logging.INFO, logger="deploykit.control.budget.host")
    f = fleet(ONE)
    f.add("a")
    b = f.add("b", load="on-demand", keep_alive="0.3s")
    assert b.generate("hi", max_tokens=2).text is not None  # a is idle: unloaded to make b's room
    wait_until(lambda: f.host.unload_expired() == ["b"])  # then b is idle past its keep-alive
    assert f.states() == {"a": "unloaded", "b": "unloaded"}
    unloads = [(r.getMessage(), r.threadName) for r in caplog.records if r.getMessage().startswith("unloaded")]
    assert unloads == [("unloaded a (making room under the budget)", "deploykit-change-a"),
                       ("unloaded b (idle past its keep-alive)", "deploykit-change-b")]


def test_the_wait_for_room_is_bounded_and_names_the_budget(fleet):
    f = fleet(ONE, wait=0.5)
    f.add("vip", priority=2)
    guest = f.add("guest", load="on-demand", priority=1)
    with pytest.raises(BudgetError, match=r"no room for 'guest' after waiting 0.5s: .*budget \(cpu=488.3 KiB"):
        guest.generate("hi", max_tokens=2)
    assert f.states() == {"vip": "loaded", "guest": "unloaded"}


@pytest.mark.parametrize("budget,expected", [(TWO, "blue-green"), (ONE, "recreate")])
def test_auto_rolls_out_blue_green_only_when_the_budget_holds_both(fleet, budget, expected):
    f = fleet(budget)
    dep = f.add("chat")
    before = dep.generate("hi", max_tokens=4).text
    replace_like_an_editor(f.root / "chat.yaml", text(f.model, "chat", max_tokens=32))
    assert dep.reload() is True
    assert dep.reloads[-1].strategy == expected
    assert dep.generate("hi", max_tokens=4).text == before
    assert f.host.used() == {"cpu": 428_864}  # one generation again


def test_auto_unloads_an_idle_lower_priority_deployment_for_blue_green(fleet):
    f = fleet(TWO)
    f.add("spare", priority=0)
    dep = f.add("chat", priority=1)
    replace_like_an_editor(f.root / "chat.yaml", text(f.model, "chat", priority=1, max_tokens=32))
    assert dep.reload() is True and dep.reloads[-1].strategy == "blue-green"
    assert f.states() == {"spare": "unloaded", "chat": "loaded"}
    assert f.host.unloads[("spare", "pressure")] == 1


def test_blue_green_without_room_fails_naming_the_budget_and_the_old_one_serves(fleet):
    f = fleet(ONE, wait=0.3)
    dep = f.add("chat", strategy="blue-green")
    replace_like_an_editor(f.root / "chat.yaml", text(f.model, "chat", strategy="blue-green", max_tokens=32))
    assert dep.reload() is False
    status = dep.status()
    assert "budget" in status["last_error"] and status["serving"] and dep.generation == 1
    assert status["phase"] == "Failed"  # the latest change failed; the last good generation serves
    assert dep.generate("hi", max_tokens=2).text is not None


def test_unload_gives_memory_back(tmp_path):
    """A model of ~100 MiB: unloading it lowers the process's RSS by most of its size (the leak guard holds)."""
    from deploykit.placement.inventory import process_rss
    from transformers import AutoModelForCausalLM, LlamaConfig

    big = tmp_path / "big"
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=32000)
    AutoModelForCausalLM.from_config(config).save_pretrained(big)
    f = Fleet(tmp_path, big, 1 << 30)
    try:
        dep = f.add("big", keep_alive="0.3s")
        size = f.host.used()["cpu"]
        with dep.acquire():
            pass
        loaded = process_rss()
        wait_until(lambda: f.host.unload_expired() == ["big"])  # idle past its keep-alive
        freed = process_rss()
        assert f.host.used() == {"cpu": 0} and f.host.unloads[("big", "idle")] == 1
        assert loaded - freed > 0.7 * size, (loaded >> 20, freed >> 20, size >> 20)
        with dep.acquire():  # and it loads again on the next use
            pass
    finally:
        f.close()


def test_a_change_to_an_unloaded_deployment_is_applied_by_its_next_request(fleet):
    f = fleet(ONE)
    a, b = f.add("a"), f.add("b", load="on-demand")
    b.generate("hi", max_tokens=2)  # a (idle) makes room
    assert f.states() == {"a": "unloaded", "b": "loaded"}
    replace_like_an_editor(f.root / "a.yaml", text(f.model, "a", max_tokens=32))
    assert a.reload() is False and a.status()["last_error"] is None
    assert f.host.used() == {"cpu": 428_864} and f.store.current("a").revision == 1  # nothing taken yet
    assert a.generate("hi", max_tokens=2).text is not None
    assert f.store.current("a").revision == 2 and f.states() == {"a": "loaded", "b": "unloaded"}
    assert a.pool.current.runtime.limits.max_tokens == 32


def test_a_failed_load_on_demand_is_reported_and_retried(fleet, chat_model):
    import shutil
    import struct

    f = fleet(TWO)
    broken = Path(shutil.copytree(chat_model, f.root / "broken"))
    weights = broken / "model.safetensors"
    good = weights.read_bytes()
    start = 8 + struct.unpack("<Q", good[:8])[0]
    weights.write_bytes(good[:start] + b"\xff" * (len(good) - start))  # every float NaN: the check fails
    f.model = broken
    dep = f.add("late", load="on-demand")
    assert dep.status()["last_error"] is None and f.states() == {"late": "unloaded"}
    with pytest.raises(DeploykitError, match="not finite"):
        dep.generate("hi", max_tokens=2)
    assert "not finite" in dep.status()["last_error"]
    assert f.states() == {"late": "unloaded"} and f.host.used() == {"cpu": 0}
    weights.write_bytes(good)
    assert dep.generate("hi", max_tokens=2).text is not None  # the next request tries again
    assert dep.status()["last_error"] is None and f.states() == {"late": "loaded"}


def test_a_rollout_to_a_plan_over_the_budget_is_refused_and_the_old_one_serves(fleet, tiny_model):
    f = fleet(ONE)
    dep = f.add("chat")
    replace_like_an_editor(f.root / "chat.yaml", text(tiny_model("llama"), "chat"))  # about 690 KiB alone
    assert dep.reload() is False
    assert "can never be loaded" in dep.status()["last_error"] and "budget" in dep.status()["last_error"]
    assert dep.generation == 1 and dep.generate("hi", max_tokens=2).text is not None
    assert f.store.current("chat").revision == 1


class Collections:
    """Whether the model and one of its weights were still alive at each full garbage collection (the
    ``gc.collect()`` a free runs just before ``torch.cuda.empty_cache()``): a tensor that dies after it
    goes into CUDA's caching allocator and is never handed back to the device."""

    def __init__(self, dep: Deployment) -> None:
        import weakref

        loaded = dep.pool.current.loaded
        self.refs = [weakref.ref(loaded.model), weakref.ref(next(loaded.model.parameters()))]
        self.seen: list[bool] = []

    def __enter__(self) -> Collections:
        import gc

        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            self.seen.append(any(ref() is not None for ref in self.refs))

    def dead_at_the_free(self) -> None:
        assert self.seen, "the free ran no full garbage collection"
        assert not self.seen[-1], "the model was still referenced when its memory was given back"
        assert all(ref() is None for ref in self.refs)


@pytest.mark.parametrize("how", ["keep-alive", "eviction", "blue-green", "recreate", "close"])
def test_the_model_is_unreferenced_when_its_memory_is_given_back(fleet, how):
    f = fleet(ONE if how in ("eviction", "recreate") else TWO)
    dep = f.add("a", keep_alive="0.3s" if how == "keep-alive" else "forever")
    other = f.add("b", load="on-demand") if how == "eviction" else None
    assert dep.generate("hi", max_tokens=2).text is not None  # a request ran: engine, caches, frames used
    with Collections(dep) as collections:
        if how == "keep-alive":
            wait_until(lambda: f.host.unload_expired() == ["a"])
        elif how == "eviction":
            assert other is not None and other.generate("hi", max_tokens=2).text is not None
            assert f.host.unloads[("a", "pressure")] == 1
        elif how == "close":
            dep.close()
        else:
            replace_like_an_editor(f.root / "a.yaml", text(f.model, "a", max_tokens=32))
            assert dep.reload() is True and dep.reloads[-1].strategy == how
        collections.dead_at_the_free()


def test_a_blue_green_rollout_reserves_the_plan_it_loads_beside_the_serving_one(tmp_path, chat_model):
    """On a simulated host of cpu=700KB, the new generation planned beside the serving one (428,864 bytes)
    puts one block in RAM (214,272 bytes) and offloads the rest to disk: that is what the budget reserves,
    and it fits beside the serving one (643,136 <= 700,000), where the full plan (857,728) would not."""
    def manifest(max_tokens: int) -> str:
        return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
                f"  model: {{path: {chat_model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
                f"  offload: {{disk: {{path: {tmp_path / 'offload'}}}}}\n"
                f"  rollout: {{strategy: blue-green}}\n  serving: {{max_tokens: {max_tokens}}}\n")

    path = tmp_path / "chat.yaml"
    path.write_text(manifest(64))
    host = Host(Budget({"cpu": 700_000}), wait_timeout=1.0)
    dep = Deployment.from_manifest(path, store=StateStore(tmp_path / "state"), host=host, devices="cpu=700KB")
    try:
        before = dep.generate("hi", max_tokens=4).text
        assert host.used() == {"cpu": 428_864}
        replace_like_an_editor(path, manifest(32))
        assert dep.reload() is True, dep.status()["last_error"]
        assert dep.reloads[-1].strategy == "blue-green"
        assert host.used() == {"cpu": 214_272}  # the plan it loaded beside, now the one it holds
        assert dep.generate("hi", max_tokens=4).text == before
    finally:
        dep.close()


def test_an_engine_that_fails_to_close_still_releases_its_model(fleet, caplog):
    """Freeing a generation whose engine raises on close logs it and drops the model all the same: the
    deployment unloads, its memory goes back, and the next request loads it again (it was left "freeing",
    model held, for good)."""
    f = fleet(ONE)
    dep = f.add("a", keep_alive="0.3s")
    assert dep.generate("hi", max_tokens=2).text is not None
    gen = dep.pool.current
    assert gen is not None and gen.runtime is not None

    import weakref

    runtime = weakref.ref(gen.runtime)  # the test must not keep the model alive itself

    def close() -> None:  # the engine stops, then something of its close fails
        held = runtime()
        type(held).close(held)
        del held
        raise RuntimeError("the engine would not stop cleanly")

    gen.runtime.close = close  # deploykit's own object: what any engine's close may raise
    with Collections(dep) as collections:
        wait_until(lambda: f.host.unload_expired() == ["a"])
        collections.dead_at_the_free()
    assert gen.loaded is None and gen.runtime is None and not gen.freeing
    assert any("closing generation" in r.getMessage() and "would not stop cleanly" in str(r.exc_info[1])
               for r in caplog.records if r.exc_info)
    assert f.states() == {"a": "unloaded"}
    assert dep.generate("hi", max_tokens=2).text is not None  # loaded again on demand
