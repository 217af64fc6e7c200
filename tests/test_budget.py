"""Many models on one host: a real `deploykit serve --budget` with tiny real chat models, through the
official `openai` client. Each tiny model's plan is 428,864 bytes (float32; no prefix cache), so ``cpu=900KB``
holds two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from chatmodel import build_chat_model
from servers import Server, get

SIZE = 428_864  # bytes of one tiny chat model's plan
TWO = "cpu=900KB"  # room for two of them, not three


def manifest(model: Path, name: str, *, load: str = "on-demand", priority: int = 0, keep_alive: str = "forever",
             max_tokens: int = 64) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: {max_tokens}, default_max_tokens: 4, prefix_cache: {{enabled: false}}}}\n"
            f"  lifecycle: {{load: {load}, priority: {priority}, keep_alive: {keep_alive}}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


def served(tmp_path: Path, model: Path, specs: dict[str, dict], *args: str, env: dict[str, str] | None = None) -> Server:
    (tmp_path / "m").mkdir()
    for name, kwargs in specs.items():
        (tmp_path / "m" / f"{name}.yaml").write_text(manifest(model, name, **kwargs))
    return Server(tmp_path / "m", tmp_path / "state", *args, env=env)


def states(server: Server) -> dict[str, str]:
    return {m["id"]: m["state"] for m in get(f"{server.url}/v1/models")[1]["data"]}


def complete(client: openai.OpenAI, name: str, max_tokens: int = 4) -> str:
    return client.completions.create(model=name, prompt="hi", max_tokens=max_tokens).choices[0].finish_reason


def wait_for(predicate, timeout: float = 30.0, what: str = "") -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Sampler:
    """Samples the budget's use from /metrics on a thread, for the whole test."""

    def __init__(self, server: Server) -> None:
        self.server, self.samples, self._stop = server, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.server.metric("deploykit_budget_used_bytes", tier="cpu"))

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_on_demand_loads_and_evicts_by_priority_then_recency_within_budget(tmp_path, chat_model):
    specs = {"low": {}, "mid": {}, "high": {"priority": 1}}
    with served(tmp_path, chat_model, specs, "--budget", TWO) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert states(server) == {"low": "unloaded", "mid": "unloaded", "high": "unloaded"}
        assert get(f"{server.url}/readyz")[0] == 200  # unloaded on-demand models are not "not ready"
        assert server.metric("deploykit_budget_bytes", tier="cpu") == 900_000
        with Sampler(server) as sampler:
            assert complete(client, "low") and complete(client, "mid")  # they fit side by side: no unload
            assert states(server) == {"low": "loaded", "mid": "loaded", "high": "unloaded"}
            assert server.metric("deploykit_model_unloads_total") == 0
            complete(client, "high")  # low and mid have priority 0: low was used least recently
            assert states(server) == {"low": "unloaded", "mid": "loaded", "high": "loaded"}
            complete(client, "low")  # high (priority 1) outranks low: mid goes although used after high
            assert states(server) == {"low": "loaded", "mid": "unloaded", "high": "loaded"}
            complete(client, "mid")
            assert states(server) == {"low": "unloaded", "mid": "loaded", "high": "loaded"}
        assert sampler.samples and max(sampler.samples) <= 900_000, max(sampler.samples)
        assert max(sampler.samples) == 2 * SIZE
        assert server.metric("deploykit_model_unloads_total", model="low", reason="pressure") == 2
        assert server.metric("deploykit_model_unloads_total", model="mid", reason="pressure") == 1
        assert server.metric("deploykit_model_loads_total", model="low", reason="request") == 2
        assert server.metric("deploykit_model_loaded", model="high") == 1
        assert server.metric("deploykit_model_loaded", model="low") == 0
        assert server.metric("deploykit_model_load_seconds_count") == 5
        status = {s["name"]: s for s in get(f"{server.url}/status")[1]}
        assert status["mid"]["loaded"] == "loaded" and status["mid"]["budget"]["bytes"] == SIZE
        shown = cli("status", state=tmp_path / "state").stdout  # through the server it found
        assert "memory: loaded, 418.8 KiB, priority 1; last used" in shown and "keep-alive forever" in shown
        assert "memory: unloaded, 418.8 KiB, priority 0" in shown


def cli(*args: str, state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=300)


