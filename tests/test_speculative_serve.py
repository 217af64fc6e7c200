"""Speculative decoding through a real `deploykit serve` and the official `openai` client: a reload that only
adds ``spec.speculative`` (method ngram) takes effect (a new generation), greedy answers stay the same (n=2,
completions and chat), the metrics count drafted and accepted tokens, and the status shows the settings."""

from __future__ import annotations

from pathlib import Path

import openai

from chatmodel import build_chat_model
from helpers import wait_until
from manifests import replace_like_an_editor
from servers import Server, get

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


def manifest(model: Path, speculative: str | None = None) -> str:
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: chat}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n"
            "  placement: {gpus: []}\n  offload: {cpu: {max_memory: 1GiB}}\n"
            "  serving: {max_tokens: 48}\n" + (f"  speculative: {speculative}\n" if speculative else ""))


def answers(client: openai.OpenAI) -> list[str]:
    completion = client.completions.create(model="chat", prompt=PROMPT, temperature=0, max_tokens=40, n=2)
    chat = client.chat.completions.create(model="chat", temperature=0, max_tokens=40,
                                          messages=[{"role": "user", "content": PROMPT}])
    return [c.text for c in completion.choices] + [chat.choices[0].message.content or ""]


def test_a_reload_that_adds_ngram_speculation_answers_the_same_and_counts_drafts(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model", context=512)
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))
    with Server(path, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        plain = answers(client)
        replace_like_an_editor(path, manifest(model, "{method: ngram, num_tokens: 6}"))
        wait_until(lambda: server.metric("deploykit_generation", deployment="chat") == 2, timeout=120,
                   what="the reload to generation 2")
        assert answers(client) == plain
        drafted = server.metric("deploykit_speculative_drafted_tokens_total", model_name="chat", generation="2")
        accepted = server.metric("deploykit_speculative_accepted_tokens_total", model_name="chat", generation="2")
        assert drafted > 0 and accepted > 0, (drafted, accepted)
        rate = server.metric("deploykit_speculative_acceptance_rate", model_name="chat", generation="2")
        assert rate == accepted / drafted
        code, status = get(f"{server.url}/status")
        assert code == 200
        [chat] = [d for d in status if d["name"] == "chat"]
        assert chat["speculative"]["method"] == "ngram" and chat["speculative"]["num_tokens"] == 6
        assert chat["speculative"]["accepted"] == accepted


def test_a_quantized_self_draft_serves_the_same_answers_over_http(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model", context=512)
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model, "{method: draft, num_tokens: 4, draft: {quantized: int8}}"))
    with Server(path, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        fast = answers(client)
        accepted = server.metric("deploykit_speculative_accepted_tokens_total", model_name="chat", generation="1")
        assert accepted > 0
        code, status = get(f"{server.url}/status")
        [chat] = [d for d in status if d["name"] == "chat"]
        assert chat["speculative"]["method"] == "draft" and chat["speculative"]["draft_quantized"] == "int8"
        assert "error" not in chat["speculative"]
        replace_like_an_editor(path, manifest(model))
        wait_until(lambda: server.metric("deploykit_generation", deployment="chat") == 2, timeout=120,
                   what="the reload to generation 2")
        assert answers(client) == fast


def test_a_draft_that_fails_to_load_leaves_the_model_serving_and_says_why(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model", context=512)
    draft = build_chat_model(tmp_path / "draft", layers=1, seed=1, context=512)
    for shard in draft.glob("*.safetensors"):  # validation reads no weights: the load finds them broken
        shard.write_bytes(b"not safetensors")
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model, f"{{method: draft, draft: {{path: {draft}}}}}"))
    with Server(path, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        assert len(answers(client)) == 3
        code, status = get(f"{server.url}/status")
        [chat] = [d for d in status if d["name"] == "chat"]
        assert chat["phase"] == "Ready"
        assert "failed to load" in chat["speculative"]["error"] and str(draft) in chat["speculative"]["error"]
