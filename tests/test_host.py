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


def cached(model: Path, name: str, **kwargs) -> str:
    """``text`` with the default prefix cache (sized by the planner, counted by the budget)."""
    return text(model, name, **kwargs).replace(", prefix_cache: {enabled: false}", "")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A chat model of a few MiB: large enough for a default prefix cache of whole MiB beside it."""
    return build_chat_model(tmp_path_factory.mktemp("wide") / "model", hidden=256, intermediate=1024)


def test_two_whose_weights_fit_both_load_with_their_default_caches_sized_from_what_is_left(tmp_path, wide_model):
    """The weights of two fit the budget, their default prefix caches (sized from the whole budget) do not: the
    second one's cache is sized from what the first leaves, so both load and nothing is unloaded for a cache."""
    from deploykit.control.revisions.change import Change
    from deploykit.spec.manifest import manifest_named

    (tmp_path / "probe.yaml").write_text(text(wide_model, "probe"))
    weights = Change(manifest_named(tmp_path / "probe.yaml", "probe")).plan().total_bytes
    budget = 2 * weights + (3 << 20)
    (tmp_path / "probe.yaml").write_text(cached(wide_model, "probe"))
    planned = Change(manifest_named(tmp_path / "probe.yaml", "probe"), budget_cpu=budget).plan().prefix_cache_bytes
    assert planned > 0 and 2 * (weights + planned) > budget  # as each is planned, the two do not fit together
    f = Fleet(tmp_path, wide_model, budget)
    try:
        for name in ("a", "b"):
            (tmp_path / f"{name}.yaml").write_text(cached(wide_model, name))
            f.deps[name] = Deployment.from_manifest(tmp_path / f"{name}.yaml", store=f.store, host=f.host)
        assert f.states() == {"a": "loaded", "b": "loaded"} and not f.host.unloads
        caches = {n: d.pool.current.plan.prefix_cache_bytes for n, d in f.deps.items()}
        assert caches["a"] == planned and caches["b"] < planned, caches
        for name, dep in f.deps.items():  # each engine keeps what its plan says, no more
            assert dep.pool.current.runtime.engine.prefix_cache_bytes == caches[name]
        assert f.host.used()["cpu"] == 2 * weights + caches["a"] + caches["b"] <= budget
        for dep in f.deps.values():
            assert dep.status()["phase"] == "Ready" and dep.generate("hi", max_tokens=2).text is not None
    finally:
        f.close()


def test_a_load_that_waits_for_room_says_so_in_status(fleet):
    from deploykit.control.live.status import served_status

    f = fleet(ONE, wait=30.0)
    a, b = f.add("a"), f.add("b", load="on-demand")
    held = a.pin()  # a request in flight on a: it cannot be unloaded
    done = threading.Event()
    threading.Thread(target=lambda: (b.generate("hi", max_tokens=2), done.set()), daemon=True).start()
    try:
        wait_until(lambda: f.host.describe("b").waiting is not None)
        waiting = f.host.describe("b").waiting
        assert waiting.startswith("waiting for room: needs cpu=418.8 KiB, the budget has cpu=69.5 KiB left"), waiting
        report = served_status(f.store, "b", b.state())
        assert {"type": "Loaded", "status": False, "reason": "WaitingForRoom", "message": waiting} \
            in report["conditions"]
    finally:
        a.pool.unpin(held)
    assert done.wait(60)
    assert f.host.describe("b").waiting is None
    assert not any(c["type"] == "Loaded" for c in served_status(f.store, "b", b.state())["conditions"])


def test_a_generation_still_streaming_after_a_reload_keeps_its_room(fleet):
    """After a blue-green reload the old generation stays in memory while a stream reads it: the budget counts
    it until it is freed, so another deployment's load waits for it rather than going over the budget."""
    f = fleet(TWO, wait=60.0)
    a, b = f.add("a", priority=1), f.add("b", load="on-demand")
    stream = a.pin()  # a long stream on a's first generation
    replace_like_an_editor(f.root / "a.yaml", text(f.model, "a", priority=1, max_tokens=32))
    assert a.reload() is True and a.reloads[-1].strategy == "blue-green"
    assert stream.loaded is not None and a.pool.current is not stream
    assert f.host.used() == {"cpu": 2 * 428_864}  # the new generation and the one still streaming
    done = threading.Event()
    threading.Thread(target=lambda: (b.generate("hi", max_tokens=2), done.set()), daemon=True).start()
    try:
        wait_until(lambda: f.host.describe("b").waiting is not None)  # b waits: a outranks it, its old one streams
        assert not done.is_set() and f.states() == {"a": "loaded", "b": "unloaded"}
    finally:
        a.pool.unpin(stream)  # the stream ends: the old generation is freed, and its room with it
    assert done.wait(60)
    assert stream.loaded is None and f.states() == {"a": "loaded", "b": "loaded"}
    assert f.host.used() == {"cpu": 2 * 428_864}


