"""The llama.cpp engine's unhappy paths, in a real `deploykit serve` with a real llama-server: refused
requests release their generation (a reload then leaves one llama-server, SIGTERM none); a hung engine
(SIGSTOP) is found by its watchdog, killed and replaced, and its requests are answered within a bound; a
killed one (SIGKILL) is replaced without waiting for a request; restarts that fail back off, hold no request
thread, answer 503 with Retry-After and end `failed` with the reason in /status, which then says Degraded (not
ready, /readyz 503) while the engine is tried again until it starts; a decode loop that stalls while /health
still answers is found and replaced; a health probe ends when its stop event is set; a reaped engine's process
group is never signalled; the engine's environment holds none of deploykit's secrets and its log is bounded.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import smollm2_file, wait_until
from llamacpp import FrozenLoop, alive, engine_pids, llama_server, manifest
from servers import Server, get

from deploykit.engine.llamacpp.client import ProbeStopped, greedy_probe
from deploykit.engine.llamacpp.logring import LogRing
from deploykit.engine.llamacpp.process import LlamaServer, ServerOptions, _end_group
from deploykit.engine.llamacpp.runtime import ENGINE_WAIT_SECONDS
from deploykit.engine.llamacpp.supervisor import (
    FAILED_RETRY_SECONDS,
    HUNG_AFTER_SECONDS,
    RESTART_ATTEMPTS,
    WATCH_INTERVAL_SECONDS,
)

KEY = "test-api-key-0123"
TOKEN = "test-control-token-0123"  # with an API key set, /status answers the control token's holder only
KEYS = {"DEPLOYKIT_API_KEY": KEY, "DEPLOYKIT_TOKEN": TOKEN}
STATUS_HEADERS = {"Authorization": f"Bearer {TOKEN}"}
# a hung engine: found after HUNG_AFTER (+ a poll), killed, restarted; a request on it is answered by then
HANG_BOUND = HUNG_AFTER_SECONDS + 3 * WATCH_INTERVAL_SECONDS + ENGINE_WAIT_SECONDS + 15


@pytest.fixture(scope="module")
def gguf() -> Path:
    llama_server()
    return smollm2_file()


def _client(url: str, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=timeout)


def _chat(url: str, **extra: Any) -> str:
    answer = _client(url).chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}],
                                                  max_tokens=8, temperature=0, **extra)
    return answer.choices[0].message.content or ""


def _engine(url: str) -> dict[str, Any]:
    status, body = get(f"{url}/status", STATUS_HEADERS)
    assert status == 200, body
    [dep] = [d for d in body if d["name"] == "smol"]
    return dep  # type: ignore[no-any-return]


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_refused_requests_release_their_generation_so_a_reload_and_sigterm_leave_no_engine(gguf, tmp_path):
    path = tmp_path / "smol.yaml"
    path.write_text(manifest(gguf))
    server = Server(path, tmp_path / "state", env=KEYS)
    with server:
        assert server.process is not None
        [old] = engine_pids(server.process.pid)
        client = _client(server.url)
        for stream in (False, True):  # refused after the request pinned its generation
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=100000, stream=stream)
            assert err.value.body["param"] == "max_tokens", err.value.body  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="smol", prompt="hi", max_tokens=100000)
        assert err.value.body["param"] == "max_tokens", err.value.body  # type: ignore[index]
        assert _engine(server.url)["in_flight"] == 0  # every refused request gave its generation back
        path.write_text(manifest(gguf, engine=", threads: 2"))  # a new revision: a new llama-server
        pid = server.process.pid
        wait_until(lambda: (p := engine_pids(pid)) and old not in p and not alive(old), 120,
                   "the new generation serving and the old llama-server ended")
        [new] = engine_pids(pid)
        assert _chat(server.url)
    assert server.process.returncode == 0, server.stderr
    assert "threads still running" not in server.stderr, server.stderr[-2000:]
    assert not alive(old) and not alive(new)


def test_a_hung_engine_is_killed_and_replaced_and_its_requests_are_answered_within_a_bound(gguf, tmp_path):
    (tmp_path / "smol.yaml").write_text(manifest(gguf))
    with Server(tmp_path / "smol.yaml", tmp_path / "state", env=KEYS) as server:
        assert server.process is not None
        [hung] = engine_pids(server.process.pid)
        os.kill(hung, signal.SIGSTOP)
        started = time.monotonic()
        try:
            answer: str | int = _chat(server.url)  # served by the fresh process, or a 503
        except openai.APIStatusError as exc:
            answer = exc.status_code
            assert exc.status_code == 503 and exc.response.headers.get("retry-after"), exc
        assert time.monotonic() - started < HANG_BOUND, answer
        process = wait_until(lambda: (e := _engine(server.url)["engine_process"])["state"] == "ready"
                             and e["pid"] != hung and e, 120, "a fresh llama-server ready")
        assert process["crashes"] == 1 and process["restarts"] == 1, process
        assert "(hung)" in process["last_crash"] and str(hung) in process["last_crash"], process
        assert not alive(hung) and engine_pids(server.process.pid) == [process["pid"]]
        assert _chat(server.url)


def test_a_killed_engine_is_replaced_by_its_watchdog_and_time_to_first_token_counts_from_arrival(gguf, tmp_path):
    (tmp_path / "smol.yaml").write_text(manifest(gguf))
    with Server(tmp_path / "smol.yaml", tmp_path / "state",  # no key: /metrics is read below
                env={"DEPLOYKIT_TOKEN": TOKEN}) as server:
        assert server.process is not None
        pid = server.process.pid
        [first] = engine_pids(pid)
        os.kill(first, signal.SIGKILL)
        # no request needed: the watchdog sees the exit status and starts a fresh, checked process
        [second] = wait_until(lambda: (p := engine_pids(pid)) and first not in p and p, 60, "a fresh llama-server")
        wait_until(lambda: _engine(server.url)["engine_process"]["state"] == "ready", 60, "the fresh one ready")
        process = _engine(server.url)["engine_process"]
        assert process["pid"] == second and "status -9" in process["last_crash"], process

        # a request that arrives while the engine restarts waits for it: its time to first token says so
        before = server.metric("deploykit_time_to_first_token_seconds_sum", model_name="smol")
        os.kill(second, signal.SIGKILL)
        started = time.monotonic()
        stream = _client(server.url).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0,
            stream=True)
        next(iter(stream))
        seen = time.monotonic() - started
        for _ in stream:
            pass
        measured = server.metric("deploykit_time_to_first_token_seconds_sum", model_name="smol") - before
        assert measured >= seen - 0.25, (measured, seen)  # from the arrival, the restart's wait included


def _gated_binary(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A llama-server that starts the real one, unless a gate file says hang (a process that never answers)
    or fail (exit at once); every start is counted in a file."""
    real = llama_server().path
    hang, fail, starts = tmp_path / "hang", tmp_path / "fail", tmp_path / "starts"
    wrapper = tmp_path / "bin" / "llama-server"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\n"
                       f"case \"$1\" in --version) exec '{real}' \"$@\";; esac\n"
                       f"echo start >> '{starts}'\n"
                       f"if [ -e '{hang}' ]; then exec sleep 600; fi\n"
                       f"if [ -e '{fail}' ]; then echo 'refused to start (test gate)'; exit 3; fi\n"
                       f"exec '{real}' \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, hang, fail, starts


