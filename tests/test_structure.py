"""Structure and plans of tiny real models built from transformers configs."""

from __future__ import annotations

import shutil

import pytest
import torch

from deploykit.errors import CheckpointError
from deploykit.placement.inventory import Inventory, parse_devices
from deploykit.spec.schema import Spec
from deploykit.placement.planner import plan
from deploykit.model.structure import build_meta_model, load_config, load_structure
from tiny import TINY

GiB = 2**30


def covered(module_name: str, device_map: dict) -> bool:
    parts = module_name.split(".")
    return any(".".join(parts[:i]) in device_map for i in range(len(parts) + 1))


@pytest.mark.parametrize("name", sorted(TINY))
def test_blocks_cover_every_tensor_once(tiny_model, name):
    directory = tiny_model(name)
    task = TINY[name][2]
    s = load_structure(directory, task=task, dtype="float32")
    model = build_meta_model(load_config(directory), task=task)
    modules = [m for b in s.blocks for m in b.modules]
    assert len(modules) == len(set(modules))
    device_map = {m: 0 for m in modules}
    for pname, _ in model.named_parameters():
        assert covered(pname, device_map), pname
    for bname, _ in model.named_buffers():
        assert covered(bname, device_map), bname
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert s.weight_bytes == sum(t.numel() * t.element_size() for t in unique.values())
    assert s.blocks[s.embedding_block].kind == "embedding"
    assert sum(b.kind == "layer" for b in s.blocks) >= 3


@pytest.mark.parametrize("name", ["llama-tied", "gpt2", "t5"])
def test_tied_modules_share_a_block(tiny_model, name):
    s = load_structure(tiny_model(name), task=TINY[name][2], dtype="float16")
    emb = s.blocks[s.embedding_block]
    assert any(m.endswith("lm_head") for m in emb.modules)
    assert s.notes and "share weights" in s.notes[0]


def test_untied_llama_head_is_its_own_block_at_the_end(tiny_model):
    s = load_structure(tiny_model("llama"), task="causal-lm", dtype="float16")
    assert [b.kind for b in s.blocks][-1] == "head"
    assert s.blocks[0].name == "model.embed_tokens"
    layers = [b.name for b in s.blocks if b.kind == "layer"]
    assert layers == [f"model.layers.{i}" for i in range(4)]
    assert all(b.kv_bytes_per_token == 2 * 2 * 16 * 2 for b in s.blocks if b.kind == "layer")


def test_dtype_halves_bytes(tiny_model):
    s32 = load_structure(tiny_model("llama"), task="causal-lm", dtype="float32")
    s16 = load_structure(tiny_model("llama"), task="causal-lm", dtype="bfloat16")
    assert s16.weight_bytes < s32.weight_bytes
    assert s16.blocks[1].weight_bytes * 2 == s32.blocks[1].weight_bytes


def test_t5_decoder_layers_have_kv_encoder_layers_not(tiny_model):
    s = load_structure(tiny_model("t5"), task="seq2seq-lm", dtype="float16")
    kv = {b.name: b.kv_bytes_per_token for b in s.blocks if b.kind == "layer"}
    assert kv["encoder.block.0"] == 0 and kv["decoder.block.0"] > 0


def test_bert_has_no_kv_cache(tiny_model):
    s = load_structure(tiny_model("bert"), task="feature-extraction", dtype="float16")
    assert s.blocks[0].name == "embeddings"
    assert all(b.kv_bytes_per_token == 0 for b in s.blocks)


def test_plan_before_download_needs_config_only(tiny_model, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_model("mistral") / "config.json").read_bytes())
    s = load_structure(tmp_path, task="causal-lm", dtype="float16")
    p = plan(s, Spec.model_validate({"model": {"path": str(tmp_path)}, "placement": {
        "gpus": [0, 1, 2], "reserve": 0}}), parse_devices("3x1GiB"))
    assert set(p.device_map.values()) == {0, 1, 2}
    assert p.device_map["model.embed_tokens"] == 0


def test_wrong_task_for_architecture_is_a_clear_error(tiny_model):
    with pytest.raises(CheckpointError, match="seq2seq-lm"):
        load_structure(tiny_model("llama"), task="seq2seq-lm", dtype="float16")


def test_missing_or_broken_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_structure(tmp_path, task="causal-lm", dtype="float16")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_structure(tmp_path, task="causal-lm", dtype="float16")
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(CheckpointError, match="cannot read this config"):
        load_structure(tmp_path, task="causal-lm", dtype="float16")


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama-tied"])
def test_device_map_loads_with_from_pretrained_across_cpu_and_disk(tiny_model, tmp_path, name):
    """The plan's device_map is usable as is: CPU + disk split gives the same logits as plain CPU."""
    from transformers import AutoModelForCausalLM

    directory = tiny_model(name)
    s = load_structure(directory, task="causal-lm", dtype="float32")
    budget = s.weight_bytes // 2
    spec = Spec.model_validate({"model": {"path": str(directory), "dtype": "float32"},
                                "offload": {"cpu": {"max_memory": budget},
                                            "disk": {"path": str(tmp_path / "off")}}})
    p = plan(s, spec, Inventory())
    assert {"cpu", "disk"} <= set(p.device_map.values())
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    split = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, device_map=p.device_map,
                                                 offload_folder=str(tmp_path / "off"))
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, split(ids).logits)
    shutil.rmtree(tmp_path / "off", ignore_errors=True)