def test_a_stale_unload_never_unloads_the_generation_rolled_out_after_it(fleet):
    """b asks a's owner to unload a while a's change thread is busy rolling a out (to a priority b cannot
    evict): the request waits behind the rollout, and by its turn another generation is current, so it does
    nothing; b's wait ends within its own bound, naming the budget, and a's new generation keeps serving."""
    f = fleet(ONE, wait=3.0)
    a, b = f.add("a"), f.add("b", load="on-demand")
    started, release = threading.Event(), threading.Event()

    def rollout_held_up() -> bool:  # on a's change thread, like every change of a
        started.set()
        assert release.wait(60)
        replace_like_an_editor(f.root / "a.yaml", text(f.model, "a", priority=5, max_tokens=32))
        return a.reload()

    rolled = a.pool.owner(rollout_held_up)
    assert started.wait(30)
    answer: dict[str, object] = {}
    done = threading.Event()

    def ask_b() -> None:
        try:
            answer["text"] = b.generate("hi", max_tokens=2).text
        except BudgetError as exc:
            answer["error"] = exc
        finally:
            done.set()

    threading.Thread(target=ask_b, daemon=True).start()
    entry = next(e for e in f.host.entries() if e.name == "a")
    wait_until(lambda: entry.unloading)  # b asked a's owner to unload a: queued behind the held-up rollout
    release.set()
    assert rolled.result(60) is True and a.reloads[-1].strategy == "recreate"
    assert done.wait(30)
    assert "budget" in str(answer.get("error")), answer
    assert f.states() == {"a": "loaded", "b": "unloaded"} and not f.host.unloads
    assert a.pool.current.revision == 2 and a.generate("hi", max_tokens=2).text is not None


