"""What an API key's holder is told, against a real `deploykit serve`: a model that cannot load is a 503 with
a stable code and a message that names no file, argv, environment or log line; the reason, paths included, is
the operator's (the server log, and ``/status`` behind the control token). With ``--control-socket`` the
control API answers on that unix socket only, where the CLI finds it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from chatmodel import build_chat_model
from servers import Server, get
from test_budget import manifest

TOKEN = "control-token-for-exposure-tests"
KEY = "sk-exposure-tests-key"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("exposure") / "model")


def test_a_failed_load_tells_the_client_a_code_not_the_paths(tmp_path, chat_model):
    """An on-demand model whose checkpoint is broken before its first load: the /v1 answer names no path of
    the model or the state dir; ``/status`` with the control token still says what failed."""
    model = tmp_path / "model"
    model.mkdir()
    for f in chat_model.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "lazy.yaml").write_text(manifest(model, "lazy"))
    state = tmp_path / "state"
    with Server(tmp_path / "m", state, "--budget", "cpu=900KB", "--api-key", KEY, "--control-token", TOKEN) as server:
        for weights in model.glob("*.safetensors"):
            weights.write_bytes(b"\0" * 64)  # a checkpoint broken on disk after the server planned it
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "lazy", "prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert answer.status_code == 503, answer.text
        for secret in (str(model), str(state), str(tmp_path), "safetensors"):
            assert secret not in answer.text, answer.text
        error = answer.json()["error"]
        assert error["code"] == "model_load_failed" and error["param"] == "model"
        assert "'lazy'" in error["message"] and "deploykit status" in error["message"]
        status, body = get(f"{server.url}/status", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        [lazy] = [s for s in body if s.get("name") == "lazy"]
        assert str(model) in json.dumps(lazy), lazy  # the operator still sees which file failed
    assert str(model) in server.stderr  # and the server log has the whole reason


# ---- the control API on a listener of its own -------------------------------------------------------------

def cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=300)


def test_the_control_api_on_a_unix_socket_is_not_on_the_network_listener(tmp_path, chat_model):
    """``--control-socket``: the socket is this user's alone (0600), server.json names it, the CLI applies and
    reads status over it, and ``/control`` on the TCP listener is a 404 even with the control token."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "lazy.yaml").write_text(manifest(chat_model, "lazy"))
    state, control = tmp_path / "state", tmp_path / "control.sock"
    with Server(tmp_path / "m", state, "--api-key", KEY, "--control-token", TOKEN, "--control-socket",
                str(control)) as server:
        assert stat.S_ISSOCK(control.stat().st_mode) and stat.S_IMODE(control.stat().st_mode) == 0o600
        assert json.loads((state / "server.json").read_text())["control"] == f"unix:{control}"
        for path in ("/control/v1/status", "/control/v1/deployments", "/control"):
            refused = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert refused.status_code == 404, (path, refused.text)
        applied_yaml = tmp_path / "api.yaml"
        applied_yaml.write_text(manifest(chat_model, "applied", load="eager"))
        applied = cli("apply", str(applied_yaml), state=state)
        assert applied.returncode == 0, applied.stderr
        shown = cli("status", state=state)
        assert shown.returncode == 0 and "applied" in shown.stdout and "lazy" in shown.stdout, shown.stderr
        answer = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                            json={"model": "applied", "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text  # applied over the socket, served on the network listener
    assert server.process is not None and server.process.returncode == 0, server.stderr
    assert not control.exists()  # removed on a clean exit
