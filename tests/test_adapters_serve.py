"""LoRA adapters served by a real `deploykit serve`, through the official `openai` client: each adapter is
model ``<deployment>:<adapter>``, its greedy answers equal peft's own ``generate`` with that adapter (the
deployment's own name: the base's), alone and in mixed concurrent batches, plain and streamed."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest

from lora import adapters_manifest, chat_ids, peft_reference
from servers import Server, get

KEY = "sk-deploykit-test"
TOKENS = 24
PROMPTS = ["hi", "hello there", "what is it"]


@pytest.fixture(scope="module")
def server(lora: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("serve-lora")
    (root / "m").mkdir()
    (root / "m" / "chat.yaml").write_text(adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite}))
    with Server(root / "m", root / "state", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(lora: Any) -> dict[tuple[str, str], str]:
    """(model, prompt) -> peft's greedy chat answer."""
    adapters = {"chat": None, "chat:pirate": lora.pirate, "chat:polite": lora.polite}
    return {(model, p): peft_reference(lora.base, path, chat_ids(lora.base, p), TOKENS)
            for model, path in adapters.items() for p in PROMPTS}


def _chat(client: openai.OpenAI, model: str, prompt: str, *, stream: bool) -> str:
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0)
        assert answer.model == model
        return answer.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_adapters_change_the_answers(expected: dict[tuple[str, str], str]) -> None:
    for p in PROMPTS:  # otherwise equality below would prove nothing
        assert len({expected[("chat", p)], expected[("chat:pirate", p)], expected[("chat:polite", p)]}) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_each_adapter_alone_answers_as_peft_does(client: openai.OpenAI, expected: dict[tuple[str, str], str],
                                                 stream: bool) -> None:
    for model in ("chat", "chat:pirate", "chat:polite"):
        assert _chat(client, model, "hi", stream=stream) == expected[(model, "hi")], model


def test_completions_take_the_adapter_too(client: openai.OpenAI, lora: Any) -> None:
    prompt = "user: hi\nassistant: "
    from transformers import AutoTokenizer

    ids = list(AutoTokenizer.from_pretrained(lora.base)(prompt)["input_ids"])
    answer = client.completions.create(model="chat:pirate", prompt=prompt, max_tokens=TOKENS, temperature=0)
    assert answer.model == "chat:pirate"
    assert answer.choices[0].text == peft_reference(lora.base, lora.pirate, ids, TOKENS)
    streamed = client.completions.create(model="chat:pirate", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == answer.choices[0].text


def test_mixed_concurrent_batches_answer_each_row_with_its_own_adapter(
        client: openai.OpenAI, expected: dict[tuple[str, str], str]) -> None:
    jobs = [(model, p, stream) for model in ("chat", "chat:pirate", "chat:polite") for p in PROMPTS
            for stream in (False, True)]
    start = threading.Barrier(len(jobs))
    answers: dict[int, str] = {}

    def run(i: int, model: str, prompt: str, stream: bool) -> None:
        start.wait()
        answers[i] = _chat(client, model, prompt, stream=stream)

    threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: answers.get(i) for i in range(len(jobs))} == {i: expected[(m, p)] for i, (m, p, _) in enumerate(jobs)}


def test_models_lists_each_adapter_with_its_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"chat", "chat:pirate", "chat:polite"}
    assert cards["chat:pirate"].model_extra["parent"] == "chat"  # type: ignore[index]
    assert cards["chat"].model_extra.get("parent") is None  # type: ignore[union-attr]
    assert client.models.retrieve("chat:polite").id == "chat:polite"


def test_an_unknown_adapter_is_an_openai_404(client: openai.OpenAI, server: Any) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="chat:nobody", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "chat:pirate" in err.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat:nobody", prompt="hi")
    status, _ = get(f"{server.url}/v1/models/chat:nobody", {"Authorization": f"Bearer {KEY}"})
    assert status == 404