def test_a_recreate_on_a_probed_host_plans_with_the_serving_generation_given_back(fleet):
    """On this host as probed (no --devices), the serving generation's memory is not free: a model over half
    of what the probe finds (here: the probe, as it is while the model is loaded, leaves half the model free)
    is recreated on the host with its bytes given back, not refused as not fitting."""
    from dataclasses import replace

    from deploykit.control.revisions.change import Change, deployment_inventory
    from deploykit.spec.manifest import manifest_named

    f = fleet(ONE)
    dep = f.add("a")
    before = dep.generate("hi", max_tokens=4).text
    replace_like_an_editor(f.root / "a.yaml", text(f.model, "a", max_tokens=32))
    loaded = manifest_named(f.root / "a.yaml", "a")
    probed = deployment_inventory(loaded, None)
    assert not probed.simulated
    change = Change(loaded, budget_cpu=ONE, _inventory=replace(probed, cpu=428_864 // 2))
    result = dep.roll_to(loaded, change=change)
    assert result.swapped and result.strategy == "recreate"
    assert [(d.device, d.bytes) for d in dep.pool.current.plan.devices if d.bytes] == [("cpu", 428_864)]
    assert dep.generate("hi", max_tokens=4).text == before and f.host.used() == {"cpu": 428_864}


def test_a_live_adapter_change_on_a_probed_host_records_the_device_map_that_serves(tmp_path, lora):
    """A change of spec.adapters alone keeps the serving base: on this host as probed, which does not count
    the base's own memory as free, it is planned with that memory given back, so the revision records the
    device map that serves (planned against the probe alone, half the base went to disk on paper, and the
    adapters on it were refused)."""
    from dataclasses import replace

    from deploykit.control.revisions.change import Change, deployment_inventory
    from deploykit.spec.manifest import manifest_named

    def manifest(*names: str) -> str:
        return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: chat}}\nspec:\n"
                f"  model: {{path: {lora.base}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
                f"  offload: {{disk: {{path: {tmp_path / 'offload'}}}}}\n"
                f"  serving: {{prefix_cache: {{enabled: false}}}}\n  adapters:\n"
                + "".join(f"    - {{name: {n}, path: {getattr(lora, n)}}}\n" for n in names))

    path = tmp_path / "chat.yaml"
    path.write_text(manifest("pirate"))
    store = StateStore(tmp_path / "state")
    dep = Deployment.from_manifest(path, store=store, host=Host(Budget({"cpu": 4 << 20})))
    try:
        serving = dep.pool.current.plan.device_map
        assert set(serving.values()) == {"cpu"}
        replace_like_an_editor(path, manifest("pirate", "polite"))
        loaded = manifest_named(path, "chat")
        probed = deployment_inventory(loaded, None)
        assert not probed.simulated
        change = Change(loaded, budget_cpu=4 << 20, _inventory=replace(probed, cpu=428_864 // 2))
        result = dep.roll_to(loaded, change=change)
        assert result.strategy == "live" and dep.generation == 1
        assert dep.pool.current.plan.device_map == serving
        assert store.current("chat").revision == 2 and store.current("chat").plan.device_map == serving
    finally:
        dep.close()


def test_a_wait_for_room_ends_at_once_when_the_server_stops(fleet):
    """SIGTERM (``Supervisor.interrupt`` -> ``Host.interrupt``) ends a load that waits for room: the server
    stops within its drain time, not after the budget's wait (here 300 s)."""
    from deploykit.errors import DeploykitError

    f = fleet(ONE, wait=300.0)
    a, b = f.add("a"), f.add("b", load="on-demand")
    held = a.pin()  # a request in flight on a: it cannot be unloaded, so b waits
    ended: list[BaseException] = []
    done = threading.Event()

    def ask() -> None:
        try:
            b.generate("hi", max_tokens=2)
        except BaseException as exc:  # noqa: BLE001 - what the waiting call ends with
            ended.append(exc)
        done.set()

    threading.Thread(target=ask, daemon=True).start()
    try:
        wait_until(lambda: f.host.describe("b").waiting is not None)
        f.host.interrupt()
        assert done.wait(10), "the wait for room outlived the server's stop"
    finally:
        a.pool.unpin(held)
    assert ended and isinstance(ended[0], DeploykitError) and "stopping" in str(ended[0]), ended


def test_a_name_registered_again_by_another_deployment_is_asked_of_that_one(fleet):
    """A name deleted and deployed again (or pruned and taken by another file) registers a new pool: the host
    reads what is loaded from it and asks it to unload, never the old deployment's pool."""
    f = fleet(TWO)
    a = f.add("a")
    old_pool = a.pool
    f.host.register("a", old_pool, {"cpu": 1}, priority=0, keep_alive=None)
    second = f.add("a2")  # any other live pool stands for the new deployment of the name
    f.host.register("a", second.pool, {"cpu": 1}, priority=0, keep_alive=None)
    [entry] = [e for e in f.host.entries() if e.name == "a"]
    assert entry.pool is second.pool


def test_a_failing_change_of_an_unloaded_deployment_is_tried_once_and_the_last_ready_revision_serves(fleet, tmp_path):
    """A broken edit lands while an on-demand deployment is unloaded: its next request tries the change once
    (revision 2 Failed, the error in status), then revision 1 loads and answers; later requests load nothing
    new and record no more revisions."""
    from invariants.world import _nan_copy

    f = fleet(TWO, wait=60.0)
    b = f.add("b", load="on-demand")
    assert b.generate("hi", max_tokens=2).completion_tokens == 2
    assert b.pool.unload_now()
    broken = _nan_copy(f.model, tmp_path / "nan")
    replace_like_an_editor(f.root / "b.yaml", text(broken, "b", load="on-demand"))
    b.reload()
    for _ in range(3):
        assert b.generate("hi", max_tokens=2).completion_tokens == 2  # revision 1 answers every one
    assert [(r.revision, r.phase) for r in f.store.history("b")] == [(1, "Ready"), (2, "Failed")]
    status = b.status()
    assert status["serving"] and status["phase"] == "Failed" and "finite" in (status["last_error"] or ""), status


def test_a_resize_that_fails_keeps_the_serving_generation_loaded_with_what_it_held(fleet):
    """A live change of ``spec.adapters`` resizes the serving generation in its room (``resize``): it stays
    loaded while it runs, and a failure leaves it loaded with the bytes it held, not unloaded."""
    f = fleet(ONE)
    f.add("a")
    held = f.host.used()
    with pytest.raises(RuntimeError, match="the adapter failed"):
        with f.host.room("a", {"cpu": held["cpu"] + 1000}, reason="rollout", resize=True):
            assert f.states() == {"a": "loaded"} and f.host.used() == {"cpu": held["cpu"] + 1000}
            raise RuntimeError("the adapter failed")
    assert f.states() == {"a": "loaded"} and f.host.used() == held
    with f.host.room("a", {"cpu": held["cpu"] + 1000}, reason="rollout", resize=True):
        pass
    assert f.states() == {"a": "loaded"} and f.host.used() == {"cpu": held["cpu"] + 1000}
