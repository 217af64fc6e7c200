"""Guarantees of the control layer against a real `deploykit serve`, each once broken by a feature that
came later: an error clears when the file is fixed back to what serves; a request for a listed model
waits for the load it needs and is answered; deployments of one checkpoint start together, every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

from chatmodel import build_chat_model
from helpers import wait_until
from manifests import replace_like_an_editor
from servers import Server, free_port, get

CHAT = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: {name}}}
spec:
  model: {{path: {path}, task: causal-lm, dtype: float32}}
  placement: {{gpus: []}}
  sharding: {{max_shard_size: {shard}, path: shards-{name}}}
  serving: {{max_tokens: 16}}
"""


def chat_manifest(model: Path, name: str = "chat", shard: str = "10MiB") -> str:
    return CHAT.format(name=name, path=model, shard=shard)


def status_of(server: Server, name: str) -> dict:
    _, body = get(f"{server.url}/status")
    return next((s for s in body if s.get("name") == name), {})


def cli_status(state: Path, name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "deploykit.cli", "status", name, "-o", "json"],
                         env={**os.environ, "DEPLOYKIT_STATE": str(state)}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_error_clears_when_the_file_is_written_back_to_what_serves(tmp_path):
    model = build_chat_model(tmp_path / "model")
    served = tmp_path / "served"
    served.mkdir()
    path = served / "chat.yaml"
    original = chat_manifest(model)
    path.write_text(original)
    with Server(served, tmp_path / "state") as server:
        replace_like_an_editor(path, original.replace("max_shard_size", "max_shard_sise"))
        wait_until(lambda: status_of(server, "chat").get("last_error"), 30, "the schema error shows")
        assert "max_shard_sise" in status_of(server, "chat")["last_error"]
        replace_like_an_editor(path, original)  # byte for byte what serves
        wait_until(lambda: status_of(server, "chat").get("last_error") is None, 30, "the error clears")
        now = status_of(server, "chat")
        assert now["phase"] == "Ready", now
        assert now["generation"] == 1, now  # the same generation serves: nothing was reloaded
        failed = next(c for c in now["conditions"] if c["type"] == "Failed")
        assert failed["status"] is False, failed
        recorded = cli_status(tmp_path / "state", "chat")
        assert recorded["last_error"] is None and recorded["phase"] == "Ready", recorded
    assert "threads still running" not in server.stderr, server.stderr  # every thread joined at exit


def _ask_as_soon_as_listed(url: str, name: str, results: list, failures: list) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    wait_until(lambda: name in _listed(url), 120, f"{name} is listed")
    try:
        results.append(client.completions.create(model=name, prompt="hello", max_tokens=4, temperature=0))
    except Exception as exc:  # every failure counts
        failures.append(repr(exc))


def _listed(url: str) -> list[str]:
    try:
        _, body = get(f"{url}/v1/models")
    except OSError:
        return []
    return [m["id"] for m in body.get("data", [])] if isinstance(body, dict) else []


def _ready(url: str) -> bool:
    try:
        return get(f"{url}/readyz")[0] == 200
    except OSError:
        return False


def test_a_listed_model_is_answered_once_loaded_after_a_restart(tmp_path):
    """After kill -9, `deploykit serve` with no PATH restores the recorded deployment; a client that
    asks as soon as /v1/models lists it waits for the restore and is answered."""
    model = build_chat_model(tmp_path / "model", layers=4, hidden=128)
    served = tmp_path / "served"
    served.mkdir()
    path = served / "chat.yaml"
    path.write_text(chat_manifest(model))
    state = tmp_path / "state"
    env = {**os.environ, "DEPLOYKIT_STATE": str(state)}
    applied = subprocess.run([sys.executable, "-m", "deploykit.cli", "apply", str(path)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert applied.returncode == 0, applied.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "deploykit.cli", "serve", "--port", str(port)]
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _ready(url), 180, "the first server is ready")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    (state / "server.json").unlink(missing_ok=True)  # kill -9 leaves it behind
    second = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    results: list = []
    failures: list = []
    try:
        asker = threading.Thread(target=_ask_as_soon_as_listed, args=(url, "chat", results, failures))
        asker.start()
        asker.join(300)
    finally:
        second.send_signal(signal.SIGTERM)
        _, stderr = second.communicate(timeout=60)
    assert not failures, (failures, stderr)
    assert results and results[0].choices[0].text is not None


