"""The prefix cache through a real `deploykit serve` and the official `openai` client, with the manifest's
defaults (the cache is on, sized by the plan): a second chat sharing a system prompt, and a conversation's
second turn, report the tokens read from the cache as ``usage.prompt_tokens_details.cached_tokens`` with the
same answer, the metrics count it, and a reload that turns the cache off frees the old generation's cache
and reports nothing cached any more.
"""

from __future__ import annotations

from pathlib import Path

import openai

from chatmodel import build_chat_model
from helpers import wait_until
from manifests import replace_like_an_editor
from servers import Server

SYSTEM = "You are a terse assistant who answers every question about the weather in one short line. " * 2


def manifest(model: Path, cache: str | None = None) -> str:
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: chat}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n"
            "  placement: {gpus: []}\n  offload: {cpu: {max_memory: 1GiB}}\n"
            "  serving: {max_tokens: 16" + (f", prefix_cache: {cache}" if cache else "") + "}\n")


def ask(client: openai.OpenAI, question: str) -> tuple[str, int, int]:
    """(answer, prompt tokens, cached tokens) of one greedy chat."""
    answer = client.chat.completions.create(
        model="chat", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    usage = answer.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return answer.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_cached_tokens_reported_and_released_on_reload(tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model", context=512)
    path = tmp_path / "chat.yaml"
    path.write_text(manifest(model))  # no prefix_cache: the default, a quarter of the 1 GiB tier's KV room
    with Server(path, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        first, prompt_tokens, cached = ask(client, "Is it sunny?")
        assert cached == 0 and prompt_tokens > 200
        again, _, cached = ask(client, "Is it sunny?")
        assert again == first and cached >= prompt_tokens - 32  # all but the last partial block
        _, _, cached = ask(client, "Will it rain?")
        assert cached >= len(SYSTEM) - 32  # the shared system prompt (one token per byte)
        assert server.metric("deploykit_prefix_cache_hits_total", model_name="chat", generation="1") == 2
        assert server.metric("deploykit_prefix_cache_tokens_reused_total", model_name="chat") >= 2 * len(SYSTEM) - 64
        assert 0 < server.metric("deploykit_prefix_cache_bytes", model_name="chat", generation="1") <= 255 << 20
        turn = client.chat.completions.create(  # the conversation's second turn: its first turn is cached
            model="chat", temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is it sunny?"},
                      {"role": "assistant", "content": first}, {"role": "user", "content": "And tomorrow?"}])
        assert turn.usage is not None and turn.usage.prompt_tokens_details is not None
        assert (turn.usage.prompt_tokens_details.cached_tokens or 0) >= prompt_tokens - 32

        replace_like_an_editor(path, manifest(model, "{enabled: false}"))
        wait_until(lambda: server.metric("deploykit_generation", deployment="chat") == 2, timeout=120,
                   what="the reload to generation 2")
        wait_until(lambda: server.metric("deploykit_prefix_cache_bytes", model_name="chat", generation="1") == 0,
                   timeout=60, what="generation 1 and its prefix cache to be freed")
        assert ask(client, "Is it sunny?") == (first, prompt_tokens, 0)
        assert ask(client, "Is it sunny?")[2] == 0  # off: nothing is kept
