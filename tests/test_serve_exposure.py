"""What an API key's holder is told, against a real `deploykit serve`: a model that cannot load is a 503 with
a stable code and a message that names no file, argv, environment or log line; the reason, paths included, is
the operator's (the server log, and ``/status`` behind the control token).
"""

from __future__ import annotations

import json
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
