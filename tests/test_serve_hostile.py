"""Hostile input against a real `deploykit serve`: what schema fuzzing and hand-made abuse found.

Each test is one class of input that used to break the server (a 500, a stream cut without a word, a
traceback, a connection held forever), now answered as docs/serving.md says: a tiny temperature is greedy,
a failure mid-stream ends the stream with an error event and `[DONE]`, embeddings check token ids, the
control API names the bad field, headers are bounded in size and in time, and an HTTP/1.0 client can
read a stream.
"""

from __future__ import annotations

import concurrent.futures
import json
import select
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatmodel import build_chat_model
from servers import Server
from test_serve import chat_manifest, embed_manifest, minilm_path

TOKEN = "control-token-for-tests"
HEADER_TIMEOUT = 1.0
POISON = "~"  # its embedding row is NaN in the broken model; the health check's "Hello" never meets it


def poison(model: Path, text: str) -> Path:
    """Write NaN into the embedding row of ``text``'s token: the model passes its health check and fails
    any sampled request whose prompt holds that token (as an overflowed fine-tune can leave a checkpoint)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    [token] = AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"]
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert torch.isnan(load_file(model / "model.safetensors")["model.embed_tokens.weight"][token]).all()
    return model


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "manifests").mkdir()
    chat, broken = build_chat_model(root / "chat"), poison(build_chat_model(root / "broken"), POISON)
    (root / "manifests" / "chat.yaml").write_text(chat_manifest(chat))
    (root / "manifests" / "broken.yaml").write_text(chat_manifest(broken, name="broken-chat"))
    (root / "manifests" / "minilm.yaml").write_text(embed_manifest(minilm_path()))
    with Server(root / "manifests", root / "state", "--control-token", TOKEN,
                "--header-timeout", str(HEADER_TIMEOUT)) as s:
        yield s
    assert "Traceback" not in s.stderr and "Exception in ASGI application" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def post(server: Server, path: str, body: dict, token: str | None = None, within: float = 60) -> tuple[int, Any]:
    """Status and JSON answer; an answer that does not end ``within`` seconds fails the test (a control
    stream's heartbeats would otherwise keep a hung operation alive for ever)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline, content = time.monotonic() + within, b""
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=headers, timeout=within) as response:
        for chunk in response.iter_bytes():
            content += chunk
            assert time.monotonic() < deadline, f"no answer within {within} s: {content[-500:]!r}"
    return response.status_code, json.loads(content)


# ---- a temperature below the floor -------------------------------------------------------------------

def test_a_temperature_below_the_floor_is_greedy(client):
    messages = [{"role": "user", "content": "hi"}]
    greedy = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0)
    for temperature in (1e-300, 1e-38, 1e-6):
        tiny = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8,
                                              temperature=temperature)
        assert tiny.choices[0].message.content == greedy.choices[0].message.content
    greedy_text = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=8, temperature=0)
    tiny_text = client.completions.create(model="tiny-chat", prompt="hi", max_tokens=8, temperature=5e-324)
    assert tiny_text.choices[0].text == greedy_text.choices[0].text


# ---- a failure after the stream started --------------------------------------------------------------

def sse_events(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": POISON}]}),
    ("/v1/completions", {"prompt": POISON}),
], ids=["chat", "completions"])
def test_a_failure_mid_stream_ends_with_an_error_event_then_done(server, path, body):
    request = {"model": "broken-chat", "max_tokens": 8, "temperature": 1.0, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}{path}", json=request, timeout=60) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]", events
    error = events[-2]["error"]
    assert error["code"] == "generation_failed" and error["type"] == "server_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_the_error_of_a_failed_stream(client):
    stream = client.chat.completions.create(model="broken-chat", messages=[{"role": "user", "content": POISON}],
                                            max_tokens=8, temperature=1.0, stream=True)
    with pytest.raises(openai.APIError, match="generation failed"):
        for _ in stream:
            pass


# ---- embeddings and client token ids -----------------------------------------------------------------

@pytest.mark.parametrize("value, code", [
    ([], None), ([-1], "invalid_token_id"), ([[1000000000000]], "invalid_token_id"),
    ([[5, 6], [7, 300000]], "invalid_token_id"), ([[]], None),
])
def test_embeddings_refuse_empty_input_and_ids_outside_the_vocabulary(server, value, code):
    status, answer = post(server, "/v1/embeddings", {"model": "minilm", "input": value})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    assert error["code"] == code


def test_a_seed_beyond_64_bits_is_refused(server):
    status, answer = post(server, "/v1/completions", {"model": "tiny-chat", "prompt": "hi", "seed": 2**64})
    assert status == 400 and answer["error"]["param"] == "seed"


