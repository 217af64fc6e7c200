"""In-process inference: Deployment.generate / chat / embed, batched with concurrent callers."""

from __future__ import annotations

import concurrent.futures

import pytest

from chatmodel import build_chat_model
from deploykit.control.live.deployment import Deployment
from deploykit.errors import ApplyError
from deploykit.engine.text import RequestError
from test_serve import chat_ids, chat_manifest, embed_manifest, minilm_path, reference_text


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("lib")
    model = build_chat_model(root / "model")
    (root / "chat.yaml").write_text(chat_manifest(model))
    dep = Deployment.from_manifest(root / "chat.yaml", state_dir=root / "state")
    yield dep, model
    dep.close()


def test_generate_and_chat_equal_transformers_greedy(chat):
    from transformers import AutoTokenizer

    dep, model = chat
    ids = AutoTokenizer.from_pretrained(model)("Hello there")["input_ids"]
    completion = dep.generate("Hello there", max_tokens=10)
    assert (completion.text, completion.finish_reason) == (reference_text(model, ids, 10)[0], "length")
    assert (completion.prompt_tokens, completion.completion_tokens) == (len(ids), 10)
    answer = dep.chat([{"role": "user", "content": "hi"}], max_tokens=10)
    assert answer.text == reference_text(model, chat_ids(model, "hi"), 10)[0]


def test_concurrent_callers_get_their_own_answers(chat):
    dep, _ = chat
    prompts = [f"prompt number {i}" for i in range(6)]
    alone = [dep.generate(p, max_tokens=8).text for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda p: dep.generate(p, max_tokens=8).text, prompts))
    assert together == alone


def test_limits_and_kinds_are_enforced(chat, tmp_path):
    dep, _ = chat
    with pytest.raises(RequestError, match="above this model's limit of 64"):
        dep.generate("x", max_tokens=100)
    with pytest.raises(ApplyError, match="does not serve embeddings"):
        dep.embed(["x"])
    (tmp_path / "minilm.yaml").write_text(embed_manifest(minilm_path()))
    with Deployment.from_manifest(tmp_path / "minilm.yaml", state_dir=tmp_path / "state") as embedder:
        vectors = embedder.embed(["a cat", "a dog"])
        assert len(vectors) == 2 and len(vectors[0]) == 384
        with pytest.raises(ApplyError, match="does not generate text"):
            embedder.generate("x")
