"""Pipeline stages on a real Ray cluster: ``ray.cluster_utils.Cluster`` with a head (no CPUs, so no
stage lands on it) and two worker nodes, all on this machine. One cluster per module, shut down in a
finaliser even when a test fails (never ``ray stop``: it kills every cluster on the machine)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic use

from chatmodel import build_chat_model  # noqa: E402
from clusters import fake_cluster  # noqa: E402

from deploykit.cluster.pipeline import RayPipeline, greedy, split_layers, stages_of  # noqa: E402
from deploykit.cluster.stage import StageSpec  # noqa: E402

NODE = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3]]


@pytest.fixture(scope="module")
def cluster(request):
    return fake_cluster(request, NODE, connect=True)


def reference(model_dir: Path, prompts, new_tokens: int):
    """Single-process transformers: each prompt alone, and the prompts as one left-padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    single = [model.generate(input_ids=torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = model.generate(input_ids=ids, attention_mask=mask, **kw)[:, width:].tolist()
    return single, batch


def test_two_node_pipeline_equals_transformers(cluster, tiny_model):
    model_dir = tiny_model("llama")  # 4 layers: stage 0 holds 0-1 and the embeddings, stage 1 2-3 and the head
    single, batch = reference(model_dir, PROMPTS, 10)
    assert single == batch  # the reference itself is consistent
    specs = [StageSpec(i, 2, a, b, str(model_dir)) for i, (a, b) in enumerate(split_layers(4, 2))]
    pipe = RayPipeline.start(specs, num_cpus=0.5, timeout=120)
    try:
        nodes = pipe.node_ids()
        head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
        assert len(set(nodes)) == 2 and head not in nodes  # STRICT_SPREAD: one stage per worker node
        for prompt, expected in zip(PROMPTS, single):
            assert greedy(pipe, [prompt], 10) == [expected]
        assert greedy(pipe, PROMPTS, 10) == batch  # left-padded, different lengths
        info = pipe.info()
        # each stage read its own tensors only
        assert all(name.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))
                   for name in info[0]["tensors_read"])
        assert all(name.startswith(("model.norm", "lm_head", "model.layers.2.", "model.layers.3."))
                   for name in info[1]["tensors_read"])
        assert {"lm_head.weight", "model.layers.3.mlp.up_proj.weight"} <= set(info[1]["tensors_read"])
        assert info[0]["threads"] == 1 and info[1]["threads"] == 1
        assert [i["open_requests"] for i in info] == [[], []]  # caches freed when each request ended
        # a failing request frees its caches too (token id out of the vocabulary fails stage 0)
        import torch

        group = uuid.uuid4().hex
        with pytest.raises(Exception):
            pipe.step(group, torch.tensor([[10_000]]), torch.ones(1, 1, dtype=torch.long),
                      torch.zeros(1, 1, dtype=torch.long))
        pipe.release(group)
        assert [i["open_requests"] for i in pipe.info()] == [[], []]
    finally:
        pipe.close()