def test_requests_for_a_model_still_loading_wait_and_are_answered(tmp_path):
    """Several clients ask while the first load of a served file runs: every one is answered."""
    model = build_chat_model(tmp_path / "model", layers=4, hidden=128)
    served = tmp_path / "served"
    served.mkdir()
    (served / "chat.yaml").write_text(chat_manifest(model, shard="200KiB"))  # a reshard: a slower first load
    server = Server(served, tmp_path / "state")
    results: list = []
    failures: list = []
    askers = [threading.Thread(target=_ask_as_soon_as_listed, args=(server.url, "chat", results, failures))
              for _ in range(3)]
    for asker in askers:
        asker.start()
    with server:
        for asker in askers:
            asker.join(300)
        assert not failures, failures
        assert len(results) == 3


@pytest.mark.parametrize("attempt", range(10))
def test_deployments_of_one_tied_checkpoint_start_together(tiny_model, tmp_path, attempt):
    """Two deployments of one tied-embedding checkpoint, both eager, under a budget: both serve."""
    model = tiny_model("llama-tied")
    served = tmp_path / "served"
    served.mkdir()
    for name in ("tied-a", "tied-b"):
        (served / f"{name}.yaml").write_text(chat_manifest(model, name=name))
    with Server(served, tmp_path / "state", "--budget", "cpu=4GiB") as server:
        names = sorted(s["name"] for s in get(f"{server.url}/status")[1] if s.get("phase") == "Ready")
        assert names == ["tied-a", "tied-b"], get(f"{server.url}/status")[1]


def _stream_until(url: str, stop: threading.Event, latencies: list, failures: list) -> None:
    import time

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    while not stop.is_set():
        started = time.monotonic()
        try:
            for _ in client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=16, stream=True):
                pass
            latencies.append(time.monotonic() - started)
        except Exception as exc:  # every failure counts
            failures.append(repr(exc))


@pytest.mark.parametrize("strategy", ["blue-green", "recreate"])
def test_rewrites_under_streaming_load_stall_no_request_longer_than_a_reload(tmp_path, strategy):
    """Three rewrites of the manifest while clients stream: nothing fails, and no request waits longer
    than the longest reload took (plus what a request takes on its own)."""
    model = build_chat_model(tmp_path / "model", hidden=256, layers=8, intermediate=1024)
    served = tmp_path / "served"
    served.mkdir()
    path = served / "chat.yaml"
    rollout = f"  rollout: {{strategy: {strategy}}}\n"
    path.write_text(chat_manifest(model, shard="2MiB") + rollout)
    with Server(served, tmp_path / "state") as server:
        stop, latencies, failures = threading.Event(), [], []
        clients = [threading.Thread(target=_stream_until, args=(server.url, stop, latencies, failures))
                   for _ in range(3)]
        for client in clients:
            client.start()
        wait_until(lambda: len(latencies) >= 6, 60, "a few answers before the rewrites")
        alone = max(latencies)
        for generation, shard in ((2, "1MiB"), (3, "3MiB"), (4, "4MiB")):
            replace_like_an_editor(path, chat_manifest(model, shard=shard) + rollout)
            wait_until(lambda: status_of(server, "chat").get("generation", 0) >= generation, 120,
                       f"generation {generation} serves")
        answered = len(latencies)
        wait_until(lambda: len(latencies) >= answered + 3, 60, "answers after the last reload")
        stop.set()
        for client in clients:
            client.join(120)
        longest = status_of(server, "chat")["reloads"]["longest_seconds"]
    assert not failures, failures
    assert max(latencies) <= longest + 2 * alone + 1.0, (max(latencies), longest, alone)


def _broken_adapter(base: Path, to: Path) -> Path:
    """A real PEFT adapter of ``base`` whose weights file was cut short: its header and config pass
    validation, loading it (when the generation's runtime is built) fails."""
    from lora import train_adapter

    adapter = train_adapter(base, to, text="user: hi\nassistant: arr", steps=1)
    _truncate(adapter)
    return adapter


def _truncate(adapter: Path) -> None:
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])


def adapter_manifest(model: Path, *, strategy: str, shard: str = "10MiB", adapter: Path | None = None) -> str:
    text = chat_manifest(model, shard=shard) + f"  rollout: {{strategy: {strategy}}}\n"
    return text + (f"  adapters:\n    - {{name: a, path: {adapter}}}\n" if adapter is not None else "")


