"""The llama.cpp engine end to end: a real `deploykit serve` runs a real llama-server on the SmolLM2 GGUF.

Greedy answers through deploykit equal llama-server's alone with the same flags (chat and completions,
plain, streamed and concurrent); deploykit's own 400s come first; a llama-server killed with SIGKILL fails
its in-flight request at once and the next request is served by a fresh, checked process; SIGTERM of
`deploykit serve` leaves no llama-server behind, and neither does SIGKILL (the engine's watcher). Unset
sampling fields are the OpenAI API's defaults; logit_bias and seed are checked; relayed requests are counted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from helpers import smollm2_file, wait_until
from llamacpp import alive, engine_pids, llama_server, manifest
from servers import Server, free_port, get

from deploykit.engine.llamacpp.process import ServerOptions
from deploykit.engine.llamacpp.sampling import sampling_fields

CHATS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea."]
PROMPTS = ["The capital of France is", "Once upon a time"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def gguf() -> Path:
    llama_server()
    return smollm2_file()


@pytest.fixture(scope="module")
def server(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("llamacpp")
    named = root / "modèle ü-模型.gguf"  # a path no answer may show, in any encoding
    named.symlink_to(gguf)
    (root / "smol.yaml").write_text(manifest(named))
    with Server(root / "smol.yaml", root / "state") as served:
        yield served
    assert served.process is not None and served.process.returncode == 0, served.stderr


@pytest.fixture(scope="module")
def alone(gguf: Path) -> Iterator[str]:
    """llama-server alone, with the flags deploykit gives it (slots 2, context 512 per slot)."""
    options = ServerOptions(llama_server().path, gguf, slots=2, context=512)
    port = free_port()
    proc = subprocess.Popen([str(options.binary), "--host", "127.0.0.1", "--port", str(port), *options.flags()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ok(f"{url}/health"), 120, "llama-server alone loaded")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _ok(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)


def _chat(client: openai.OpenAI, model: str, text: str, *, stream: bool = False) -> str:
    messages = [{"role": "user", "content": text}]
    if not stream:
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return answer.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_greedy_answers_equal_llama_server_alone(server, alone):
    ours, theirs = _client(server.url), _client(alone)
    expected = {text: _chat(theirs, "x", text) for text in CHATS}
    assert all(expected.values())
    for text in CHATS:
        assert _chat(ours, "smol", text) == expected[text]
        assert _chat(ours, "smol", text, stream=True) == expected[text]
    answers: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, _chat(ours, "smol", CHATS[i % 3],
                                                                                 stream=i % 2 == 0)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [answers[i] for i in range(4)] == [expected[CHATS[i % 3]] for i in range(4)]
    for prompt in PROMPTS:
        mine = ours.completions.create(model="smol", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        alone_answer = theirs.completions.create(model="x", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert mine.choices[0].text == alone_answer.choices[0].text and mine.model == "smol"
        assert mine.usage is not None and mine.usage.completion_tokens == MAX_TOKENS


def test_answers_name_neither_the_gguf_nor_llama_cpps_build_nor_the_web_server(server):
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=180) as streamed:
        raw = b"".join(streamed.iter_bytes())
    plain = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=180)
    assert plain.status_code == 200 and b"data: [DONE]" in raw
    for answer, headers in ((raw, streamed.headers), (plain.content, plain.headers)):
        for leak in ("modèle".encode(), b"gguf", b"b0-unknown", b"system_fingerprint", b"chatcmpl-upstream"):
            assert leak not in answer, (leak, answer[:400])
        assert "server" not in headers


def test_the_engine_gets_a_thread_per_slot_and_the_queue_stays_in_deploykit(server):
    assert server.process is not None
    [pid] = engine_pids(server.process.pid)
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--threads-http") + 1] == b"6"  # 2 slots + 4, whatever max_queued (64) is


def test_deploykit_refuses_first_with_its_own_400s(server):
    client = _client(server.url)
    stepped = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "number", "multipleOf": 5}}}
    cases = [({"response_format": stepped}, "response_format"),  # llama.cpp's grammar would not follow it
             ({"max_tokens": 65}, "max_tokens"), ({"top_logprobs": 2}, "top_logprobs")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], **extra)
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smol", prompt="hi", echo=True, max_tokens=2)
    assert err.value.body["param"] == "echo"  # type: ignore[index]
    seeded = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            temperature=0.9, seed=7, logprobs=True, top_logprobs=2, n=2,
                                            presence_penalty=0.5, stop=["\n\n"])
    assert len(seeded.choices) == 2 and seeded.choices[0].logprobs is not None


def test_each_prompt_takes_a_place_in_the_slots_and_more_prompts_than_places_are_a_400(server):
    client = _client(server.url)
    room = 2 + 64  # engine.slots + serving.max_queued (the default)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smol", prompt=["hi"] * (room + 1), max_tokens=1)
    assert err.value.body["param"] == "prompt" and err.value.body["code"] == "too_many_prompts"  # type: ignore[index]
    assert len(client.completions.create(model="smol", prompt=["hi"] * 3, max_tokens=1).choices) == 3
    both = client.completions.create(model="smol", prompt=PROMPTS, n=2, max_tokens=2)  # n per prompt, as documented
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]
    streamed = client.completions.create(model="smol", prompt=PROMPTS, n=2, max_tokens=2, stream=True)
    assert sorted({c.index for chunk in streamed for c in chunk.choices}) == [0, 1, 2, 3]


def test_slots_count_places_not_requests():
    from deploykit.engine.admission import QueueFull
    from deploykit.engine.llamacpp.runtime import Slots

    slots = Slots(1, 0)
    with pytest.raises(QueueFull):
        slots.enter(2)  # a request of 2 prompts does not fit 1 slot and no queue
    slots.enter(1)
    assert slots.stats() == {"running": 0, "waiting": 1}  # admitted; running once it holds a turn (sent)
    with pytest.raises(QueueFull):
        slots.enter(1)
    slots.leave(1)
    slots = Slots(2, 3)
    slots.enter(4)
    assert slots.stats() == {"running": 0, "waiting": 4}
    with pytest.raises(QueueFull):
        slots.enter(2)  # 4 + 2 places > 2 slots + 3 queued
    slots.leave(4)
    assert slots.stats() == {"running": 0, "waiting": 0}


def test_a_library_call_waits_for_a_free_slot_as_a_request_does():
    import asyncio

    from deploykit.engine.llamacpp.runtime import Slots

    slots = Slots(1, 1)
    slots.enter()
    asyncio.run(slots.turn())  # an HTTP request holds the one slot
    slots.enter()
    library = threading.Thread(target=slots.turn_blocking)  # Deployment.chat's turn, on its own thread
    library.start()
    wait_until(lambda: len(slots._waiters) == 1, 30, "the library call to queue for its turn")
    assert library.is_alive()  # not sent while the slot is taken
    slots.leave(turned=True)  # the request ends: its turn passes to the library call
    library.join(30)
    assert not library.is_alive()
    slots.leave(turned=True)
    assert slots.stats() == {"running": 0, "waiting": 0}


def test_unset_sampling_fields_are_the_openai_apis_defaults_not_llama_servers(server, alone):
    """No temperature, top_p, top_k or min_p from the client: sampled as OpenAI's temperature 1, top_p 1 and no
    truncation (llama-server alone, told so explicitly, answers the same), not as llama-server's defaults."""
    ours, theirs = _client(server.url), _client(alone)
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    own_defaults_differ = False
    for seed in (1, 2, 3):
        mine = ours.chat.completions.create(model="smol", messages=messages, max_tokens=24, seed=seed)
        explicit = theirs.chat.completions.create(model="x", messages=messages, max_tokens=24, seed=seed,
                                                  temperature=1, top_p=1, extra_body={"top_k": 0, "min_p": 0})
        assert mine.choices[0].message.content == explicit.choices[0].message.content
        unset = theirs.chat.completions.create(model="x", messages=messages, max_tokens=24, seed=seed)
        own_defaults_differ |= unset.choices[0].message.content != explicit.choices[0].message.content
    assert own_defaults_differ  # llama-server's own defaults (0.8, 0.95, 40, 0.05) sample differently


