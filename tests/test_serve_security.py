"""The control plane as a privilege boundary, against a real `deploykit serve` (docs/control.md#security-model).

The control token changes deployments within the policy the operator set when starting the server: a
manifest sent to /control/v1 that names an engine binary, remote code, a Ray cluster or a path outside
the allowed roots is a 403 naming the field, before anything runs (no `--version` of the binary, even for a
dry run or a diff); a server started allowing them lets them through; a watched file is held to the same
policy (tests/test_admission_gate.py: every path a manifest takes to become live).
The server speaks TLS when given a certificate: the official `openai` client and the `deploykit` CLI
verify it (a self-signed one made here).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatmodel import build_chat_model
from helpers import wait_until
from servers import Server
from test_serve import chat_manifest

TOKEN = "control-token-for-security-tests"
KEY = "sk-security-tests-key"
HEAD = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made with `cryptography` (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "deploykit test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def trusting(server: Server) -> ssl.SSLContext | bool:
    """What httpx verifies the server with: its own certificate for https, else the default."""
    return ssl.create_default_context(cafile=server.cafile) if server.cafile else True


def evil_binary(directory: Path) -> tuple[Path, Path]:
    """A program that leaves a mark when it runs, and says it is a llama-server."""
    marker, script = directory / "ran", directory / "evil.sh"
    script.write_text(f"#!/bin/sh\necho run >> {marker}\necho 'version: 1 (not llama.cpp)'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, marker


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("security")
    (root / "manifests").mkdir()
    (root / "allowed").mkdir()
    (root / "manifests" / "chat.yaml").write_text(chat_manifest(build_chat_model(root / "allowed" / "chat")))
    return root


@pytest.fixture(scope="module")
def strict(root):
    """TLS, the default policy, and paths only under <root>/allowed and the watched directory."""
    cert, key = self_signed(root)
    with Server(root / "manifests", root / "state-strict", "--control-token", TOKEN, "--tls-cert", str(cert),
                "--tls-key", str(key), "--allow-path", str(root / "allowed"), "--allow-path",
                str(root / "manifests"), "--drain-timeout", "2", cafile=str(cert)) as s:
        yield s
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def permissive(root):
    """Everything allowed, an API key, /openapi.json, 2 s deadlines for a body and for a stream's send; the
    secrets read from files. Both servers drain for 2 s at most when the module ends (a test's connection
    left open kept one draining for ~20 s)."""
    (root / "token").write_text(TOKEN + "\n")
    (root / "key").write_text(KEY + "\n")
    with Server(root / "manifests", root / "state-permissive", "--control-token-file", str(root / "token"),
                "--allow-engine-binary", "--allow-remote-code", "--allow-cluster", "--api-key-file", str(root / "key"),
                "--openapi", "--body-timeout", "2", "--stream-send-timeout", "2", "--drain-timeout", "2") as s:
        yield s


def control(server: Server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One control API call; a streamed answer is read to its last event."""
    with httpx.Client(verify=trusting(server), timeout=120) as client:
        response = client.post(f"{server.url}/control/v1{path}", json=body,
                               headers={"Authorization": f"Bearer {TOKEN}"})
    lines = [json.loads(line) for line in response.text.splitlines() if line.strip()]
    return response.status_code, lines[-1]


def manifest(tmp_path: Path, name: str, spec: str) -> dict[str, Any]:
    source = tmp_path / f"{name}.yaml"
    source.write_text(HEAD.format(name=name) + spec)
    return {"manifest": source.read_text(), "source": str(source), "name": name}


def refusals(root: Path, tmp_path: Path) -> list[tuple[str, str, int]]:
    """(manifest spec, the field refused, its line in the file)."""
    chat = root / "allowed" / "chat"
    script, _ = evil_binary(tmp_path)
    return [
        (f"  model: {{path: {chat}.gguf}}\n  engine: {{name: llama.cpp, binary: {script}}}\n", "spec.engine.binary", 6),
        (f"  model: {{path: {chat}, trust_remote_code: true}}\n", "spec.model.trust_remote_code", 5),
        (f"  model: {{path: {chat}}}\n  cluster: {{address: local}}\n", "spec.cluster", 6),
        (f"  model: {{path: {tmp_path}}}\n", "spec.model.path", 5),
        (f"  model: {{path: {chat}}}\n  sharding: {{path: /etc/deploykit-shards}}\n", "spec.sharding.path", 6),
        (f"  model: {{path: {chat}}}\n  offload: {{disk: {{path: ../../etc}}}}\n", "spec.offload.disk.path", 6),
        (f"  model: {{path: {chat}}}\n  rollout: {{strategy: canary, gates: {{golden: /etc/passwd, "
         "max_nll_increase: 0.1}}\n", "spec.rollout.gates.golden", 6),
    ]


