"""`deploykit serve` killed (-9) in the middle of a canary's step and started again over the same state
directory: it comes back serving the last promoted revision, the candidate's revision is recorded Failed
"interrupted by a restart at step k" (history and status say so, never Ready, never "the applying process
died"), requests are answered by the old revision, and a new apply works afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from chatmodel import build_chat_model
from helpers import wait_until
from servers import Server, get
from traffic import Load

from deploykit.control.revisions.state import StateStore
from test_canary_interrupt import manifest as canary_manifest

CLI = [sys.executable, "-m", "deploykit.cli"]


def manifest(model: Path, shard: str, *, step_seconds: str = "300s") -> str:
    return canary_manifest(model, shard, step_seconds=step_seconds, limit="600s")


def cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env={**os.environ, "DEPLOYKIT_STATE": str(state)}, capture_output=True,
                          text=True, check=False, timeout=300)


def chat_status(server: Server) -> dict[str, Any]:
    code, body = get(f"{server.url}/status")
    assert code == 200, body
    return next(s for s in body if s.get("name") == "chat")


def kill_at_the_first_step(server: Server, state: Path, start_change: Callable[[], object]) -> None:
    """Under traffic, ``start_change`` (a canary's change), then kill -9 the server once the state store
    records the canary's first step (50%)."""
    load = Load(server.url, model="chat").run()
    try:
        start_change()
        wait_until(lambda: ((r := StateStore(state).get("chat", 2)) is not None
                            and (r.progress or {}).get("step") == 1 and (r.progress or {}).get("share") == 50),
                   timeout=180,
                   what="the canary's first step recorded in the state store")
        assert server.process is not None
        server.process.kill()  # no handler runs: only what the store holds survives
        server.process.wait(timeout=30)
    finally:
        load.stop.set()
    load.join()


def test_a_restart_in_the_middle_of_a_canary_serves_the_promoted_revision_and_fails_the_candidate(
        tmp_path: Path) -> None:
    model = build_chat_model(tmp_path / "model")
    state = tmp_path / "state"
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(manifest(model, "2GiB"))
    new.write_text(manifest(model, "1MiB"))  # the same weights laid out otherwise: a healthy change

    assert cli("apply", str(old), state=state).returncode == 0  # no server yet: recorded, served when it starts
    with Server(None, state) as server:
        applying: list[subprocess.Popen[str]] = []
        try:
            kill_at_the_first_step(server, state, lambda: applying.append(subprocess.Popen(
                [*CLI, "apply", str(new)], env={**os.environ, "DEPLOYKIT_STATE": str(state)},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        finally:
            for process in applying:
                process.kill()
                process.communicate()

    history = StateStore(state).history("chat")
    assert [(r.revision, r.phase) for r in history] == [(1, "Ready"), (2, "Progressing")]  # as the kill left it

    with Server(None, state) as server:
        now = chat_status(server)
        assert now["serving_revision"] == 1 and now["revision"] == 1, now
        assert "interrupted by a restart at step 1 of 2 (50% of new requests)" in (now["last_error"] or ""), now
        assert "process died" not in json.dumps(now)
        conditions = {c["type"]: c for c in now["conditions"]}
        assert conditions["Ready"]["status"] is True and conditions["Failed"]["reason"] == "Revision2Failed"
        rows = json.loads(cli("history", "chat", "-o", "json", state=state).stdout)
        assert [(r["revision"], r["phase"], r["current"]) for r in rows] == [(1, "Ready", True),
                                                                              (2, "Failed", False)]
        assert rows[1]["reason"].startswith("interrupted by a restart at step 1 of 2"), rows[1]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answered = client.chat.completions.with_raw_response.create(
            model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert answered.headers["x-deploykit-revision"] == "1"

        new.write_text(manifest(model, "1MiB", step_seconds="1s"))  # short steps, each with its request
        load = Load(server.url, model="chat").run()
        try:
            again = cli("apply", str(new), state=state)
        finally:
            load.join()
        assert again.returncode == 0, again.stderr
        assert "revision 3 Ready" in again.stdout, again.stdout
        assert load.failures == []
        assert chat_status(server)["serving_revision"] == 3


def test_a_watched_file_restarted_mid_canary_serves_the_promoted_revision_and_runs_its_canary_again(
        tmp_path: Path) -> None:
    """`deploykit serve FILE`: the file still names the candidate's manifest after the restart. The server
    serves the last promoted revision first and rolls the file out from it through its canary again (a new
    revision), never loading it unjudged because nothing served yet."""
    model = build_chat_model(tmp_path / "model")
    state, path = tmp_path / "state", tmp_path / "chat.yaml"
    path.write_text(manifest(model, "2GiB"))
    with Server(path, state) as server:
        kill_at_the_first_step(server, state, lambda: path.write_text(manifest(model, "1MiB")))

    with Server(path, state) as server:
        assert chat_status(server)["serving_revision"] == 1  # ready: the last promoted revision serves
        answered = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) \
            .completions.with_raw_response.create(model="chat", prompt="hello", max_tokens=2)
        assert answered.headers["x-deploykit-revision"] in ("1", "3")  # the promoted one, or the new canary's
        wait_until(lambda: (chat_status(server)["rollout"] or {}).get("revision") == 3, timeout=120,
                   what="the file's manifest rolled out again as a canary")
        now = chat_status(server)
        assert now["serving_revision"] == 1 and now["phase"] == "Progressing", now
        history = [(r.revision, r.phase, r.reason) for r in StateStore(state).history("chat")]
        assert history[0][:2] == (1, "Ready") and history[2][:2] == (3, "Progressing"), history
        assert history[1][:2] == (2, "Failed") and history[1][2].startswith("interrupted by a restart at step 1")


def test_an_on_demand_deployment_restarted_mid_canary_loads_the_promoted_revision_then_runs_the_canary(
        tmp_path: Path) -> None:
    """`load: on-demand`: after the restart nothing is loaded and the file names the candidate. The first
    request loads the last promoted revision and is answered by it; the file then rolls out from it through
    its canary (a new revision). It was loaded unjudged at that first request."""
    model = build_chat_model(tmp_path / "model")
    state, path = tmp_path / "state", tmp_path / "chat.yaml"
    on_demand = "  lifecycle: {load: on-demand}\n"
    path.write_text(manifest(model, "2GiB") + on_demand)
    client = lambda server: openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)  # noqa: E731
    with Server(path, state) as server:
        first = client(server).completions.with_raw_response.create(model="chat", prompt="hello", max_tokens=2)
        assert first.headers["x-deploykit-revision"] == "1"  # loaded on demand
        kill_at_the_first_step(server, state, lambda: path.write_text(manifest(model, "1MiB") + on_demand))

    with Server(path, state) as server:
        answered = client(server).completions.with_raw_response.create(model="chat", prompt="hello", max_tokens=2)
        assert answered.headers["x-deploykit-revision"] == "1"  # the promoted revision, not the candidate
        wait_until(lambda: (chat_status(server)["rollout"] or {}).get("revision") == 3, timeout=120,
                   what="the file's manifest rolled out as a canary from the promoted revision")
        now = chat_status(server)
        assert now["serving_revision"] == 1 and now["phase"] == "Progressing", now
        history = [(r.revision, r.phase) for r in StateStore(state).history("chat")]
        assert history == [(1, "Ready"), (2, "Failed"), (3, "Progressing")], history


def test_an_on_demand_file_whose_change_rolled_out_from_the_promoted_revision_still_follows_the_file(
        tmp_path: Path) -> None:
    """`load: on-demand` and a watched file changed while the server was down: the first request loads the
    promoted revision and the file's change rolls out from it through its canary. The file still rules
    afterwards: an edit is a new revision (the rolled-out manifest is not kept as if the API had given it)."""
    model = build_chat_model(tmp_path / "model")
    state, path = tmp_path / "state", tmp_path / "chat.yaml"
    on_demand = "  lifecycle: {load: on-demand}\n"
    path.write_text(manifest(model, "2GiB", step_seconds="1s") + on_demand)
    client = lambda server: openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)  # noqa: E731
    with Server(path, state) as server:
        first = client(server).completions.with_raw_response.create(model="chat", prompt="hello", max_tokens=2)
        assert first.headers["x-deploykit-revision"] == "1"
    path.write_text(manifest(model, "1MiB", step_seconds="1s") + on_demand)  # changed while nothing runs

    with Server(path, state) as server:
        load = Load(server.url, model="chat").run()  # the canary's steps each need a request
        try:
            wait_until(lambda: chat_status(server)["serving_revision"] == 2, timeout=180,
                       what="the file's change rolled out from the promoted revision and promoted")
            path.write_text(manifest(model, "3MiB", step_seconds="1s") + on_demand)
            wait_until(lambda: chat_status(server)["serving_revision"] == 3, timeout=180,
                       what="the next edit of the file rolled out too")
        finally:
            load.stop.set()
            load.join()
        assert load.failures == []