# ---- a schema pattern that would compile for tens of seconds -----------------------------------------

@pytest.mark.parametrize("pattern, cost", [("^[a-z]{0,20000}$", 20000), ("^(([a-z]{0,100}){0,100})$", 10000)])
def test_a_pattern_with_large_repetition_counts_is_refused_before_it_compiles(server, pattern, cost):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    started = time.monotonic()
    status, answer = post(server, "/v1/chat/completions", body, within=10)  # was: 27 s of compiling, then 400
    assert status == 400, answer
    error = answer["error"]
    assert error["param"].startswith("response_format") and error["code"] == "unsupported_schema", error
    assert f"pattern repeating {cost} times (at most 1000)" in error["message"]
    assert "#/properties/code" in error["message"]
    assert time.monotonic() - started < 10


def test_a_schema_whose_patterns_together_would_compile_for_seconds_is_refused(server):
    """200 patterns each under the per-pattern bound took 7.8 s of CPU to compile: the schema's whole cost
    is budgeted."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{0,990}N$"}
                                               for i in range(200)}}
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    started = time.monotonic()
    status, answer = post(server, "/v1/chat/completions", body, within=10)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "response_format" and error["code"] == "schema_too_complex", error
    assert time.monotonic() - started < 5


def test_answers_do_not_name_the_web_server_behind(server):
    for path in ("/healthz", "/v1/models", "/nowhere"):
        assert "server" not in httpx.get(f"{server.url}{path}", timeout=10).headers, path


# ---- the control API --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, where, fragment", [
    ("apiVersion: deploykit/v1\n\u000e\n", ":2:1:", "a character YAML does not allow"),
    ("metadata: " + "[" * 900 + "]" * 900, ":1:75:", "nests deeper than 64 levels"),
])
def test_applying_yaml_the_reader_refuses_is_a_located_manifest_error(server, tmp_path, text, where, fragment):
    source = str(tmp_path / "bad.yaml")
    status, event = post(server, "/control/v1/apply", {"manifest": text, "source": source, "name": "x"}, TOKEN)
    assert status == 422, event
    assert event["event"] == "error" and event["kind"] == "manifest"
    [issue] = event["issues"]
    assert issue.startswith(source + where) and fragment in issue


def padded_size_manifest() -> str:
    """1 MiB of manifest whose shard size is "1", spaces and "#": the pattern ``^\\s*...\\s*$`` took most of
    an hour on it, holding the GIL (every request, /healthz and every reload stalled)."""
    head = ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: big}\nspec:\n"
            "  model: {path: /nowhere}\n  sharding: {max_shard_size: \"1")
    return head + " " * (2**20 - len(head) - 8) + '#"}\n'


def aliased_manifest() -> str:
    """52 KB of manifest whose one 50 KB label 30 aliases repeat: 1.5 MB once expanded (and 10 MB of
    text for the revision's record, from 52 KB, before aliases were counted in bytes)."""
    labels = f'    big: &big "{"x" * 50_000}"\n' + "".join(f"    l{i}: *big\n" for i in range(30))
    return ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata:\n  name: big\n  labels:\n" + labels
            + "spec:\n  model: {path: /nowhere}\n")


@pytest.mark.parametrize("path", ["/control/v1/apply", "/control/v1/diff"])
@pytest.mark.parametrize("text, where, fragment", [
    (padded_size_manifest(), ":6:30: spec.sharding.max_shard_size:", "a size is at most 64 characters"),
    (aliased_manifest(), ":6:10:", "expands to more than 1048576 characters of keys and values"),
], ids=["padded-size", "aliases"])
def test_a_manifest_that_would_stall_the_server_is_refused_at_once(server, tmp_path, path, text, where, fragment):
    source = str(tmp_path / "big.yaml")
    assert len(text.encode()) <= 2**20
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, server, path, {"manifest": text, "source": source, "name": "big"}, TOKEN, 30)
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200  # no stall meanwhile
        status, event = answer.result()
    assert status == 422 and event["kind"] == "manifest", event
    [issue] = event["issues"]
    assert issue.startswith(source + where) and fragment in issue, issue
    assert len(issue) < 400


HEAD = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: bounded}\nspec:\n"