def test_plan_a_directory_against_a_budget(tmp_path, chat_model, tiny_model):
    (tmp_path / "m").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "m" / f"{name}.yaml").write_text(manifest(chat_model, name, load="eager" if name == "a" else "on-demand"))
    (tmp_path / "m" / "big.yaml").write_text(manifest(tiny_model("llama"), "big", priority=3))
    # the 4-layer tiny Llama's plan (about 690 KiB) exceeds cpu=700KB (683.6 KiB) alone; one chat model fits
    shown = cli("plan", str(tmp_path / "m"), "--budget", "cpu=700KB", "--devices", "cpu=8GiB", state=tmp_path / "state")
    assert shown.returncode == 0, shown.stderr
    assert "can never load (alone over the budget): big" in shown.stdout
    assert "most held at once: 1 (a)" in shown.stdout and "all at once (cpu 1.2 MiB): do not fit" in shown.stdout
    data = json.loads(cli("plan", str(tmp_path / "m"), "--budget", TWO, "--devices", "cpu=8GiB", "-o", "json",
                          state=tmp_path / "state").stdout)
    assert data["budget"] == {"cpu": 900_000}
    assert {d["name"]: d["bytes"]["cpu"] for d in data["deployments"]}["a"] == SIZE
    assert data["packing"]["most_at_once"] == ["a", "b"] and data["packing"]["eager_fit"] is True
    assert data["packing"]["never"] == []


def test_keep_alive_unloads_after_the_last_request_ends(tmp_path, chat_model):
    with served(tmp_path, chat_model, {"brief": {"load": "eager", "keep_alive": "1s"}, "stays": {"load": "eager"}},
                "--budget", "cpu=2MB") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert states(server) == {"brief": "loaded", "stays": "loaded"}  # eager: loaded at start
        wait_for(lambda: states(server)["brief"] == "unloaded", what="the keep-alive unload")
        complete(client, "brief", max_tokens=32)
        ended = time.monotonic()
        assert states(server)["brief"] == "loaded"
        unloaded = wait_for(lambda: states(server)["brief"] == "unloaded", what="the keep-alive unload")
        assert 1.0 <= unloaded - ended <= 4.0  # counted from the end of the request, acted on within seconds
        assert server.metric("deploykit_model_unloads_total", model="brief", reason="idle") == 2
        assert states(server)["stays"] == "loaded"  # forever
        assert complete(client, "brief")  # and it comes back on the next request