def test_a_greedy_request_leaves_llama_cpp_one_candidate_and_answers_as_without_truncation(server, alone):
    """temperature 0 is sent top_k 1 (llama.cpp would otherwise run its samplers over the whole vocabulary
    for every token); the text and the logprobs equal llama-server alone's without truncation."""
    assert sampling_fields(temperature=0.0, top_p=1.0, seed=None)["top_k"] == 1
    assert sampling_fields(temperature=0.7, top_p=1.0, seed=None)["top_k"] == 0
    messages = [{"role": "user", "content": CHATS[1]}]
    mine = _client(server.url).chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0,
                                                       logprobs=True, top_logprobs=3)
    theirs = _client(alone).chat.completions.create(model="x", messages=messages, max_tokens=12, temperature=0,
                                                    logprobs=True, top_logprobs=3, top_p=1,
                                                    extra_body={"top_k": 0, "min_p": 0})
    assert mine.choices[0].message.content == theirs.choices[0].message.content
    assert mine.choices[0].logprobs and theirs.choices[0].logprobs

    def tops(answer):  # type: ignore[no-untyped-def]
        return [[(t.token, round(t.logprob, 4)) for t in c.top_logprobs] for c in answer.choices[0].logprobs.content]

    assert tops(mine) == tops(theirs)


