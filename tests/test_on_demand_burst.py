"""A burst of requests for an unloaded on-demand model, against a real `deploykit serve --budget`: they
wait for its load without holding the server's threads, so /readyz, /status and the other models answer
meanwhile, and every request of the burst is served once the model has loaded.

The load is slow for a real reason: the budget holds two models and both loaded ones outrank the
on-demand one, so its load waits for room until the test removes one of them (``--prune``).
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from chatmodel import build_chat_model
from servers import Server, get
from helpers import wait_until

BURST = 60  # more than anyio's thread pool (40): every one of them held a thread before
BOUND = 3.0  # seconds /readyz, /status or another model may take to answer during the burst


def manifest(model: Path, name: str, *, load: str = "on-demand", priority: int = 0,
             keep_alive: str = "forever") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  serving: {{max_tokens: 8, default_max_tokens: 2, prefix_cache: {{enabled: false}}}}\n"
            f"  lifecycle: {{load: {load}, priority: {priority}, keep_alive: {keep_alive}}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


def _complete(url: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return r.status


def _timed(call) -> tuple[float, object]:
    started = time.monotonic()
    result = call()
    return time.monotonic() - started, result


def _busy(server: Server, name: str) -> int:
    status = {s["name"]: s for s in get(f"{server.url}/status")[1] if s.get("name")}
    return status[name]["budget"]["busy"]


def test_a_burst_for_an_unloaded_model_leaves_the_server_answering(tmp_path, chat_model):
    (tmp_path / "m").mkdir()
    specs = {"big": {"load": "eager", "priority": 5}, "other": {"load": "eager", "priority": 5},
             "lazy": {"keep_alive": "10m"}}
    for name, kwargs in specs.items():
        (tmp_path / "m" / f"{name}.yaml").write_text(manifest(chat_model, name, **kwargs))
    with ThreadPoolExecutor(BURST) as clients, Server(tmp_path / "m", tmp_path / "state", "--budget", "cpu=900KB",
                                                      "--budget-timeout", "300", "--prune") as server:
        burst = [clients.submit(_complete, server.url, "lazy") for _ in range(BURST)]
        # every request of the burst waits for the load
        wait_until(lambda: _busy(server, "lazy") >= BURST, timeout=60, what="the burst to wait for lazy")
        other = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=BOUND * 4)
        took = []
        for _ in range(5):
            took.append(_timed(lambda: get(f"{server.url}/readyz")))
            took.append(_timed(lambda: get(f"{server.url}/status")))
            took.append(_timed(lambda: other.completions.create(model="other", prompt="hi", max_tokens=2)))
        assert all(not f.done() for f in burst)  # lazy cannot load yet: it still waits for room
        assert [r[0] for _, r in took[0::3]] == [200] * 5 and [r[0] for _, r in took[1::3]] == [200] * 5
        slowest = max(t for t, _ in took)
        print(f"slowest answer of /readyz, /status or another model during the burst: {slowest:.3f}s")
        assert slowest < BOUND, f"the server took {slowest:.2f}s to answer during the burst"
        (tmp_path / "m" / "big.yaml").unlink()  # pruned: its room goes to lazy
        assert [f.result(timeout=300) for f in burst] == [200] * BURST
        assert {m["id"]: m["state"] for m in get(f"{server.url}/v1/models")[1]["data"]}["lazy"] == "loaded"
        assert server.metric("deploykit_model_loads_total", model="lazy", reason="request") == 1