def test_no_room_waits_then_503_with_retry_after_naming_the_budget(tmp_path, chat_model):
    specs = {"vip": {"load": "eager", "priority": 5}, "guest": {"priority": 0}}
    with served(tmp_path, chat_model, specs, "--budget-timeout", "1.5", env={"DEPLOYKIT_BUDGET": "cpu=500KB"}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            complete(client, "guest")
        assert time.monotonic() - started >= 1.5
        error = info.value
        assert error.status_code == 503 and error.response.headers["retry-after"] == "10"
        body = error.response.json()["error"]
        assert body["param"] == "model" and body["code"] == "budget_exhausted"
        assert "budget (cpu=488.3 KiB; from DEPLOYKIT_BUDGET)" in body["message"] and "vip (priority 5)" in body["message"]
        assert states(server) == {"vip": "loaded", "guest": "unloaded"}  # nothing was unloaded for it
        assert complete(client, "vip")


def test_a_deployment_over_the_budget_alone_is_refused_and_the_others_serve(tmp_path, chat_model, tiny_model):
    with served(tmp_path, chat_model, {"small": {"load": "eager"}}, "--budget", "cpu=500KB") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        # a 4-layer tiny Llama: its plan (about 724 KB) alone exceeds the budget; added to the watched
        # directory, it is picked up as any new file
        (tmp_path / "m" / "big.yaml").write_text(manifest(tiny_model("llama"), "big", load="eager"))

        def refused() -> bool:
            return any(s.get("phase") == "Failed" and "big" in (s.get("last_error") or "")
                       for s in get(f"{server.url}/status")[1])

        wait_for(refused, what="big to be refused")
        [failed] = [s for s in get(f"{server.url}/status")[1] if s.get("phase") == "Failed"]
        assert "budget" in failed["last_error"] and "can never be loaded" in failed["last_error"]
        assert states(server) == {"small": "loaded"}
        assert complete(client, "small")
        # through the control API: an on-demand deployment is validated and planned, applied by its first request
        (tmp_path / "extra.yaml").write_text(manifest(chat_model, "extra"))
        applied = cli("apply", str(tmp_path / "extra.yaml"), state=tmp_path / "state")
        assert applied.returncode == 0 and "deferred extra" in applied.stdout, applied.stdout + applied.stderr
        assert states(server) == {"small": "loaded", "extra": "unloaded"}
        deferred = json.loads(cli("status", "extra", "-o", "json", state=tmp_path / "state").stdout)
        assert deferred["revision"] is None and deferred["loaded"] == "unloaded" and deferred["phase"] == "Ready"
        assert complete(client, "extra")  # small (idle, same priority) makes room
        assert states(server) == {"small": "unloaded", "extra": "loaded"}
        assert json.loads(cli("status", "extra", "-o", "json", state=tmp_path / "state").stdout)["revision"] == 1


def test_an_in_flight_stream_is_never_cut_to_make_room(tmp_path, chat_model):
    specs = {"a": {"max_tokens": 200}, "b": {}}
    with served(tmp_path, chat_model, specs, "--budget", "cpu=500KB") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        reference = client.completions.create(model="a", prompt="x", max_tokens=200,
                                           temperature=0).usage.completion_tokens
        stream = client.completions.create(model="a", prompt="x", max_tokens=200, stream=True, temperature=0,
                                           stream_options={"include_usage": True})
        first = next(iter(stream))  # a is streaming: it holds its generation
        result: dict[str, object] = {}
        other = threading.Thread(target=lambda: result.update(reason=complete(client, "b")))
        other.start()  # b needs a's room
        chunks = [first, *stream]
        other.join(timeout=120)
        usage = [c.usage for c in chunks if c.usage]
        assert usage and usage[-1].completion_tokens == reference  # every token, as without b
        assert result.get("reason") in ("stop", "length")
        assert states(server) == {"a": "unloaded", "b": "loaded"}
        assert server.metric("deploykit_model_unloads_total", model="a", reason="pressure") == 1


def test_a_change_deferred_for_an_unloaded_deployment_reserves_its_new_plan(tmp_path, chat_model):
    """An on-demand deployment that never loaded takes a change (a prefix cache: a bigger plan): the budget
    reserves the new plan's bytes for its next load, not the bytes of the plan it replaced."""
    with served(tmp_path, chat_model, {"a": {}}, "--budget", "cpu=64MB") as server:
        def budget_bytes() -> int:
            return next(s for s in get(f"{server.url}/status")[1] if s.get("name") == "a")["budget"]["bytes"]

        assert budget_bytes() == SIZE
        bigger = manifest(chat_model, "a").replace("prefix_cache: {enabled: false}",
                                                   "prefix_cache: {enabled: true, max_bytes: 1MiB}")
        (tmp_path / "m" / "a.yaml").write_text(bigger)
        wait_for(lambda: budget_bytes() != SIZE, timeout=60, what="the deferred change's bytes")
        assert budget_bytes() == SIZE + (1 << 20)
        assert complete(openai.OpenAI(base_url=f"{server.url}/v1", api_key="x"), "a") in ("stop", "length")
        assert budget_bytes() == SIZE + (1 << 20)


def test_two_eager_deployments_whose_weights_fit_both_load_with_smaller_default_caches(tmp_path):
    """Two eager deployments whose weights fit the budget together, their default prefix caches (each planned
    from the whole budget) not: both load, the caches sized from what the budget leaves, and /readyz, the
    metrics and /status agree."""
    from deploykit.control.revisions.change import Change
    from deploykit.spec.manifest import manifest_named

    model = build_chat_model(tmp_path / "wide", hidden=256, intermediate=1024)
    (tmp_path / "m").mkdir()
    for name in ("a", "b"):  # the default prefix cache: no prefix_cache field
        (tmp_path / "m" / f"{name}.yaml").write_text(
            manifest(model, name, load="eager").replace(", prefix_cache: {enabled: false}", ""))
    plain = tmp_path / "plain.yaml"
    plain.write_text(manifest(model, "plain"))
    weights = Change(manifest_named(plain, "plain")).plan().total_bytes
    budget = 2 * weights + (3 << 20)
    planned = Change(manifest_named(tmp_path / "m" / "a.yaml", "a"), budget_cpu=budget).plan().prefix_cache_bytes
    assert planned > 0 and 2 * (weights + planned) > budget
    with Server(tmp_path / "m", tmp_path / "state", "--budget", f"cpu={budget}") as server:
        assert get(f"{server.url}/readyz")[0] == 200
        assert states(server) == {"a": "loaded", "b": "loaded"}
        assert server.metric("deploykit_model_loaded", model="a") == 1
        assert server.metric("deploykit_model_loaded", model="b") == 1
        assert server.metric("deploykit_model_unloads_total") == 0
        status = {s["name"]: s for s in get(f"{server.url}/status")[1]}
        caches = sorted(status[n]["budget"]["bytes"] - weights for n in ("a", "b"))
        assert caches[0] < planned and caches[1] == planned, caches  # the second one's cache is smaller
        assert server.metric("deploykit_budget_used_bytes", tier="cpu") == 2 * weights + sum(caches) <= budget
        for name in ("a", "b"):
            assert status[name]["phase"] == "Ready" and status[name]["budget"]["waiting"] is None
            assert not any(c["type"] == "Loaded" for c in status[name]["conditions"])
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert complete(client, "a") and complete(client, "b")