@pytest.mark.parametrize("case", range(7), ids=["binary", "remote-code", "cluster", "model-path", "shards-path",
                                               "offload-path", "golden"])
def test_the_control_api_refuses_what_the_policy_does_not_allow_before_anything_runs(strict, root, tmp_path, case):
    spec, field, line = refusals(root, tmp_path)[case]
    body = manifest(tmp_path, "asked", spec)
    for path, extra in (("/apply", {"dry_run": True}), ("/apply", {}), ("/diff", {})):
        status, answer = control(strict, path, {**body, **extra})
        assert status == 403, answer
        error = answer["error"]
        assert error["param"] == field and error["type"] == "permission_error"
        assert error["code"] == "forbidden_by_policy"
        assert answer["kind"] == "policy" and answer["message"].startswith(f"{body['source']}:{line}:")
    assert not (tmp_path / "ran").exists()  # the binary was never run, not even with --version


def test_the_cli_prints_the_refusal_and_exits_non_zero(strict, root, tmp_path):
    script, marker = evil_binary(tmp_path)
    path = tmp_path / "evil.yaml"
    path.write_text(HEAD.format(name="evil") + f"  model: {{path: {root}/allowed/chat.gguf}}\n"
                    f"  engine: {{name: llama.cpp, binary: {script}}}\n")
    for verb in (["apply", "--dry-run"], ["apply"], ["diff"]):
        result = subprocess.run([sys.executable, "-m", "deploykit.cli", *verb, str(path)], capture_output=True,
                                text=True, env={**os.environ, "DEPLOYKIT_STATE": str(root / "state-strict")},
                                timeout=120)
        assert result.returncode != 0, result.stdout
        assert "spec.engine.binary: this server does not run programs" in result.stderr, result.stderr
    assert not marker.exists()


def test_a_server_started_allowing_them_lets_them_through(permissive, root, tmp_path):
    script, marker = evil_binary(tmp_path)
    chat = root / "allowed" / "chat"
    status, answer = control(permissive, "/apply", {**manifest(
        tmp_path, "binary", f"  model: {{path: {tmp_path}/m.gguf}}\n  engine: {{name: llama.cpp, binary: {script}}}\n"),
        "dry_run": True})
    assert status != 403 and marker.exists(), answer  # allowed: validated (it ran), refused for the model file
    for spec in (f"  model: {{path: {chat}, trust_remote_code: true}}\n",
                 f"  model: {{path: {chat}}}\n  sharding: {{path: {tmp_path}/shards}}\n"):
        status, answer = control(permissive, "/apply", {**manifest(tmp_path, "other", spec), "dry_run": True})
        assert status == 200 and answer["event"] == "result", answer


def test_a_watched_file_is_held_to_the_same_policy(strict, root, tmp_path):
    """The watched file's text passes because it names only allowed paths, not because it is watched: the same
    file with a path outside the roots is refused (tests/test_admission_gate.py sends one down every path)."""
    watched = root / "manifests" / "chat.yaml"
    body = {"manifest": watched.read_text(), "source": str(watched), "name": "tiny-chat", "dry_run": True}
    sharded = watched.read_text().replace("max_shard_size: 2GiB", f"max_shard_size: 2GiB, path: {tmp_path}")
    assert control(strict, "/apply", body)[0] == 200
    status, answer = control(strict, "/apply", {**body, "manifest": sharded})  # not what the file holds
    assert status == 403 and answer["error"]["param"] == "spec.sharding.path", answer


