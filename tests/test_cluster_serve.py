"""A 2-node pipeline behind `deploykit serve`: /v1/completions answered by stage actors on two fake Ray
nodes equals single-process transformers token for token, single prompts and a batch of different
lengths. The server connects to a ``ray.cluster_utils.Cluster`` this test starts (head without CPUs, two
worker nodes), and frees its actors on SIGTERM."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from chatmodel import build_chat_model  # noqa: E402
from clusters import Asker, fake_cluster  # noqa: E402
from servers import Server  # noqa: E402
from test_disconnects import leave_early  # noqa: E402
from test_serve import reference_text  # noqa: E402

NODE = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)


@pytest.fixture(scope="module")
def cluster(request):
    return fake_cluster(request, NODE)


def manifest(model: Path, address: str) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: piped}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n"
            f"  cluster: {{address: '{address}'}}\n"
            f"  placement: {{gpus: [], nodes: 2}}\n"
            f"  serving: {{max_tokens: 32, max_concurrent: 4}}\n")


def test_pipeline_through_the_completions_api_equals_transformers(cluster, tmp_path):
    from transformers import AutoTokenizer

    model = build_chat_model(tmp_path / "model")
    (tmp_path / "piped.yaml").write_text(manifest(model, cluster.address))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = ["The quick brown fox", "a", "Once upon a time in a land"]
    expected = [reference_text(model, tokenizer(p)["input_ids"], 12)[0] for p in prompts]
    with Server(tmp_path / "piped.yaml", tmp_path / "state", "--allow-cluster", ready_timeout=240) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(prompts, expected):
            got = client.completions.create(model="piped", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want
        batch = client.completions.create(model="piped", prompt=prompts, max_tokens=12, temperature=0)
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
        status = server.metric("deploykit_generation", deployment="piped")
        assert status == 1.0
        leave_early(server, "piped", max_tokens=32)  # clients that leave early pin nothing
    assert server.process is not None and server.process.returncode == 0, server.stderr
    assert "Exception in ASGI application" not in server.stderr, server.stderr
    ray.init(address=cluster.address)
    try:  # SIGTERM freed the stage actors and their placement group: every CPU is free again
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
            assert time.monotonic() < deadline, f"still held: {ray.available_resources()}"
            time.sleep(0.5)
    finally:
        ray.shutdown()


def replicated(model: Path, address: str, replicas: int) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: rep}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n"
            f"  cluster: {{address: '{address}'}}\n  replicas: {replicas}\n"
            f"  placement: {{gpus: []}}\n  rollout: {{strategy: blue-green}}\n"
            f"  serving: {{max_tokens: 32}}\n")


def test_replicas_scale_and_a_broken_revision_keeps_the_old_ones_serving(cluster, tmp_path):
    import json
    import shutil
    import urllib.request

    from deploykit.control.revisions.state import StateStore
    from manifests import replace_like_an_editor

    model = build_chat_model(tmp_path / "model")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = manifests / "rep.yaml"
    path.write_text(replicated(model, cluster.address, 1))

    def generation() -> int:
        with urllib.request.urlopen(f"{server.url}/status", timeout=30) as r:
            return int(json.loads(r.read())[0]["generation"])

    with Server(manifests, tmp_path / "state", "--allow-cluster", ready_timeout=240) as server:
        asker = Asker(server.url, "rep")
        texts, failures = asker.texts, asker.failures
        with asker:
            replace_like_an_editor(path, replicated(model, cluster.address, 2))  # scale 1 -> 2
            deadline = time.monotonic() + 180
            while generation() != 2:
                assert time.monotonic() < deadline and not failures, failures
                time.sleep(0.5)
            assert "2 replica(s) answered" in StateStore(tmp_path / "state").current("rep").reason
            broken = Path(shutil.copytree(model, tmp_path / "broken"))
            config = json.loads((broken / "config.json").read_text())
            config["intermediate_size"] = 96  # the weights are 128 wide: the new replicas cannot load
            (broken / "config.json").write_text(json.dumps(config))
            replace_like_an_editor(path, replicated(broken, cluster.address, 2))
            deadline = time.monotonic() + 240
            while not (StateStore(tmp_path / "state").latest("rep").phase == "Failed"):
                assert time.monotonic() < deadline, "the broken revision neither failed nor finished"
                time.sleep(1)
            served = len(texts)
            while len(texts) < served + 3:
                time.sleep(0.2)
            assert generation() == 2  # the old replicas kept serving
        leave_early(server, "rep", max_tokens=32)  # with the asker stopped: clients that leave early pin nothing
    assert failures == []
    assert len(set(texts)) == 1 and len(texts) >= 5


def test_a_pipeline_asked_while_it_loads_is_answered(cluster, tmp_path):
    """Clients that ask as soon as /v1/models lists the pipeline (still loading) wait for it and get
    greedy answers equal to transformers; the server stops only when told to, and cleanly."""
    import signal
    import subprocess
    import sys
    import threading

    from helpers import wait_until
    from servers import free_port, get

    from transformers import AutoTokenizer

    model = build_chat_model(tmp_path / "model")
    served = tmp_path / "served"
    served.mkdir()
    (served / "piped.yaml").write_text(manifest(model, cluster.address))
    tokenizer = AutoTokenizer.from_pretrained(model)
    want = reference_text(model, tokenizer("Once upon a time")["input_ids"], 8)[0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "serve", str(served), "--port", str(port),
                                "--allow-cluster"],
                               env={**__import__("os").environ, "DEPLOYKIT_STATE": str(tmp_path / "state")},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    texts: list[str] = []
    failures: list[str] = []

    def listed() -> bool:
        try:
            return "piped" in [m["id"] for m in get(f"{url}/v1/models")[1]["data"]]
        except (OSError, KeyError, TypeError):
            return False

    def ask() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=240)
        try:
            texts.append(client.completions.create(model="piped", prompt="Once upon a time", max_tokens=8,
                                                   temperature=0).choices[0].text)
        except Exception as exc:  # every failure counts
            failures.append(repr(exc))

    try:
        wait_until(listed, 120, "the pipeline is listed")
        askers = [threading.Thread(target=ask) for _ in range(8)]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(300)
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    assert not failures, (failures, stderr)
    assert texts == [want] * 8, stderr
    assert "interpreter shutdown" not in stderr and "Exception in ASGI application" not in stderr, stderr
    assert process.returncode == 0, stderr