@pytest.mark.parametrize("spec, where, fragment", [
    ("  model: {path: /nowhere}\n  rollout:\n    strategy: blue-green\n    gates: {golden: /dev/zero, "
     "max_nll_increase: 0.1}\n", ":8:21: spec.rollout.gates.golden:", "not a regular file"),
    ("  model: {path: /nowhere}\n  serving: {max_queued: " + "9" * 5000 + "}\n", ":6:25: spec.serving.max_queued:",
     "a number of 5000 digits"),
    ("  model: {path: /nowhere}\n  lifecycle: {keep_alive: 0x" + "f" * 20 + "}\n", ":6:27: spec.lifecycle.keep_alive:",
     "a duration is at most 366 days"),
], ids=["golden-device", "long-integer", "hex-duration"])
def test_a_dry_run_of_a_manifest_past_its_bounds_is_a_located_error(server, tmp_path, spec, where, fragment):
    source = str(tmp_path / "bounded.yaml")
    status, event = post(server, "/control/v1/apply", {"manifest": HEAD + spec, "source": source, "name": "bounded",
                                                       "dry_run": True}, TOKEN, within=10)
    assert status in (200, 422) and event["event"] == "error" and event["kind"] == "manifest", event
    assert any(issue.startswith(source + where) and fragment in issue for issue in event["issues"]), event


@pytest.mark.parametrize("path, body, param", [
    ("/control/v1/prune", {"directory": "/tmp/a\u0000b", "keep": []}, "directory"),
    ("/control/v1/prune", {"directory": "/tmp", "keep": ["a\u0000"]}, "keep.0"),
    ("/control/v1/rollback", {"name": "tiny-chat", "to_revision": 2**64}, "to_revision"),
    ("/control/v1/rollback", {"name": "tiny-chat", "to_revision": 0}, "to_revision"),
    ("/control/v1/delete", {"name": "a\u0000b"}, "name"),
    ("/control/v1/diff", {"manifest": "a: 1", "source": "/tmp/\u0000.yaml", "name": "x"}, "source"),
])
def test_the_control_api_names_a_bad_field(server, path, body, param):
    status, answer = post(server, path, body, TOKEN)
    assert status == 400 and answer["error"]["param"] == param, answer


# ---- headers: size and time --------------------------------------------------------------------------

def error_of(answer: bytes, status: int) -> dict:
    """The OpenAI-shaped error of a raw HTTP answer with this status."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


def answer_of(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (b"" when it resets it)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


@pytest.mark.parametrize("size", [2**20, 64 * 2**20], ids=["1MiB", "64MiB"])
def test_headers_larger_than_the_limit_are_refused(server, size):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
        sent = 0
        try:
            sock.sendall(head)
            while sent < size:
                sock.sendall(b"a" * 2**20)
                sent += 2**20
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading and closed: the rest was never taken
        answer = answer_of(sock)
    assert not answer.startswith(b"HTTP/1.1 200"), answer[:200]
    if answer:  # unless the close overtook it, the answer says why
        assert error_of(answer, 431)["code"] == "headers_too_large"
    assert sent < 64 * 2**20  # the server did not take a 64 MiB head
    assert httpx.get(f"{server.url}/v1/models", headers={"X-Fine": "a" * 8000}, timeout=30).status_code == 200


def test_headers_sent_too_slowly_are_cut_at_the_header_timeout(server):
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
    started, answers = time.monotonic(), {}
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(20)]
    try:
        sent = 0
        while len(answers) < len(socks) and time.monotonic() - started < 10:
            for sock in socks:
                if sock not in answers:
                    try:
                        sock.send(head[sent:sent + 1])  # one byte each, every 0.1 s at most
                    except (BrokenPipeError, ConnectionResetError):  # closed since the last look
                        answers[sock] = answer_of(sock)
            sent += 1
            readable, _, _ = select.select([s for s in socks if s not in answers], [], [], 0.1)
            for sock in readable:  # the server answered, and closes: read it all
                answers[sock] = answer_of(sock)
        elapsed = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    assert len(answers) == 20, f"{20 - len(answers)} dripping connections still open after 10 s"
    assert all(error_of(a, 408)["code"] == "request_timeout" for a in answers.values())
    assert HEADER_TIMEOUT <= elapsed < HEADER_TIMEOUT + 5  # the bytes kept coming: the deadline held


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(server):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        answer = answer_of(sock)
    assert error_of(answer, 408)["code"] == "request_timeout" and time.monotonic() - started < HEADER_TIMEOUT + 5


# ---- HTTP/1.0 and streams ----------------------------------------------------------------------------

def test_an_http_1_0_client_reads_a_stream_without_chunked_encoding(server):
    body = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        answer = answer_of(sock)  # HTTP/1.0: the stream ends when the server closes the connection
    head, _, stream = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower(), head
    events = [line[len(b"data: "):] for line in stream.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]" and all(e == b"[DONE]" or json.loads(e)["object"] == "text_completion"
                                           for e in events)
