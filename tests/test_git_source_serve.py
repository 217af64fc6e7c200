"""`deploykit serve --source` as a process: a push is applied when GitHub's or GitLab's webhook says so
(a missing signature 401, a wrong one 403), or on `POST /control/v1/sources/NAME/sync`; `deploykit
sources` shows it; a hung remote times out and SIGTERM during its fetch stops the server at once; the
credentials never show in the process list, the status or the logs."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gitrepos import SilentListener, commit_files, new_repo
from helpers import wait_until
from manifests import manifest_text
from servers import Server, get

TOKEN = "control-token-0123456789abcdef"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def write_source(path: Path, url: str, **spec: str) -> Path:
    extra = "".join(f"  {k}: {v}\n" for k, v in spec.items())
    path.write_text(f"apiVersion: deploykit/v1\nkind: GitSource\nmetadata: {{name: models}}\nspec:\n  url: {url}\n"
                    f"  ref: {{branch: main}}\n  path: manifests\n  interval: 1h\n{extra}")
    return path


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def source_status(server: Server) -> dict:
    status, body = get(f"{server.url}/control/v1/sources", HEADERS)
    assert status == 200, body
    return body[0]


def test_webhook_and_sync_route_apply_a_push_now(tmp_path, model):
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"manifests/tiny.yaml": manifest_text(model)}, "tiny")
    secret = tmp_path / "webhook-secret"
    secret.write_text("s3cret-webhook-key\n")
    source = write_source(tmp_path / "source.yaml", f"file://{repo}", webhook=f"{{secret_file: {secret}}}")
    with Server(None, tmp_path / "state", "--source", str(source), "--control-token", TOKEN) as server:
        assert source_status(server)["applied_commit"] == first
        second = commit_files(repo, {"manifests/tiny.yaml": manifest_text(model, shard="100KiB")}, "smaller shards")
        body = json.dumps({"ref": "refs/heads/main", "after": second}).encode()
        hook = f"{server.url}/hooks/sources/models"
        assert post(hook, body, {}) == 401
        assert post(hook, body, {"X-Hub-Signature-256": "sha256=" + "0" * 64}) == 403
        assert post(hook, body, {"X-Gitlab-Token": "wrong"}) == 403
        assert source_status(server)["fetched_commit"] == first  # nothing was fetched for them
        signature = "sha256=" + hmac.new(b"s3cret-webhook-key", body, hashlib.sha256).hexdigest()
        started = time.monotonic()
        assert post(hook, body, {"X-Hub-Signature-256": signature}) == 202
        wait_until(lambda: source_status(server)["phase"] == "Synced" and
                   source_status(server)["deployments"][0]["serving_commit"] == second, 60, "the push serves")
        assert time.monotonic() - started < 60

        third = commit_files(repo, {"manifests/tiny.yaml": manifest_text(model)}, "revert")
        assert post(f"{server.url}/control/v1/sources/models/sync", b"", {}) == 401
        assert post(f"{server.url}/control/v1/sources/models/sync", b"", HEADERS) == 202
        wait_until(lambda: source_status(server)["phase"] == "Synced" and
                   source_status(server)["deployments"][0]["serving_commit"] == third, 60, "the sync route fetches")
        cli = subprocess.run([sys.executable, "-m", "deploykit.cli", "sources"], capture_output=True, text=True,
                             env={**os.environ, "DEPLOYKIT_STATE": str(tmp_path / "state")}, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert f"applied {third[:12]}" in cli.stdout and "models" in cli.stdout
        status = subprocess.run([sys.executable, "-m", "deploykit.cli", "status"], capture_output=True, text=True,
                                env={**os.environ, "DEPLOYKIT_STATE": str(tmp_path / "state")}, timeout=60)
        assert f"commit {third[:12]}" in status.stdout and "git source models  Synced" in status.stdout, status.stdout

        fourth = commit_files(repo, {"manifests/tiny.yaml": manifest_text(model, shard="150KiB")}, "gitlab")
        assert post(hook, b"{}", {"X-Gitlab-Token": "s3cret-webhook-key"}) == 202
        wait_until(lambda: source_status(server)["applied_commit"] == fourth, 30, "GitLab's hook syncs")
        assert server.metric("deploykit_source_syncs_total", source="models") >= 3


def _processes() -> str:
    return subprocess.run(["ps", "-eww", "e", "-o", "args"], capture_output=True, text=True).stdout


def test_a_hung_fetch_times_out_and_sigterm_ends_it_without_showing_the_token(tmp_path):
    listener = SilentListener()
    token = "ghp_" + "x7" * 20
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    url = f"https://127.0.0.1:{listener.port}/models.git"
    source = write_source(tmp_path / "source.yaml", url, token_file=str(token_file), timeout="2s")
    try:
        with Server(None, tmp_path / "state", "--source", str(source), "--control-token", TOKEN,
                    "--log-level", "info", expect_ready=False) as server:
            wait_until(lambda: "timed out after 2s" in (source_status(server)["last_error"] or ""), 60,
                       "the hung fetch times out")
            status = source_status(server)
            assert status["phase"] == "Degraded" and status["applied_commit"] is None
            server_status = get(f"{server.url}/status", HEADERS)[1]
            post(f"{server.url}/control/v1/sources/models/sync", b"", HEADERS)
            wait_until(lambda: f"127.0.0.1:{listener.port}" in _processes(), 30, "git fetches again")
            processes = _processes()
            assert token not in processes and token not in json.dumps(status) + json.dumps(server_status)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)  # mid-fetch
            assert server.process.wait(30) == 0
            assert time.monotonic() - started < 20
            assert f"127.0.0.1:{listener.port}" not in _processes(), "git outlived the server"
        assert token not in server.stderr and "timed out" in server.stderr
    finally:
        listener.close()


def test_zero_failed_streams_across_a_pushed_commit(tmp_path):
    from chatmodel import build_chat_model
    from test_serve import chat_manifest
    from test_serve_reload import Streams

    model = build_chat_model(tmp_path / "model")
    repo = new_repo(tmp_path / "upstream")
    commit_files(repo, {"manifests/chat.yaml": chat_manifest(model, strategy="blue-green")}, "chat")
    source = write_source(tmp_path / "source.yaml", f"file://{repo}")
    with Server(None, tmp_path / "state", "--source", str(source), "--control-token", TOKEN) as server, \
            Streams(server.url) as streams:
        wait_until(lambda: len(streams.texts) >= 3, 90, "streams are answered")
        broken = commit_files(repo, {"manifests/chat.yaml": chat_manifest(model, strategy="blue-green", shard="300KiB"),
                                     "manifests/bad.yaml": "apiVersion: deploykit/v1\nkind: Nope\n"}, "broken")
        post(f"{server.url}/control/v1/sources/models/sync", b"", HEADERS)
        wait_until(lambda: source_status(server)["error_commit"] == broken, 30, "the broken commit is refused")
        pushed = commit_files(repo, {"manifests/bad.yaml": None}, "fixed")
        post(f"{server.url}/control/v1/sources/models/sync", b"", HEADERS)
        wait_until(lambda: source_status(server)["deployments"][0]["serving_commit"] == pushed, 90, "the push serves")
        served = len(streams.texts)
        wait_until(lambda: len(streams.texts) >= served + 3, 90, "streams go on")
        generation = get(f"{server.url}/status", HEADERS)[1][0]["generation"]
    assert generation == 2  # the broken commit loaded nothing; the fixed one, once
    assert streams.failures == []
    assert len(set(streams.texts)) == 1