def test_pipeline_runtime_serves_completions(cluster, tmp_path):
    """build_pipeline_runtime from a manifest and its two-node plan; requests through the runtime
    interface the OpenAI routes use equal single-process transformers."""
    from deploykit.cluster.runtime import PipelineOptions, PipelineRuntime, build_pipeline_runtime
    from deploykit.control.revisions.loading import serving_of
    from deploykit.engine.batching import GenerationRequest
    from deploykit.engine.runtime import Sampling
    from deploykit.engine.serving import TextEngine
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import load_manifests

    model_dir = build_chat_model(tmp_path / "chat")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"""apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: chat}}
spec:
  model: {{path: {model_dir}, dtype: float32}}
  cluster: {{address: "{cluster.address}"}}
  placement: {{nodes: 2}}
  serving: {{max_concurrent: 4, max_tokens: 16}}
""")
    loaded = load_manifests(manifest)[0]
    # the live cluster as an inventory: head first, then the two workers; too many nodes names them all
    from deploykit.cluster.inventory import probe_cluster
    from deploykit.errors import PlanInfeasible

    live = probe_cluster(cluster.address)
    assert len(live.nodes) == 3 and not live.simulated and all(n.id and n.address for n in live.nodes)
    too_many = load_manifests(manifest)[0].manifest.spec.model_copy(
        update={"placement": loaded.manifest.spec.placement.model_copy(update={"nodes": 4})})
    with pytest.raises(PlanInfeasible) as info:
        from deploykit.placement.planner import plan as plan_of
        from deploykit.placement.planning import structure_for

        plan_of(structure_for(loaded), too_many, live)
    assert info.value.field == "spec.placement.nodes" and "the inventory has 3 nodes" in str(info.value)
    assert all(n.id[:8] in str(info.value) for n in live.nodes)
    plan = plan_manifest(loaded, devices="2x()")
    assert [n.layers for n in plan.nodes] == [(0, 0), (1, 1)]
    assert [s.start for s in stages_of(plan, model_dir, dtype="float32")] == [0, 1]
    runtime = build_pipeline_runtime(plan, model_dir, serving_of(loaded), cluster.address,
                                     PipelineOptions(num_cpus=0.5, timeout=120))
    try:
        assert isinstance(runtime, PipelineRuntime) and runtime.kind == "text"
        assert isinstance(runtime.engine, TextEngine)
        assert "finite" in runtime.health_check("Hello", timeout=60).detail
        assert runtime.context_length == 256 and runtime.eos_ids == {runtime.tokenizer.eos_token_id}
        prompts = ["Hello there", "a", "The quick brown fox"]
        ids = [runtime.tokenizer(p)["input_ids"] for p in prompts]
        single, _ = reference(model_dir, ids, 8)
        # the text route: Completion through the engine, token for token equal to transformers
        done = runtime.complete(ids[0], Sampling(max_tokens=8))
        assert done.completion_tokens == 8 and done.finish_reason == "length"
        assert done.text == runtime.tokenizer.decode(single[0], skip_special_tokens=True)
        # concurrent submits (batched together), with listeners as the streaming route uses them
        events: list = []
        lock = threading.Lock()

        def listener(item) -> None:
            with lock:
                events.append(item)

        handles = [runtime.engine.submit(GenerationRequest(prompt_ids=p, max_new_tokens=8), listener)
                   for p in ids]
        results = [h.result(timeout=60) for h in handles]
        assert [r.token_ids for r in results] == single
        assert sum(1 for e in events if isinstance(e, int)) == 24
        # cancel ends a request at once and its batch stops
        h = runtime.engine.submit(GenerationRequest(prompt_ids=ids[2], max_new_tokens=16))
        runtime.engine.cancel(h)
        assert h.result(timeout=60).finish_reason == "cancelled"
        deadline = time.monotonic() + 30  # the batch ends at its next step and frees the caches
        while runtime.engine.stats() != {"running": 0, "waiting": 0} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runtime.engine.stats() == {"running": 0, "waiting": 0}
        assert [i["open_requests"] for i in runtime.pipeline.info()] == [[], []]
    finally:
        runtime.close()


def test_replicas_scale_one_to_two_without_failures(cluster, tmp_path):
    """spec.replicas on Ray Serve: 1 -> 2 replicas by re-running serve.run while a client keeps sending
    requests; none fails, and both replicas answer afterwards. Replicas load the plan they are given."""
    from ray import serve

    from deploykit.cluster.replica_runtime import ReplicaEngine
    from deploykit.cluster.replicas import ReplicaOptions, replica_count, run_replicas, start_serve
    from deploykit.control.revisions.loading import serving_of
    from deploykit.engine.batching import GenerationRequest
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import parse_manifests

    model_dir = build_chat_model(tmp_path / "chat")
    text = f"""apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: chat}}
spec:
  model: {{path: {model_dir}, dtype: float32}}
  cluster: {{address: "{cluster.address}"}}
"""
    loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)[0]
    plan, serving = plan_manifest(loaded, devices="cpu=4GiB"), serving_of(loaded)
    options = ReplicaOptions(num_cpus=0.3)
    start_serve()
    try:
        handle = run_replicas("chat", plan, str(model_dir), serving, 1, options)
        assert replica_count("chat") == 1
        engine = ReplicaEngine(handle, set(), slots=4, max_queued=64)
        outcomes: list = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                try:
                    outcomes.append(engine.submit(GenerationRequest([40, 41, 42], 4)).result(60))
                except Exception as exc:  # counted as a failure
                    outcomes.append(exc)

        worker = threading.Thread(target=client)
        worker.start()
        try:
            time.sleep(1.0)
            run_replicas("chat", plan, str(model_dir), serving, 2, options)
            assert replica_count("chat") == 2
            time.sleep(1.0)
        finally:
            stop.set()
            worker.join(90)
            engine.close(30)
        failures = [o for o in outcomes if isinstance(o, Exception) or o.finish_reason == "error"]
        assert outcomes and failures == []
        assert len({tuple(o.token_ids) for o in outcomes}) == 1  # same greedy answer from every replica
        seen = {handle.whoami.remote().result(timeout_s=60) for _ in range(12)}
        assert len(seen) == 2
    finally:
        serve.shutdown()