def test_logit_bias_and_seed_must_fit_the_model_and_llama_cpp(server):
    client = _client(server.url)
    messages = [{"role": "user", "content": "hi"}]
    n_vocab = 49152  # SmolLM2's vocabulary
    for extra, param in [({"logit_bias": {str(n_vocab): 5}}, "logit_bias"), ({"logit_bias": {"-1": 5}}, "logit_bias"),
                         ({"seed": 2**32 - 1}, "seed"), ({"seed": -1}, "seed"), ({"seed": 2**40}, "seed")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smol", messages=messages, max_tokens=2, **extra)
        assert err.value.body["param"] == param, (extra, err.value.body)  # type: ignore[index]
    for extra in ({"logit_bias": {str(n_vocab - 1): 5}}, {"seed": 2**32 - 2}, {"seed": 0}):
        assert client.chat.completions.create(model="smol", messages=messages, max_tokens=2, **extra).choices


def test_relayed_requests_are_counted(server):
    client = _client(server.url)
    before = server.metric("deploykit_generation_requests_total", model_name="smol")
    ttfts = server.metric("deploykit_time_to_first_token_seconds_count", model_name="smol")
    assert _chat(client, "smol", CHATS[0]) and _chat(client, "smol", CHATS[1], stream=True)
    assert server.metric("deploykit_generation_requests_total", model_name="smol") == before + 2
    assert server.metric("deploykit_time_to_first_token_seconds_count", model_name="smol") == ttfts + 1


def test_structured_output_follows_its_schema_and_tools_are_refused(server):
    """response_format goes to llama.cpp's own grammar support: the answers validate."""
    client = _client(server.url)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    answer = client.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                            response_format=fmt)  # type: ignore[arg-type]
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)
    chunks = client.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                            response_format=fmt, stream=True)  # type: ignore[arg-type]
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                           response_format={"type": "json_object"})
    text = whole.choices[0].message.content or ""
    assert text.lstrip().startswith("{"), text  # an object, whole unless max_tokens cut it
    assert whole.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text
    tool = {"type": "function", "function": {"name": "weather", "parameters": schema}}
    with pytest.raises(openai.BadRequestError) as err:  # llama-server would answer in free text
        client.chat.completions.create(model="smol", messages=messages, max_tokens=8, tools=[tool],  # type: ignore[list-item]
                                       tool_choice="required")
    assert err.value.body["param"] == "tools"  # type: ignore[index]


def test_the_engine_runs_in_a_session_of_its_own_as_llama_server_alone_does(server):
    """With the kernel's autogroup scheduling a session is one scheduling group: an engine inside deploykit's
    session shared deploykit's CPU share, unlike llama-server alone (bench/llamacpp.py)."""
    assert server.process is not None
    [pid] = engine_pids(server.process.pid)
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # a session and a group of its own
    assert os.getsid(pid) != os.getsid(server.process.pid)
    groups = [Path(f"/proc/{p}/autogroup") for p in (pid, server.process.pid)]
    # Kernels with CONFIG_SCHED_AUTOGROUP name the group; with autogroup off (or in some containers) the file
    # exists and reads empty, and the session checks above are all there is to compare.
    names = [g.read_text().split()[:1] if g.exists() else [] for g in groups]
    if all(names):
        assert names[0] != names[1]


def test_a_killed_engine_fails_its_request_at_once_and_the_next_one_gets_a_fresh_process(server):
    assert server.process is not None
    [pid] = engine_pids(server.process.pid)
    client = _client(server.url)
    stream = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Tell a long story."}],
                                            max_tokens=64, temperature=0, stream=True)
    next(iter(stream))  # generating now
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - started < 5
    assert _chat(client, "smol", CHATS[0])  # a fresh process (the watchdog's), health-checked first
    [fresh] = engine_pids(server.process.pid)
    assert fresh != pid and not alive(pid)
    [status] = [d for d in get(f"{server.url}/status")[1] if d["name"] == "smol"]
    process = status["engine_process"]  # the death is reported
    assert process["pid"] == fresh and process["crashes"] == 1 and "status -9" in process["last_crash"], process
    assert process["state"] == "ready" and process["restarts"] == 1, process


def test_sigterm_and_sigkill_of_deploykit_leave_no_llama_server(gguf, tmp_path):
    (tmp_path / "smol.yaml").write_text(manifest(gguf))
    server = Server(tmp_path / "smol.yaml", tmp_path / "state")
    with server:
        assert server.process is not None
        pids = wait_until(lambda: engine_pids(server.process.pid), 30, "llama-server started")  # type: ignore[union-attr]
    assert server.process.returncode == 0, server.stderr
    assert "threads still running" not in server.stderr
    assert not any(alive(p) for p in pids)

    killed = Server(tmp_path / "smol.yaml", tmp_path / "state")
    with killed:
        assert killed.process is not None
        pids = wait_until(lambda: engine_pids(killed.process.pid), 30, "llama-server started")  # type: ignore[union-attr]
        killed.process.kill()
        wait_until(lambda: not any(alive(p) for p in pids), 10, "llama-server ended with its parent")


def test_responses_and_messages_are_refused_for_llama_cpp(server):
    """llama-server computes chat completions only: the Responses and Messages faces say so (the lease is
    given back: a chat request after them is answered)."""
    import httpx

    for route, body in (("/v1/responses", {"model": "smol", "input": "hi"}),
                        ("/v1/messages", {"model": "smol", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert "unsupported_engine" in r.text or "not served for llama.cpp" in r.text, r.text
    assert _chat(_client(server.url), "smol", CHATS[0])
