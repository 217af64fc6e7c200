"""Reloads while clients stream: blue-green, recreate and a broken manifest, with zero failed streams.

A real `deploykit serve` watches a directory; three clients stream chat completions through the official
`openai` client without pause while the manifest is rewritten. Every stream must finish (a finish
reason, then [DONE]) with the same greedy text, and new generations must take over."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from chatmodel import build_chat_model
from manifests import replace_like_an_editor
from servers import Server
from test_serve import chat_manifest


class Streams:
    def __init__(self, url: str, clients: int = 3) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.stop = threading.Event()
        self.texts: list[str] = []
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(clients)]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                chunks = list(self.client.chat.completions.create(
                    model="tiny-chat", messages=[{"role": "user", "content": "tell me"}], max_tokens=24,
                    temperature=0, stream=True))
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
                if reasons[-1] != "length":
                    self.failures.append(f"stream ended with {reasons[-1]!r}")
                self.texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            except Exception as exc:  # every failure counts: the test requires none
                self.failures.append(repr(exc))

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def status(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        return json.loads(r.read())[0]


def wait_for(predicate, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)



def test_zero_failed_streams_across_reloads(tmp_path):
    model = build_chat_model(tmp_path / "model")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    path.write_text(chat_manifest(model, strategy="blue-green"))
    with Server(manifests, tmp_path / "state") as server, Streams(server.url) as streams:
        wait_for(lambda: len(streams.texts) >= 3)
        replace_like_an_editor(path, chat_manifest(model, strategy="blue-green", shard="300KiB"))
        wait_for(lambda: status(server.url)["generation"] == 2)
        served = len(streams.texts)
        wait_for(lambda: len(streams.texts) >= served + 3)
        replace_like_an_editor(path, chat_manifest(model, strategy="recreate", shard="200KiB"))
        wait_for(lambda: status(server.url)["generation"] == 3)
        replace_like_an_editor(path, chat_manifest(model, strategy="recreate").replace("max_shard_size", "max_shard_sze"))
        wait_for(lambda: "max_shard_sze" in (status(server.url)["last_error"] or ""))
        assert status(server.url)["generation"] == 3  # the broken manifest changed nothing that serves
        served = len(streams.texts)
        wait_for(lambda: len(streams.texts) >= served + 3)
        replace_like_an_editor(path, chat_manifest(model, strategy="auto", shard="400KiB"))
        wait_for(lambda: status(server.url)["generation"] == 4)
        served = len(streams.texts)
        wait_for(lambda: len(streams.texts) >= served + 3)
    assert streams.failures == []
    assert len(set(streams.texts)) == 1 and len(streams.texts) >= 12  # same weights, same greedy answer
    final = [line for line in server.stderr.splitlines() if "stopped" in line]
    assert final and server.process is not None and server.process.returncode == 0
