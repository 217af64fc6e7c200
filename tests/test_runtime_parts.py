"""The one context length and the one set of end-of-sequence ids every runtime (in process, pipeline
stages, tensor-parallel ranks, replicas) uses."""

from __future__ import annotations

import json

from transformers import AutoConfig

from deploykit.engine.runtime import context_length, eos_ids_of
from deploykit.engine.types import Limits


def test_generation_config_eos_wins_over_config(tiny_model, tmp_path):
    model = tiny_model("llama")
    config = AutoConfig.from_pretrained(model)
    (tmp_path / "config.json").write_text((model / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_ids_of(tmp_path, config) == {7, 9}
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()),
                                                  "eos_token_id": 3}))
    assert eos_ids_of(bare, AutoConfig.from_pretrained(bare)) == {3}


def test_context_length_is_the_manifests_else_the_models(tiny_model):
    config = AutoConfig.from_pretrained(tiny_model("llama"))
    assert context_length(config, Limits()) == 128
    assert context_length(config, Limits(context_length=64)) == 64
    config.max_position_embeddings = 10**6
    assert context_length(config, Limits()) == 8192
