"""examples/service.py keeps answering while its manifest changes (a real process, real HTTP)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from conftest import REPO
from deploykit.control.revisions.report import status_report
from deploykit.control.revisions.state import StateStore
from manifests import manifest_text, replace_like_an_editor
from test_gitops import free_port, wait_for


def post(port: int, sentences: list[str]) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/embed", data=json.dumps(
        {"sentences": sentences}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def test_service_answers_through_reloads(tiny_model, tmp_path):
    model = Path(shutil.copytree(tiny_model("bert"), tmp_path / "bert"))
    from transformers import BertTokenizerFast

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "good",
                                "morning"] + [f"w{i}" for i in range(247)]))
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(model)
    manifest = tmp_path / "bert.yaml"
    manifest.write_text(manifest_text(model, name="bert", task="feature-extraction"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "examples" / "service.py"), str(manifest),
                             "--port", str(port)], env={**os.environ, "DEPLOYKIT_STATE": str(tmp_path / "s")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    failures, answers, stop = [], [], threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answers.append(post(port, ["hello world", "good morning"]))
            except Exception as exc:
                failures.append(repr(exc))

    try:
        assert wait_for(lambda: post(port, ["hello"])["generation"] == 1)
        first = post(port, ["hello world", "good morning"])["embeddings"]
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        replace_like_an_editor(manifest, manifest_text(model, name="bert", task="feature-extraction",
                                                       cpu=100_000))
        assert wait_for(lambda: answers and answers[-1]["generation"] == 2)
        replace_like_an_editor(manifest, "kind: [broken\n")
        store = StateStore(tmp_path / "s")
        assert wait_for(lambda: status_report(store, "bert")["last_error"] is not None)  # the service saw it
        replace_like_an_editor(manifest, manifest_text(model, name="bert", task="feature-extraction"))
        assert wait_for(lambda: answers[-1]["generation"] == 3)
        stop.set()
        for t in threads:
            t.join()
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert failures == []
    assert {a["generation"] for a in answers} >= {2, 3}
    assert all(a["embeddings"] == first for a in answers)  # the same weights give the same numbers
