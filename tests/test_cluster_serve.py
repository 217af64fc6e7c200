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
from servers import Server  # noqa: E402
from test_serve import reference_text  # noqa: E402

NODE = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)


@pytest.fixture(scope="module")
def cluster(request):
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0})
    request.addfinalizer(c.shutdown)
    c.add_node(**NODE)
    c.add_node(**NODE)
    c.wait_for_nodes()
    return c


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
    with Server(tmp_path / "piped.yaml", tmp_path / "state", ready_timeout=240) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(prompts, expected):
            got = client.completions.create(model="piped", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want
        batch = client.completions.create(model="piped", prompt=prompts, max_tokens=12, temperature=0)
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
        status = server.metric("deploykit_generation", deployment="piped")
        assert status == 1.0
    assert server.process is not None and server.process.returncode == 0
    ray.init(address=cluster.address)
    try:  # SIGTERM freed the stage actors and their placement group: every CPU is free again
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
            assert time.monotonic() < deadline, f"still held: {ray.available_resources()}"
            time.sleep(0.5)
    finally:
        ray.shutdown()
