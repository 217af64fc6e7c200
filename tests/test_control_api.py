"""The CLI hands its work to a running `deploykit serve` through the control API (docs/control.md).

One real server process, and then another after `kill -9`: apply (the CLI process never imports torch
and stays small while the server loads a ~420 MB model once), no-op, change, rollback, history, delete,
broken manifests, a name owned by a watched file, wrong tokens, serialised applies of one name, the
server going away mid-apply, and `deploykit serve` without PATH restoring what was recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from chatmodel import build_chat_model
from deploykit.control.revisions.state import StateStore
from servers import Server, get

MiB = 2**20
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec
WRAP = ("import atexit, json, sys\nout = sys.argv.pop(1)\n"
        "def report():\n"
        "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "    json.dump({'peak': int(hwm.split()[1]) * 1024,\n"
        "               'heavy': sorted(m for m in ('torch', 'transformers', 'accelerate', 'fastapi') if m in sys.modules)},\n"
        "              open(out, 'w'))\n"
        "atexit.register(report)\nfrom deploykit.cli import main\nmain()\n")


def manifest(model: Path, name: str, *, max_tokens: int = 64, shard: str = "2GiB") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {model}, task: causal-lm, dtype: float32}}\n  placement: {{gpus: []}}\n"
            f"  sharding: {{max_shard_size: {shard}}}\n"
            f"  serving: {{max_tokens: {max_tokens}, default_max_tokens: 8}}\n")


def cli(*args: str, state: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "DEPLOYKIT_STATE": str(state), **(env or {})}, timeout=300)


def measured(*args: str, state: Path, report: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The CLI in a process that records its own peak RSS and which heavy modules it imported."""
    result = subprocess.run([sys.executable, "-c", WRAP, str(report), *args], capture_output=True, text=True,
                            env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=300)
    return result, json.loads(report.read_text())


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def post(url: str, body: dict, token: str | None) -> tuple[int, list[dict]]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, [json.loads(line) for line in r.read().splitlines() if line.strip()]
    except urllib.error.HTTPError as exc:
        return exc.code, [json.loads(exc.read())]


class Restored(Server):
    """`deploykit serve` without PATH."""

    def __init__(self, state: Path) -> None:
        super().__init__(Path("."), state)
        self.command.remove(".")


