"""spec.placement.tensor_parallel: validation, each rank's share in the plan, per-rank shards on disk,
and ranks started by deploykit serving greedy tokens equal to one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_cli import deploykit

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: tp
spec:
  model:
    path: {path}
    dtype: float32
  placement:
    gpus: {gpus}
    reserve: 0
    tensor_parallel: {ranks}
{extra}"""


def write(tmp_path: Path, model: Path, *, ranks: int = 2, gpus: str = "[]", extra: str = "",
          name: str = "tp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(MANIFEST.format(path=model, ranks=ranks, gpus=gpus, extra=extra))
    return path


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model("llama")  # 4 attention heads, 2 key-value heads


def test_plan_shows_each_gpu_holding_half_the_split_weights(tmp_path, llama):
    from deploykit.model.structure import load_structure

    result = deploykit("plan", str(write(tmp_path, llama, gpus="[0, 1]")), "--devices", "2x1GiB", "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    structure = load_structure(llama, task="causal-lm", dtype="float32")
    split = sum(b.split_bytes for b in structure.blocks)
    whole = structure.weight_bytes - split
    # the norms and rotary tables stay whole; attention, MLP, embeddings and head split in two
    assert whole and split > 0.95 * structure.weight_bytes
    assert [d["device"] for d in plan["devices"]] == [0, 1]
    assert [d["weight_bytes"] for d in plan["devices"]] == [whole + split // 2] * 2
    single = json.loads(deploykit("plan", str(write(tmp_path, llama, ranks=1, gpus="[0]", name="one.yaml")),
                                  "--devices", "1x1GiB", "-o", "json").stdout)
    assert single["devices"][0]["weight_bytes"] == structure.weight_bytes
    assert single["digest"] != plan["digest"]


def test_plan_on_a_cpu_host_lists_one_worker_per_rank(tmp_path, llama):
    result = deploykit("plan", str(write(tmp_path, llama)), "--devices", "cpu=8GiB", "-o", "json")
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    assert [(d["device"], d["tier"], d["budget"]) for d in devices] == [("cpu:0", "cpu", 4 * 2**30),
                                                                        ("cpu:1", "cpu", 4 * 2**30)]


def test_ranks_must_divide_the_heads_at_the_fields_line(tmp_path, llama):
    path = write(tmp_path, llama, ranks=4)  # 4 attention heads but 2 key-value heads
    for verb in ("validate", "plan"):
        result = deploykit(verb, str(path))
        assert result.returncode == 2, (verb, result.stdout, result.stderr)
        assert f"{path}:12:22: spec.placement.tensor_parallel: tensor_parallel 4 must divide the model's heads, " \
               "but it has 2 key-value heads" in result.stderr, result.stderr


@pytest.mark.parametrize("extra, ranks, gpus, message", [
    ("    nodes: 2\n  cluster: {address: local}\n", 2, "[]", "tensor_parallel 2 with nodes 2 is not supported yet"),
    ("", 2, "[0, 1, 2]", "tensor_parallel 2 needs one GPU per rank, but gpus lists 3"),
    ("  cluster: {address: local}\n", 2, "[]", "tensor_parallel with spec.cluster"),
    ("  offload: {disk: {path: /tmp}}\n", 2, "[]", "tensor_parallel with spec.offload.disk is not supported"),
])
def test_combinations_not_run_are_refused_at_the_field(tmp_path, llama, extra, ranks, gpus, message):
    path = write(tmp_path, llama, ranks=ranks, gpus=gpus, extra=extra)
    for verb in ("validate", "plan"):
        result = deploykit(verb, str(path))
        assert result.returncode == 2, (verb, result.stderr)
        assert f"{path}:12:22: spec.placement.tensor_parallel: {message}" in result.stderr, result.stderr


def test_a_model_without_a_tp_plan_is_refused(tmp_path, tiny_model):
    result = deploykit("plan", str(write(tmp_path, tiny_model("gpt2"))), "--devices", "cpu=8GiB")
    assert result.returncode == 1
    assert "GPT2LMHeadModel declares no tensor-parallel plan" in result.stderr
    assert "spec.placement.tensor_parallel" in result.stderr


def test_the_default_keeps_manifest_digests():
    from deploykit.spec.manifest import Placement

    assert "tensor_parallel" not in Placement().model_dump()
    assert Placement(tensor_parallel=2).model_dump()["tensor_parallel"] == 2