def test_tls_with_the_openai_client_and_the_cli(strict, root):
    assert strict.url.startswith("https://")
    cafile = strict.cafile
    client = openai.OpenAI(base_url=f"{strict.url}/v1", api_key="none", max_retries=0,
                           http_client=httpx.Client(verify=trusting(strict), timeout=60))
    answer = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, temperature=0)
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the certificate
        openai.OpenAI(base_url=f"{strict.url}/v1", api_key="none", max_retries=0).models.list()
    with pytest.raises(httpx.HTTPError):  # plain http to the TLS port gets no answer
        httpx.get(strict.url.replace("https:", "http:") + "/healthz", timeout=10)
    state = root / "state-strict"
    recorded = json.loads((state / "server.json").read_text())
    assert recorded["url"] == strict.url and recorded["cacert"] == str(Path(cafile).resolve())
    result = subprocess.run([sys.executable, "-m", "deploykit.cli", "status"], capture_output=True, text=True,
                            env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=120)
    assert result.returncode == 0 and "tiny-chat" in result.stdout, result.stderr
    elsewhere = {**os.environ, "DEPLOYKIT_STATE": str(root / "nowhere"), "DEPLOYKIT_TOKEN": TOKEN}
    untrusted = subprocess.run([sys.executable, "-m", "deploykit.cli", "status", "--server", strict.url],
                               capture_output=True, text=True, env=elsewhere, timeout=120)
    assert untrusted.returncode != 0 and "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr, untrusted.stderr
    trusted = subprocess.run([sys.executable, "-m", "deploykit.cli", "status", "--server", strict.url, "--cacert",
                              cafile], capture_output=True, text=True, env=elsewhere, timeout=120)
    assert trusted.returncode == 0 and "tiny-chat" in trusted.stdout, trusted.stderr


def cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "DEPLOYKIT_STATE": str(state)}, timeout=300)


def test_delete_leaves_a_checkpoint_used_in_place_intact(permissive, root, tmp_path):
    state = root / "state-permissive"
    resharded = tmp_path / "mine"  # `deploykit reshard` leaves deploykit.lock.json in its destination
    done = cli("reshard", str(root / "allowed" / "chat"), str(resharded), "--max-shard-size", "2GiB", "-q",
               state=state)
    assert done.returncode == 0 and (resharded / "deploykit.lock.json").is_file(), done.stderr
    before = sorted(p.name for p in resharded.iterdir())
    path = tmp_path / "mine.yaml"
    path.write_text(chat_manifest(resharded, name="mine"))
    applied = cli("apply", str(path), state=state)
    assert applied.returncode == 0, applied.stderr
    from deploykit.control.revisions.state import StateStore

    assert Path(StateStore(state).current("mine").shards_path) == resharded.resolve()  # used in place
    deleted = cli("delete", "mine", state=state)
    assert deleted.returncode == 0 and "deleted mine" in deleted.stdout, deleted.stderr
    assert sorted(p.name for p in resharded.iterdir()) == before  # the user's checkpoint, untouched


# ---- what is shown to whom -----------------------------------------------------------------------------

