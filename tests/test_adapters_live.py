"""A manifest change of spec.adapters alone, applied live by a real `deploykit serve` under streaming load
from several clients: adapters are added and removed while the base's generation keeps serving (0 failed
requests, answers unchanged), /v1/models and /status follow, and each change is a revision."""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import openai

from helpers import wait_until
from lora import adapters_manifest, chat_ids, peft_reference
from manifests import replace_like_an_editor
from servers import Server

TOKENS = 16


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/status", timeout=30) as r:
        return dict(json.loads(r.read())[0])


def _models(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list().data}


class Load:
    """Clients streaming greedy chats to their model until stopped; every answer is checked."""

    def __init__(self, url: str, jobs: list[tuple[str, str]]) -> None:
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.stop = threading.Event()
        self.answers: list[list[tuple[str, str, str]]] = [[] for _ in jobs]
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i, *job)) for i, job in enumerate(jobs)]

    def _run(self, i: int, model: str, prompt: str) -> None:
        while not self.stop.is_set():
            try:
                chunks = self.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
                    stream=True)
                self.answers[i].append((model, prompt, "".join(c.choices[0].delta.content or ""
                                                               for c in chunks if c.choices)))
            except Exception as exc:  # every failure counts: the test requires none
                self.failures.append(f"{model}: {exc!r}")

    def counts(self) -> list[int]:
        return [len(a) for a in self.answers]

    def wait_each(self, more: int) -> None:
        """Until every client finished ``more`` further requests."""
        start = self.counts()
        wait_until(lambda: all(n >= s + more for n, s in zip(self.counts(), start)), timeout=180,
                   what=f"each client answered {more} more requests")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def test_adapters_added_and_removed_live_under_streaming_load(lora: Any, tmp_path: Path) -> None:
    expected = {(m, p): peft_reference(lora.base, a, chat_ids(lora.base, p), TOKENS)
                for m, a in (("chat", None), ("chat:pirate", lora.pirate), ("chat:polite", lora.polite))
                for p in ("hi", "hello")}
    manifests = tmp_path / "m"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate}))
    with Server(manifests, tmp_path / "state") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        before = _status(server.url)
        assert [a["name"] for a in before["adapters"]] == ["pirate"]
        jobs = [("chat", "hi"), ("chat", "hello"), ("chat:pirate", "hi"), ("chat:pirate", "hello")]
        with Load(server.url, jobs) as load:
            load.wait_each(1)
            replace_like_an_editor(path, adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite}))
            wait_until(lambda: "chat:polite" in _models(client), timeout=120, what="chat:polite is listed")
            added = wait_until(lambda: (st := _status(server.url))["revision"] == before["revision"] + 1 and st,
                               what="the added adapter's revision is current")
            reply = client.chat.completions.create(model="chat:polite", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=TOKENS, temperature=0)
            assert reply.choices[0].message.content == expected[("chat:polite", "hi")]
            load.wait_each(2)
            replace_like_an_editor(path, adapters_manifest(lora.base, {"pirate": lora.pirate}))
            wait_until(lambda: "chat:polite" not in _models(client), timeout=120, what="chat:polite is gone")
            removed = wait_until(lambda: (st := _status(server.url))["revision"] == before["revision"] + 2 and st,
                                 what="the removal's revision is current")
            try:
                client.chat.completions.create(model="chat:polite", messages=[{"role": "user", "content": "hi"}])
                raise AssertionError("a removed adapter answered")
            except openai.NotFoundError as exc:
                assert exc.body["param"] == "model"  # type: ignore[index]
            load.wait_each(2)
        assert load.failures == []
        assert [a for client_answers in load.answers for a in client_answers
                if a[2] != expected[(a[0], a[1])]] == []  # the base and pirate answered the same throughout
        assert _models(client) == {"chat", "chat:pirate"}
        # a change of anything else reloads as before, the adapters loaded into the new generation
        replace_like_an_editor(path, adapters_manifest(lora.base, {"pirate": lora.pirate}, max_tokens=48))
        wait_until(lambda: _status(server.url)["generation"] == removed["generation"] + 1, timeout=120,
                   what="a new generation serves")
        reply = client.chat.completions.create(model="chat:pirate", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=TOKENS, temperature=0)
        assert reply.choices[0].message.content == expected[("chat:pirate", "hello")]
        assert _models(client) == {"chat", "chat:pirate"}
    # one generation served it all; each change was a revision of its own (waited for above)
    assert before["generation"] == added["generation"] == removed["generation"]
    sizes = {s: {a["name"]: a["bytes"] for a in st["adapters"]} for s, st in (("added", added), ("removed", removed))}
    assert sizes["added"]["polite"] > 0 and sizes["added"]["pirate"] == sizes["removed"]["pirate"]
    assert set(sizes["removed"]) == {"pirate"}  # its memory went with it: the accounting holds the rest only


def test_under_a_host_budget_a_live_adapter_change_needs_room_for_its_bytes_only(lora: Any, tmp_path: Path) -> None:
    """Two generations do not fit in this budget (blue-green could not reload), one with its adapters does."""
    manifests = tmp_path / "m"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    blue_green = "  rollout: {strategy: blue-green}\n"
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate}) + blue_green)
    with Server(manifests, tmp_path / "state", "--budget", "cpu=600KiB") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        before = _status(server.url)
        assert 2 * before["budget"]["bytes"] > 600 * 1024  # a second generation would not fit
        replace_like_an_editor(path, adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite})
                               + blue_green)
        after = wait_until(lambda: (st := _status(server.url))["revision"] == before["revision"] + 1 and st,
                           timeout=120, what="the added adapter's revision is current")
        assert "chat:polite" in _models(client)
    polite = next(a["bytes"] for a in after["adapters"] if a["name"] == "polite")
    assert after["generation"] == before["generation"]  # applied live, not as a second generation
    assert after["budget"]["bytes"] == before["budget"]["bytes"] + polite