def _answer(url: str, out: list[tuple[int, str | None, float]]) -> None:
    started = time.monotonic()
    try:
        _chat(url)
        out.append((200, None, time.monotonic() - started))
    except openai.APIStatusError as exc:
        out.append((exc.status_code, exc.response.headers.get("retry-after"), time.monotonic() - started))


def test_failing_restarts_back_off_hold_no_request_thread_and_end_failed(gguf, tmp_path):
    wrapper, hang, fail, starts = _gated_binary(tmp_path)
    text = manifest(gguf, extra="  rollout: {health_check: {timeout: 25s}}\n")
    (tmp_path / "smol.yaml").write_text(text)
    env = {**KEYS, "DEPLOYKIT_LLAMA_SERVER": str(wrapper)}
    with Server(tmp_path / "smol.yaml", tmp_path / "state", env=env) as server:
        assert server.process is not None
        pid = server.process.pid
        [engine] = engine_pids(pid)
        hang.touch()
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: _engine(server.url)["engine_process"]["state"] == "restarting", 30, "restarting")
        threads = _threads(pid)
        answers: list[tuple[int, str | None, float]] = []
        clients = [threading.Thread(target=_answer, args=(server.url, answers)) for _ in range(12)]
        for c in clients:
            c.start()
        wait_until(lambda: _engine(server.url)["in_flight"] == 12, 30, "12 requests waiting for the engine")
        assert _threads(pid) - threads < 6, "requests waiting for a restart hold worker threads"
        for c in clients:
            c.join(ENGINE_WAIT_SECONDS + 30)
        assert len(answers) == 12 and {(s, r) for s, r, _ in answers} == {(503, "5")}, answers
        assert max(t for _, _, t in answers) < ENGINE_WAIT_SECONDS + 10, answers

        hang.unlink()
        fail.touch()  # every further start fails at once: backed off, then `failed`
        process = wait_until(lambda: (e := _engine(server.url)["engine_process"])["state"] == "failed" and e, 120,
                             "the engine failed after its restarts")
        assert "exited with status -9" in process["reason"] and "restarts failed" in process["reason"], process
        assert "refused to start (test gate)" in process["reason"], process
        assert len(starts.read_text().split()) == 1 + RESTART_ATTEMPTS  # the first start, then the bounded ones
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:  # answered at once; the reason is in /status
            _chat(server.url)
        assert err.value.status_code == 503 and "failed" in str(err.value) and time.monotonic() - started < 5
        assert "test gate" not in str(err.value) and "-9" not in str(err.value)  # the reason is the operator's
        assert len(starts.read_text().split()) == 1 + RESTART_ATTEMPTS  # a request starts nothing

        # failed is not ready: Degraded with the reason, /readyz 503, a metric; and it is tried again
        dep = _engine(server.url)
        assert dep["phase"] == "Degraded" and not dep["serving"], dep
        assert "restarts failed" in dep["last_error"] and "retrying every" in dep["last_error"], dep
        status, body = get(f"{server.url}/readyz", STATUS_HEADERS)
        assert status == 503 and body["not_ready"] == ["smol"], body
        assert _metric(server.url, "deploykit_engine_ready", deployment="smol") == 0
        fail.unlink()  # the next retry starts it: ready again, no reapply needed
        wait_until(lambda: _engine(server.url)["engine_process"]["state"] == "ready", FAILED_RETRY_SECONDS + 90,
                   "the failed engine started again by its retries")
        assert _engine(server.url)["phase"] == "Ready" and get(f"{server.url}/readyz", STATUS_HEADERS)[0] == 200
        assert _metric(server.url, "deploykit_engine_ready", deployment="smol") == 1
        assert _chat(server.url)
    assert server.process.returncode == 0, server.stderr
    assert not engine_pids(pid)