@pytest.mark.parametrize("strategy", ["blue-green", "recreate"])
def test_a_revision_whose_runtime_cannot_be_built_is_never_recorded_ready(tmp_path, strategy):
    """The new generation loads and passes its health check, then building its runtime fails (a broken
    adapter): the revision is Failed, the store's current revision is still the one that serves, and the
    last Ready revision answers (a recreate loads it again)."""
    from deploykit import Deployment

    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(adapter_manifest(model, strategy=strategy))
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        path.write_text(adapter_manifest(model, strategy=strategy, shard="1MiB",
                                         adapter=_broken_adapter(model, tmp_path / "broken")))
        assert dep.reload() is False
        history = [(r.revision, r.phase) for r in dep.store.history("chat")]
        assert history == [(1, "Ready"), (2, "Failed")], history
        assert "SafetensorError" in (dep.store.history("chat")[-1].reason or "")
        assert dep.store.current("chat").revision == 1  # type: ignore[union-attr]
        current = dep.pool.current
        assert current is not None and current.revision == 1
        assert dep.generate("Hello", max_tokens=2).text is not None
        status = dep.status()
        assert status["revision"] == 1 and status["serving"] and "SafetensorError" in status["last_error"]
    finally:
        dep.close()


def test_when_nothing_can_serve_requests_get_a_prompt_503_saying_why(tmp_path):
    """A recreate whose new runtime cannot be built, and whose restore of the last Ready revision fails too
    (its adapter broke on disk since): nothing serves and nothing will by itself. Requests are answered at
    once with an OpenAI-shaped 503 that says why, instead of waiting `acquire_timeout` (300 s); the server
    stops promptly."""
    import time

    from lora import train_adapter

    model = build_chat_model(tmp_path / "model")
    adapter = train_adapter(model, tmp_path / "adapter", text="user: hi\nassistant: arr", steps=1)
    served = tmp_path / "served"
    served.mkdir()
    path = served / "chat.yaml"
    path.write_text(adapter_manifest(model, strategy="recreate", adapter=adapter))
    with Server(served, tmp_path / "state") as server:
        _truncate(adapter)  # revision 1 cannot be loaded again
        replace_like_an_editor(path, adapter_manifest(model, strategy="recreate", shard="1MiB", adapter=adapter))
        wait_until(lambda: "SafetensorError" in (status_of(server, "chat").get("last_error") or ""), 120,
                   "the recreate fails")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="chat", prompt="hello", max_tokens=2)
        assert time.monotonic() - started < 10
        assert refused.value.status_code == 503
        body = refused.value.body
        error = body.get("error", body) if isinstance(body, dict) else {}
        assert error.get("param") == "model", body
        assert error.get("code") == "model_load_failed", error  # a code to the API key's holder, not the paths
        status = status_of(server, "chat")  # the why, to the control token's holder
        assert status["phase"] == "Failed" and not status["serving"], status
        assert "recreate failed" in (status.get("last_error") or "") or "SafetensorError" in (status.get("last_error") or ""), status
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 30


def test_a_deployment_whose_watch_cannot_start_is_closed_not_leaked(tmp_path):
    """``from_manifest(watch=True)`` whose watch fails (its directory is gone by then) raises, and the
    deployment it started is closed: no change thread left, its model freed."""
    import shutil

    from deploykit import Deployment

    started: list = []

    class LosesItsDirectory(Deployment):
        def start(self, **options) -> None:  # type: ignore[no-untyped-def, override]
            super().start(**options)
            started.append(self)
            shutil.rmtree(self.manifest_path.parent)  # the watch that follows has nothing to watch

    model = build_chat_model(tmp_path / "model")
    served = tmp_path / "served"
    served.mkdir()
    (served / "chat.yaml").write_text(chat_manifest(model, shard="2GiB"))
    with pytest.raises(OSError):
        LosesItsDirectory.from_manifest(served / "chat.yaml", state_dir=tmp_path / "state", watch=True)
    [dep] = started
    assert dep.pool.current is None and dep.phase_state.phase == "Closed", dep.status()
    assert not [t.name for t in threading.enumerate() if t.name == "deploykit-change-chat"]


def test_a_pool_view_is_one_moment_revision_included(tmp_path):
    """``PoolView.revision`` is read with the generation, under the pool's lock: a live adapter change that
    relabels the generation afterwards does not change a view already taken."""
    from deploykit import Deployment

    model = build_chat_model(tmp_path / "model")
    path = tmp_path / "chat.yaml"
    path.write_text(chat_manifest(model, shard="2GiB"))
    with Deployment.from_manifest(path, state_dir=tmp_path / "state") as dep:
        view = dep.pool.view()
        current = dep.pool.current
        assert current is not None and view.revision == 1
        current.revision = 2  # what a live adapter change does to the serving generation
        assert view.revision == 1 and dep.pool.view().revision == 2
