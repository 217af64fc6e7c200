"""A llama.cpp deployment's lifecycle in a real `deploykit serve`: a hot reload under streaming load fails no
request (the new llama-server is checked before traffic moves, the old one ends once drained); keep-alive and
the host budget unload a deployment by ending its llama-server, and a request loads it again; the library's
``Deployment.chat``/``generate`` answer through llama-server too, and closing the deployment ends it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import openai

from helpers import smollm2_file, wait_until
from llamacpp import alive, engine_pids, llama_server, manifest
from servers import Server


def _ask(url: str, model: str, *, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=180)
    messages = [{"role": "user", "content": "Say hello."}]
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    return answer.choices[0].message.content or ""


class _Load:
    """Clients streaming chats in a loop until stopped; every failure is kept."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.done, self.failures = url, 0, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                assert _ask(self.url, "smol", stream=True)
                self.done += 1
            except Exception as exc:  # counted: the test asserts there are none
                self.failures.append(repr(exc))

    def __enter__(self) -> _Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)


def test_hot_reload_under_streaming_load_fails_nothing(tmp_path: Path):
    llama_server()
    gguf = smollm2_file()
    path = tmp_path / "smol.yaml"
    path.write_text(manifest(gguf))
    with Server(path, tmp_path / "state") as server:
        assert server.process is not None
        [old] = engine_pids(server.process.pid)
        with _Load(server.url, 3) as load:
            wait_until(lambda: load.done >= 3, 120, "streams served before the reload")
            path.write_text(manifest(gguf, engine=", threads: 2"))  # a new revision: a new llama-server
            wait_until(lambda: (p := engine_pids(server.process.pid)) and old not in p, 180,  # type: ignore[union-attr]
                       "the new generation serving and the old llama-server gone")
            before = load.done
            wait_until(lambda: load.done >= before + 3, 120, "streams served after the reload")
        assert load.failures == [], load.failures[:3]
        [new] = engine_pids(server.process.pid)
        assert not alive(old) and "--threads 2" in Path(f"/proc/{new}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_keep_alive_and_the_budget_end_the_process_and_a_request_loads_again(tmp_path: Path):
    llama_server()
    gguf = smollm2_file()
    # each plan: the GGUF's tensors (~92 MiB) + a KV cache of 2 slots x 512 tokens (~22 MiB) + the logits of a
    # 512-token micro-batch (96 MiB): one fits in 300 MiB, not two
    text = (manifest(gguf, name="brief", extra="  lifecycle: {load: eager, keep_alive: 1s}\n") + "---\n"
            + manifest(gguf, name="later", extra="  lifecycle: {load: on-demand}\n"))
    (tmp_path / "m.yaml").write_text(text)
    with Server(tmp_path / "m.yaml", tmp_path / "state", "--budget", "cpu=300MiB") as server:
        assert server.process is not None
        pid = server.process.pid
        [first] = wait_until(lambda: engine_pids(pid), 60, "brief loaded")
        wait_until(lambda: not engine_pids(pid) and not alive(first), 60, "keep-alive ended brief's llama-server")
        assert _ask(server.url, "later")  # loads on demand
        [later] = engine_pids(pid)
        assert _ask(server.url, "brief")  # no room for both: idle 'later' is evicted, its process ends
        [again] = engine_pids(pid)
        assert again not in (first, later) and not alive(later)


def test_the_library_answers_through_llama_server_and_closing_ends_it(tmp_path: Path):
    from deploykit import Deployment
    from deploykit.engine.admission import QueueFull
    from deploykit.engine.text import RequestError

    llama_server()
    (tmp_path / "smol.yaml").write_text(manifest(smollm2_file()))
    with Deployment.from_manifest(tmp_path / "smol.yaml", state_dir=tmp_path / "state") as dep:
        pids = engine_pids(os.getpid())
        answer = dep.chat([{"role": "user", "content": "Say hello."}], max_tokens=12)
        assert answer.text and answer.completion_tokens <= 12 and answer.prompt_tokens > 0
        assert dep.generate("The capital of France is", max_tokens=4).completion_tokens == 4
        try:
            dep.generate("x", max_tokens=65)
            raise AssertionError("max_tokens above spec.serving.max_tokens was served")
        except RequestError as exc:
            assert exc.param == "max_tokens"
        gen = dep.pool.try_pin()
        assert gen is not None
        slots = gen.runtime.engine
        dep.pool.release(gen)
        slots.enter(slots.slots + slots.max_queued)  # every place taken, as by requests over HTTP
        try:
            dep.generate("The capital of France is", max_tokens=2)
            raise AssertionError("a library call was served past the engine's slots and queue")
        except QueueFull:
            pass
        finally:
            slots.leave(slots.slots + slots.max_queued)
        assert dep.generate("The capital of France is", max_tokens=2).completion_tokens == 2
        assert slots.stats() == {"running": 0, "waiting": 0}
    assert len(pids) == 1 and not alive(pids[0])