def build_big(directory: Path, tokenizer_from: Path) -> Path:
    """A random 8-layer Llama at hidden size 1024 (~420 MB of float32), with the chat model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    small = json.loads((tokenizer_from / "config.json").read_text())
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=small["vocab_size"], max_position_embeddings=256,
                         bos_token_id=small["bos_token_id"], eos_token_id=small["eos_token_id"],
                         pad_token_id=small["pad_token_id"])
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(directory, safe_serialization=True)
    for f in tokenizer_from.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, directory / f.name)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("models")
    chat = build_chat_model(root / "chat")
    return chat, build_big(root / "big", chat)


def test_cli_through_the_server(models, tmp_path):
    chat, big = models
    state, watched, api = tmp_path / "state", tmp_path / "watched", tmp_path / "api"
    watched.mkdir()
    api.mkdir()
    (watched / "owned.yaml").write_text(manifest(chat, "owned"))
    (api / "owned.yaml").write_text(manifest(chat, "owned", max_tokens=32))
    chat_yaml, big_yaml = api / "chat.yaml", api / "big.yaml"
    chat_yaml.write_text(manifest(chat, "chat"))
    big_yaml.write_text(manifest(big, "big", shard="150MiB"))

    server = Server(watched, state)
    with server:
        info = json.loads((state / "server.json").read_text())
        assert stat.S_IMODE((state / "server.json").stat().st_mode) == 0o600
        assert info["url"] == server.url and info["pid"] == server.process.pid

        # no token, a wrong token: 401 and nothing changes (the inference key never opens it either)
        body = {"manifest": chat_yaml.read_text(), "source": str(chat_yaml), "name": "chat"}
        for token in (None, "wrong", info["token"][:-1]):
            code, answer = post(f"{server.url}/control/v1/apply", body, token)
            assert code == 401 and answer[0]["error"]["code"] == "invalid_control_token"
        assert get(f"{server.url}/control/v1/status")[0] == 401
        assert StateStore(state).names() == ["owned"]

        applied = cli("apply", str(chat_yaml), state=state)
        assert applied.returncode == 0, applied.stderr
        assert "applied chat: revision 1 Ready" in applied.stdout and "sending to the deploykit server" in applied.stderr
        served = {m["id"] for m in get(f"{server.url}/v1/models")[1]["data"]}
        assert served == {"owned", "chat"}
        again = cli("apply", str(chat_yaml), "-o", "json", state=state)
        assert again.returncode == 0 and json.loads(again.stdout)[0]["status"] == "unchanged"

        # one owner per name: the watched file's deployment refuses API changes, naming the file
        owned = cli("apply", str(api / "owned.yaml"), state=state)
        assert owned.returncode == 1 and str(watched / "owned.yaml") in owned.stderr
        assert "owned by the watched file" in cli("delete", "owned", state=state).stderr
        itself = cli("apply", str(watched / "owned.yaml"), "-o", "json", state=state)  # "reconcile it now"
        assert itself.returncode == 0 and json.loads(itself.stdout)[0]["status"] == "unchanged", itself.stderr

        # broken manifests: located as in local mode; nothing that serves changes
        chat_yaml.write_text(manifest(chat, "chat").replace("max_tokens: 64", "max_tokns: 64"))
        typo = cli("apply", str(chat_yaml), state=state)
        assert typo.returncode == 2 and f"{chat_yaml}:8:" in typo.stderr and "did you mean" in typo.stderr
        chat_yaml.write_text(manifest(tmp_path / "nowhere", "chat"))
        missing = cli("apply", str(chat_yaml), state=state)
        assert missing.returncode == 2 and f"{chat_yaml}:5:" in missing.stderr, missing.stderr
        report = json.loads(cli("status", "chat", "-o", "json", state=state).stdout)
        assert (report["revision"], report["serving_revision"], report["serving"]) == (1, 1, True)

        chat_yaml.write_text(manifest(chat, "chat", max_tokens=48))  # a change: a new revision serves
        changed = cli("apply", str(chat_yaml), state=state)
        assert changed.returncode == 0 and "revision 2 Ready" in changed.stdout, changed.stderr

        # the big model: loaded once, by the server; the CLI stays small and never imports torch
        before = rss(server.process.pid)
        result, usage = measured("apply", str(big_yaml), "-o", "json", state=state, report=tmp_path / "usage.json")
        after = rss(server.process.pid)
        assert result.returncode == 0, result.stderr
        outcome = json.loads(result.stdout)[0]
        assert outcome["status"] == "applied" and outcome["reshard"]["files"] >= 3
        weights = sum(f.stat().st_size for f in big.glob("*.safetensors"))
        print(f"CLI peak RSS {usage['peak'] / MiB:.0f} MiB; server RSS {before / MiB:.0f} -> {after / MiB:.0f} "
              f"MiB (+{(after - before) / MiB:.0f} MiB) for {weights / MiB:.0f} MiB of weights")
        assert usage["heavy"] == [] and usage["peak"] < 300 * MiB
        assert 0.7 * weights < after - before < 1.5 * weights

        rolled = cli("rollback", "chat", state=state)
        assert rolled.returncode == 0 and "to the content of revision 1: now revision 3" in rolled.stdout
        rows = json.loads(cli("history", "chat", "-o", "json", state=state).stdout)
        assert [(r["revision"], r["phase"], r["current"]) for r in rows] == [
            (1, "Ready", False), (2, "Ready", False), (3, "Ready", True)]

        # two applies of one name: the second waits for the first and says so
        body = {"manifest": big_yaml.read_text(), "source": str(big_yaml), "name": "big", "force": True}
        answers: list[list[dict]] = []
        threads = [threading.Thread(target=lambda: answers.append(post(f"{server.url}/control/v1/apply", body,
                                                                       info["token"])[1])) for _ in range(2)]
        threads[0].start()
        deadline = time.monotonic() + 60  # the first holds the name once its revision is recorded
        while StateStore(state).latest("big").revision < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        threads[1].start()
        for t in threads:
            t.join()
        waits = [[e["message"] for e in a if e["event"] == "wait"] for a in answers]
        waited = [w for w in waits if w]
        assert len(waited) == 1 and waited[0][0].startswith("waiting for the apply of 'big' (started "), waits
        assert waited[0][1].startswith("waited ")
        assert sorted(a[-1]["revision"] for a in answers) == [2, 3]

        # the server goes away mid-apply: the CLI says so and fails; the last good revision stands
        gone = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "apply", str(big_yaml), "--force", "-q"],
                                env={**os.environ, "DEPLOYKIT_STATE": str(state)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while StateStore(state).latest("big").revision < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.process.send_signal(signal.SIGKILL)
        _, stderr = gone.communicate(timeout=60)
        assert gone.returncode == 1 and "went away during the apply of big" in stderr, stderr

    # a stale server.json (its process is gone) is ignored: the verbs work alone
    assert (state / "server.json").exists()
    local = cli("status", "-o", "json", state=state)
    assert local.returncode == 0 and "sending" not in local.stderr
    assert {r["name"] for r in json.loads(local.stdout)} == {"owned", "chat", "big"}

    with Restored(state) as restored:  # `deploykit serve` without PATH: every recorded deployment
        assert {m["id"] for m in get(f"{restored.url}/v1/models")[1]["data"]} == {"owned", "chat", "big"}
        reports = {r["name"]: r for r in json.loads(cli("status", "-o", "json", state=state).stdout)}
        assert reports["chat"]["serving_revision"] == 3 and reports["big"]["serving_revision"] == 3
        assert StateStore(state).latest("big").revision == 4  # the interrupted one never became current
        resumed = cli("apply", str(big_yaml), "-o", "json", state=state)  # confirms what serves
        assert resumed.returncode == 0 and json.loads(resumed.stdout)[0]["status"] == "unchanged"
        assert json.loads(cli("status", "big", "-o", "json", state=state).stdout)["phase"] == "Ready"
        code, answer = get(f"{restored.url}/v1/models")
        request = urllib.request.Request(f"{restored.url}/v1/completions", method="POST",
                                         data=json.dumps({"model": "chat", "prompt": "hi", "max_tokens": 4}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["choices"]

        # delete: stops serving, frees the memory, removes the shards
        shards = Path(StateStore(state).current("big").shards_path)
        assert shards.is_dir()
        before = rss(restored.process.pid)
        deleted = cli("delete", "big", state=state)
        assert deleted.returncode == 0 and "deleted big" in deleted.stdout, deleted.stderr
        assert not shards.exists() and "big" not in StateStore(state).names()
        assert {m["id"] for m in get(f"{restored.url}/v1/models")[1]["data"]} == {"owned", "chat"}
        assert before - rss(restored.process.pid) > 0.5 * weights
        info = json.loads((state / "server.json").read_text())
    assert restored.process.returncode == 0
    assert not (state / "server.json").exists()  # removed on a clean exit
