"""Ray Serve replicas on a real ``ray.cluster_utils.Cluster`` (a head without CPUs and two fake worker
nodes on this machine): the replica engine streams tokens as they are produced and admits like the
in-process engine (``max_concurrent`` per replica in flight, ``max_queued`` waiting, then QueueFull: 429),
and replicas of a two-node pipeline, each with its own stage actors, serve behind ``deploykit serve`` and
scale 1 -> 2 by a manifest change with no failed request. One cluster for the module, shut down in a
finaliser (never ``ray stop``: it kills every cluster on the machine)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from chatmodel import build_chat_model  # noqa: E402
from clusters import Asker, fake_cluster  # noqa: E402
from servers import Server  # noqa: E402
from test_serve import reference_text  # noqa: E402

NODE = dict(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False)
BOUNDED = "max_tokens: 32, max_concurrent: 1, max_queued: 1"


@pytest.fixture(scope="module")
def cluster(request):
    return fake_cluster(request, NODE)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("replicas") / "chat")


def manifest(model: Path, address: str, *, name: str, replicas: int = 1, nodes: int = 1,
             serving: str = "max_tokens: 64") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n"
            f"  cluster: {{address: '{address}'}}\n  replicas: {replicas}\n"
            f"  placement: {{gpus: [], nodes: {nodes}}}\n  rollout: {{strategy: blue-green}}\n"
            f"  serving: {{{serving}}}\n")


def test_replica_engine_streams_as_produced_and_bounds_its_queue(cluster, model, tmp_path):
    from ray import serve

    from deploykit.cluster.replica_runtime import build_replica_runtime
    from deploykit.control.revisions.loading import serving_of
    from deploykit.engine.admission import QueueFull
    from deploykit.engine.batching import GenerationRequest
    from deploykit.engine.serving import TextEngine
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import parse_manifests

    text = manifest(model, cluster.address, name="bounded", serving="max_concurrent: 1, max_queued: 1")
    loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)[0]
    runtime = build_replica_runtime(plan_manifest(loaded, devices="cpu=4GiB"), model, serving_of(loaded),
                                    address=cluster.address, replicas=1)
    engine = runtime.engine
    prompt = runtime.tokenizer("Once upon a time")["input_ids"]
    try:
        assert isinstance(engine, TextEngine)
        # streamed: the first token arrives long before the last one is produced (not in one burst)
        arrivals: list[float] = []
        h = engine.submit(GenerationRequest(prompt, 200), lambda item: arrivals.append(time.monotonic()))
        done = h.result(timeout=120)
        assert (done.finish_reason, done.completion_tokens) == ("length", 200)
        total = arrivals[-1] - h.submitted
        assert done.time_to_first_token is not None and done.time_to_first_token < total / 3, (
            done.time_to_first_token, total)
        # bounded: 1 in flight (its sender held on its first token), 1 waiting, the next refused
        first, release = threading.Event(), threading.Event()

        def hold(item) -> None:
            if isinstance(item, int) and not first.is_set():
                first.set()
                release.wait(60)

        running = engine.submit(GenerationRequest(prompt, 8), hold)
        assert first.wait(60)
        waiting = engine.submit(GenerationRequest(prompt, 8))
        assert engine.stats() == {"running": 1, "waiting": 1}
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest(prompt, 8))
        senders = [t for t in threading.enumerate() if t.name.startswith("deploykit-replica")]
        assert len(senders) <= 2  # the dispatcher and one sender slot: never a thread per request
        release.set()
        assert [r.result(timeout=60).finish_reason for r in (running, waiting)] == ["length", "length"]
        # a cancelled stream ends at once and frees the replica's slot
        h = engine.submit(GenerationRequest(prompt, 200))
        while not h.tokens:
            time.sleep(0.01)
        engine.cancel(h)
        assert h.result(timeout=5).finish_reason == "cancelled"
        replica = runtime.engine.handle
        deadline = time.monotonic() + 30
        while replica.stats.remote().result(timeout_s=30)["running"]:
            assert time.monotonic() < deadline, "the replica kept generating a cancelled request"
            time.sleep(0.1)
    finally:
        runtime.close()
        serve.shutdown()
        ray.shutdown()  # this process leaves the cluster (the next test connects its own way)


def test_replicas_the_cluster_cannot_place_fail_in_bounded_time(cluster, model, tmp_path):
    """Serve waits forever for replicas no node can hold; deploykit gives up after its timeout, says what
    did not fit and leaves no application behind."""
    from ray import serve

    from deploykit.cluster.ray_env import ClusterError
    from deploykit.cluster.replica_runtime import build_replica_runtime
    from deploykit.cluster.replicas import ReplicaOptions
    from deploykit.control.revisions.loading import serving_of
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import parse_manifests

    loaded = parse_manifests(manifest(model, cluster.address, name="huge").encode(), source="m.yaml",
                             base_dir=tmp_path)[0]
    started = time.monotonic()
    try:
        with pytest.raises(ClusterError) as info:
            build_replica_runtime(plan_manifest(loaded, devices="cpu=4GiB"), model, serving_of(loaded),
                                  address=cluster.address, replicas=1,
                                  options=ReplicaOptions(num_cpus=3, timeout=15))
        assert time.monotonic() - started < 90
        assert "could not start 1 replica(s) of {'CPU': 3} within 15s" in str(info.value)
        assert not [a for a in serve.status().applications if a.startswith("huge-")]
    finally:
        serve.shutdown()
        ray.shutdown()


def test_pipeline_replicas_scale_one_to_two_without_failures(cluster, model, tmp_path):
    from deploykit.control.revisions.state import StateStore
    from manifests import replace_like_an_editor

    from transformers import AutoTokenizer

    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = manifests / "piped.yaml"
    path.write_text(manifest(model, cluster.address, name="piped", nodes=2, serving=BOUNDED))
    tokenizer = AutoTokenizer.from_pretrained(model)
    want, _ = reference_text(model, tokenizer("hello")["input_ids"], 8)

    def generation() -> int:
        with urllib.request.urlopen(f"{server.url}/status", timeout=30) as r:
            return int(json.loads(r.read())[0]["generation"])

    with Server(manifests, tmp_path / "state", "--allow-cluster", ready_timeout=300) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        asker = Asker(server.url, "piped")
        texts, failures = asker.texts, asker.failures
        with asker:
            replace_like_an_editor(path, manifest(model, cluster.address, name="piped", nodes=2, replicas=2,
                                                  serving=BOUNDED))
            deadline = time.monotonic() + 300
            while generation() != 2:
                assert time.monotonic() < deadline and not failures, failures
                time.sleep(0.5)
            assert "2 replica(s) of 2 stages each" in StateStore(tmp_path / "state").current("piped").reason
            served = len(texts)
            while len(texts) < served + 3:
                assert not failures, failures
                time.sleep(0.2)
            # streamed through the replicas: the same text, in more than one chunk
            chunks = [c.choices[0].text for c in client.completions.create(
                model="piped", prompt="hello", max_tokens=8, temperature=0, stream=True) if c.choices]
            assert "".join(chunks) == want and len([c for c in chunks if c]) > 1
        # a burst beyond 2 replicas x max_concurrent 1 in flight + max_queued 1 waiting: 429 + Retry-After
        codes, retry_after = _burst(client, 8)
        assert codes.count(429) >= 1 and set(codes) <= {200, 429} and codes.count(200) >= 3, codes
        assert retry_after and all(int(v) >= 1 for v in retry_after)
        # each replica owns its stages: two STRICT_SPREAD groups of two bundles, the old pipeline's gone
        ray.init(address=cluster.address)
        try:
            deadline = time.monotonic() + 60
            while len(groups := _pipeline_groups()) != 2:
                assert time.monotonic() < deadline, groups
                time.sleep(0.5)
        finally:
            ray.shutdown()
    assert failures == []
    assert set(texts) == {want} and len(texts) >= 5


def _burst(client: openai.OpenAI, n: int) -> tuple[list[int], list[str]]:
    """``n`` completions sent at once: their status codes, and the Retry-After of every 429."""
    barrier, codes, retry_after = threading.Barrier(n), [], []

    def one() -> None:
        barrier.wait()
        try:
            client.completions.create(model="piped", prompt="hello", max_tokens=32, temperature=0)
            codes.append(200)
        except openai.RateLimitError as exc:
            codes.append(429)
            retry_after.append(exc.response.headers.get("retry-after", ""))
        except openai.APIStatusError as exc:
            codes.append(exc.status_code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return codes, retry_after


def _pipeline_groups() -> list[dict]:
    from ray.util import placement_group_table

    return [g for g in placement_group_table().values()
            if g["state"] == "CREATED" and g["strategy"] == "STRICT_SPREAD" and len(g["bundles"]) == 2]