def _metric(url: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (behind the API key); 0 when absent."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


STALL = 4.0  # DEPLOYKIT_LLAMA_STALLED_AFTER in the stall test's server


def _ask(url: str, out: list[tuple[str, float]]) -> None:
    """One chat request; what it ended with (an answer, or the error a client sees) and when."""
    started = time.monotonic()
    try:
        _client(url, timeout=300).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Count to twenty."}], max_tokens=32, temperature=0)
        out.append(("answered", time.monotonic() - started))
    except openai.APIError as exc:
        out.append((type(exc).__name__, time.monotonic() - started))


def test_a_stalled_decode_loop_is_found_and_the_engine_replaced(gguf, tmp_path):
    """/health answers from llama-server's HTTP threads, so a stuck decode looked alive: its requests waited
    600 s per read. With requests in flight and no answer from the loop for STALL s, it is killed and replaced."""
    (tmp_path / "smol.yaml").write_text(manifest(gguf))
    env = {**KEYS, "DEPLOYKIT_LLAMA_STALLED_AFTER": str(STALL)}
    with Server(tmp_path / "smol.yaml", tmp_path / "state", env=env) as server:
        assert server.process is not None
        [stuck] = engine_pids(server.process.pid)
        asked: list[tuple[str, float]] = []
        with FrozenLoop(stuck):
            in_flight = threading.Thread(target=_ask, args=(server.url, asked))
            in_flight.start()
            process = wait_until(lambda: (e := _engine(server.url)["engine_process"])["state"] == "ready"
                                 and e["pid"] != stuck and e, STALL + 120, "a fresh llama-server after the stall")
            in_flight.join(120)
        assert "stalled" in process["last_crash"] and str(stuck) in process["last_crash"], process
        assert process["crashes"] == 1 and not alive(stuck)
        assert len(asked) == 1 and asked[0][1] < STALL + 120, asked  # ended with its engine, not at 600 s
        assert _chat(server.url)  # the fresh process answers


def test_the_health_probe_ends_when_its_stop_event_is_set(gguf):
    """A restart's health probe on an engine whose decode loop is stuck waited its whole timeout (120 s), and
    SIGTERM waited for it: it now ends within a poll of the stop event."""
    server = LlamaServer(ServerOptions(binary=llama_server().path, model=gguf, slots=1, context=512))
    server.start()
    try:
        server.wait_ready(120)
        assert server.pid is not None
        with FrozenLoop(server.pid):
            assert server.healthy() and not server.loop_answers()  # alive to /health, stuck to its loop
            stop, ended = threading.Event(), []

            def probe() -> None:
                try:
                    greedy_probe(server.socket, server.api_key, "Hello", max_tokens=4, timeout=60, stop=stop)
                    ended.append("answered")
                except ProbeStopped:
                    ended.append("stopped")

            waiting = threading.Thread(target=probe)
            waiting.start()
            waiting.join(2)
            assert waiting.is_alive()  # the stuck loop does not answer it
            stop.set()
            started = time.monotonic()
            waiting.join(10)
            assert ended == ["stopped"] and time.monotonic() - started < 2
    finally:
        server.stop(grace=0)


def test_a_reaped_engine_s_group_is_never_signalled():
    """Once the engine is reaped its pid, and so its process group id, may name someone else's group: stop
    must not signal it. Here the group lives on (a child) after its leader was reaped, and must survive."""
    leader = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & echo $!"], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
    assert leader.stdout is not None
    other = int(leader.stdout.readline())
    leader.wait()
    leader.stdout.close()
    try:
        _end_group(leader, 0, threading.Lock())
        assert alive(other)
    finally:
        os.kill(other, signal.SIGKILL)


def test_the_engine_gets_no_secret_and_listens_on_a_private_unix_socket(gguf, tmp_path):
    (tmp_path / "smol.yaml").write_text(manifest(gguf))
    secrets = {"DEPLOYKIT_API_KEY": KEY, "DEPLOYKIT_TOKEN": "control-token-4567", "HF_TOKEN": "hf_secret_89",
               "AWS_SECRET_ACCESS_KEY": "aws-secret-01", "OPENAI_API_KEY": "sk-secret-23",
               "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
               "ALL_PROXY": "http://127.0.0.1:9", "LLAMA_ARG_PORT": "65001"}
    with Server(tmp_path / "smol.yaml", tmp_path / "state", env={**secrets, "GGML_SCRUB_CHECK": "kept"}) as server:
        assert server.process is not None
        [engine] = engine_pids(server.process.pid)
        environ = dict(e.split(b"=", 1) for e in Path(f"/proc/{engine}/environ").read_bytes().split(b"\0") if e)
        values = b"\0".join(environ.values())
        for name, value in secrets.items():  # no such variable, and no secret under another name either
            assert name.encode() not in environ and value.encode() not in values, name
        assert environ[b"GGML_SCRUB_CHECK"] == b"kept" and b"LLAMA_API_KEY" in environ and b"PATH" in environ
        argv = Path(f"/proc/{engine}/cmdline").read_bytes().split(b"\0")
        sock = Path(argv[argv.index(b"--host") + 1].decode())
        assert sock.suffix == ".sock" and b"--port" not in argv and sock.is_socket()
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert _chat(server.url)  # the proxies of deploykit's environment are not used for the engine


def test_the_engine_log_is_a_bounded_ring():
    read, write = os.pipe()
    ring = LogRing(read, name="test-log-ring", limit=10_000)
    with os.fdopen(write, "wb") as out:
        for i in range(20_000):
            out.write(f"line {i} {'x' * 40}\n".encode())
    ring.close()
    assert ring.size() <= 10_000 + 4096
    assert ring.tail().endswith(f"line 19999 {'x' * 40}") and "line 0 " not in ring.tail(10**6)