def test_readyz_says_ready_or_not_and_the_details_only_to_the_control_token(strict, root):
    broken = root / "manifests" / "broken.yaml"
    broken.write_text(chat_manifest(root / "allowed" / "nowhere", name="broken"))
    with httpx.Client(verify=trusting(strict), timeout=30) as client:
        try:
            wait_until(lambda: client.get(f"{strict.url}/readyz").status_code == 503, 60, "broken is seen")
            plain = client.get(f"{strict.url}/readyz")
            assert plain.json() == {"ready": False}  # no paths, no errors
            detailed = client.get(f"{strict.url}/readyz", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert detailed["ready"] is False and any(str(broken) in line for line in detailed["not_ready"])
        finally:
            broken.unlink()
        wait_until(lambda: client.get(f"{strict.url}/readyz").status_code == 200, 60, "broken is gone")
        assert client.get(f"{strict.url}/readyz").json() == {"ready": True}


def test_openapi_is_off_unless_asked_and_then_behind_the_key(strict, permissive):
    assert httpx.get(f"{strict.url}/openapi.json", verify=trusting(strict), timeout=30).status_code == 404
    assert httpx.get(f"{permissive.url}/openapi.json", timeout=30).status_code == 401
    schema = httpx.get(f"{permissive.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]


def test_status_behind_an_api_key_needs_the_control_token(permissive):
    with_key = httpx.get(f"{permissive.url}/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert with_key.status_code == 401 and with_key.json()["error"]["code"] == "invalid_control_token"
    with_token = httpx.get(f"{permissive.url}/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert with_token.status_code == 200 and with_token.json()[0]["name"] == "tiny-chat"
    models = httpx.get(f"{permissive.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert models.status_code == 200  # the key still opens /v1


def test_a_loopback_server_without_a_key_answers_only_its_own_host_names(strict):
    port = strict.port
    with httpx.Client(verify=trusting(strict), timeout=30) as client:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"):
            assert client.get(f"{strict.url}/v1/models", headers={"Host": host}).status_code == 200, host
        for host in (f"rebound.example:{port}", "attacker.test", f"127.0.0.1.evil.test:{port}"):
            answer = client.get(f"{strict.url}/v1/models", headers={"Host": host})
            assert answer.status_code == 421 and answer.json()["error"]["code"] == "invalid_host", host


# ---- limits -------------------------------------------------------------------------------------------

def test_a_body_that_does_not_arrive_in_time_is_a_408(permissive):
    with socket.create_connection(("127.0.0.1", permissive.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        received = b""
        while chunk := sock.recv(65536):  # the server answers, then closes: nothing more is sent
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), received[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_stream_whose_client_stops_reading_is_ended_and_its_generation_released(tmp_path):
    """About 6 MB of events (8 choices of 2000 tokens, 20 top logprobs each; 1000 tokens made 2.9 MB): more
    than the server's socket (its send buffer grows to 4 MiB here) and uvicorn's buffer hold, so its sends
    wait on a client that reads nothing."""
    (tmp_path / "manifests").mkdir()
    model = build_chat_model(tmp_path / "long", context=2100)
    (tmp_path / "manifests" / "long.yaml").write_text(
        chat_manifest(model, serving="{max_tokens: 2000, default_max_tokens: 16}"))
    body = json.dumps({"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                       "n": 8, "logprobs": True, "top_logprobs": 20, "temperature": 1.0, "stream": True,
                       "logit_bias": {"257": -100}}).encode()  # never "</s>": every choice makes its 2000 tokens
    with Server(tmp_path / "manifests", tmp_path / "state", "--stream-send-timeout", "2") as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            held = lambda: server.metric("deploykit_in_flight_requests", deployment="tiny-chat")  # noqa: E731
            wait_until(lambda: held() == 1, 30, "the stream holds its generation")
            # the client reads nothing: a send waits; 2 s later the server ends the stream
            wait_until(lambda: held() == 0, 120, "the unread stream released its generation")
            sock.settimeout(30)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
    assert received.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in received, len(received)
    assert "read nothing for 2 s; the stream is ended" in server.stderr


def test_the_state_directory_and_its_database_are_the_owner_s_alone(strict, root):
    state = root / "state-strict"
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "state.db").stat().st_mode) == 0o600
    assert stat.S_IMODE((state / "server.json").stat().st_mode) == 0o600


def test_write_atomic_never_writes_through_a_planted_link(tmp_path):
    from deploykit.artifacts.fsutil import write_atomic

    target, victim = tmp_path / "lock.json", tmp_path / "victim"
    victim.write_text("mine")
    for name in (f".lock.json.tmp-{os.getpid()}", ".lock.json.tmp"):  # the names it used to use
        (tmp_path / name).symlink_to(victim)
    write_atomic(target, b"new")
    write_atomic(target, b"newer")
    assert target.read_bytes() == b"newer" and victim.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name and not p.is_symlink()) == []


# ---- secrets -------------------------------------------------------------------------------------------

def test_secrets_read_from_files_stay_off_the_command_line(permissive):
    assert permissive.process is not None
    cmdline = Path(f"/proc/{permissive.process.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline and KEY.encode() not in cmdline
    answer = httpx.get(f"{permissive.url}/control/v1/status", headers={"Authorization": f"Bearer {TOKEN}"},
                       timeout=30)
    assert answer.status_code == 200  # the token of the file


@pytest.mark.parametrize("args, fragment", [
    (["--api-key", "short"], "--api-key must be at least 16 characters (got 5)"),
    (["--control-token", "0123456789"], "--control-token must be at least 16 characters (got 10)"),
])
def test_a_short_secret_is_refused_at_start(tmp_path, args, fragment):
    result = subprocess.run([sys.executable, "-m", "deploykit.cli", "serve", "--port", "0", *args],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "DEPLOYKIT_STATE": str(tmp_path / "state")})
    assert result.returncode != 0 and fragment in result.stderr, result.stderr
    assert "visible to every user of this machine" in result.stderr  # and said so, since it was typed
