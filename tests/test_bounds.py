"""Every input deploykit takes has a bound (docs/control.md#security-model): files a manifest names, the
manifest's numbers, device specs, response_format schemas, request bodies, the CLI's way to its server,
the engine's environment, and what cleanup may remove. Each test sends past a bound and expects a clear,
located refusal, quickly."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from deploykit.errors import ManifestError
from deploykit.files import FileRefused, read_regular_file
from deploykit.spec.golden import GoldenError, read_golden
from deploykit.spec.manifest import check_on_host, parse_manifests
from deploykit.units import format_duration, parse_duration, parse_size

HEAD = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: bounded}\nspec:\n  model: {path: model}\n"


def issues(extra: str, base: Path = Path("/base")) -> list:
    with pytest.raises(ManifestError) as info:
        parse_manifests((HEAD + extra).encode(), source="m.yaml", base_dir=base)
    return info.value.issues


def parsed(extra: str, base: Path = Path("/base")):
    return parse_manifests((HEAD + extra).encode(), source="m.yaml", base_dir=base)[0]


# ---- 1. files a manifest names: regular files only, bounded ---------------------------------------------

def test_a_golden_file_that_is_a_device_is_refused_without_reading_it():
    start = time.monotonic()
    with pytest.raises(GoldenError, match="not a regular file .a character device"):
        read_golden(Path("/dev/zero"))
    assert time.monotonic() - start < 1


def test_a_golden_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "golden.jsonl"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_golden(fifo)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # a blocked open(): give it a writer, so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO named as a golden file blocked")
    assert isinstance(outcome[0], GoldenError) and "a FIFO" in str(outcome[0])


def test_a_file_over_its_limit_is_refused(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1001)
    with pytest.raises(FileRefused, match="1001 bytes; at most 1000"):
        read_regular_file(big, 1000)
    assert read_regular_file(big, 1001) == b"x" * 1001
    with pytest.raises(FileRefused, match="a directory"):
        read_regular_file(tmp_path, 1000)


def test_the_host_check_refuses_a_device_as_golden_even_when_the_model_path_is_wrong(tmp_path):
    loaded = parsed("  rollout:\n    strategy: blue-green\n    gates: {golden: /dev/zero, max_nll_increase: 0.1}\n",
                    base=tmp_path)
    start = time.monotonic()
    found = check_on_host(loaded)
    assert time.monotonic() - start < 1
    golden = [i for i in found if i.field == "spec.rollout.gates.golden"]
    assert golden and "not a regular file" in golden[0].message, found


def test_a_huge_config_json_is_a_located_issue_not_read(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "config.json", "wb") as fh:
        fh.truncate(1 << 30)  # sparse: a gigabyte that costs nothing to make
    loaded = parsed("  placement: {tensor_parallel: 2}\n", base=tmp_path)
    found = check_on_host(loaded)
    assert [(i.field, "1073741824 bytes; at most" in i.message) for i in found] == [("spec.model.path", True)], found


# ---- 2. every number of the schema has an upper bound -------------------------------------------------

@pytest.mark.parametrize("extra, field", [
    ("  serving: {max_queued: 2000000}\n", "spec.serving.max_queued"),
    ("  serving: {max_tokens: 100000000}\n", "spec.serving.max_tokens"),
    ("  serving: {max_input_items: 100000}\n", "spec.serving.max_input_items"),
    ("  serving: {context_length: 100000000}\n", "spec.serving.context_length"),
    ("  replicas: 100000\n", "spec.replicas"),
    ("  placement: {nodes: 100000}\n", "spec.placement.nodes"),
    ("  placement: {gpus: [100000]}\n", "spec.placement.gpus.0"),
    ("  placement: {kv_cache: {tokens: 100000000000}}\n", "spec.placement.kv_cache.tokens"),
    ("  lifecycle: {priority: 100000000000}\n", "spec.lifecycle.priority"),
    ("  lifecycle: {priority: -100000000000}\n", "spec.lifecycle.priority"),
    ("  rollout: {strategy: canary, canary: {min_requests: 100000000000}}\n", "spec.rollout.canary.min_requests"),
    ("  sharding: {max_shard_size: 1000000000000000000000}\n", "spec.sharding.max_shard_size"),
    ("  sharding: {max_shard_size: 999999999999TiB}\n", "spec.sharding.max_shard_size"),
])
def test_a_number_past_its_bound_is_a_located_error(extra, field):
    found = issues(extra)
    assert field in [i.field for i in found], found
    assert {i.line for i in found} == {6}, found


def test_every_number_in_the_schema_has_an_upper_bound():
    from deploykit.spec.manifest import json_schema

    unbounded = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number") and "maximum" not in node and "exclusiveMaximum" not in node:
                unbounded.append(where)
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(json_schema(), "#")
    assert unbounded == []


def test_the_engine_gets_a_thread_per_slot_whatever_the_queue(tmp_path):
    from deploykit.engine.llamacpp.process import ServerOptions
    from deploykit.engine.llamacpp.runtime import HTTP_SPARE_THREADS, LlamaOptions, engine_options

    options = engine_options(LlamaOptions(ServerOptions(binary=tmp_path / "llama-server", model=tmp_path / "m.gguf",
                                                        slots=4)))
    flags = options.server.flags()
    assert flags[flags.index("--threads-http") + 1] == str(4 + HTTP_SPARE_THREADS)


def test_requests_past_the_slots_wait_in_deploykit_for_a_turn():
    from deploykit.engine.llamacpp.runtime import Slots

    async def scenario() -> None:
        slots = Slots(1, max_queued=3)
        for _ in range(3):
            slots.enter()
        await slots.turn()  # the first is sent at once
        second = asyncio.ensure_future(slots.turn())
        third = asyncio.ensure_future(slots.turn())
        await asyncio.sleep(0)
        assert not second.done() and not third.done()
        assert slots.stats() == {"running": 1, "waiting": 2}
        second.cancel()  # a client gone while waiting leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await second
        slots.leave()
        slots.leave(turned=True)  # the first ends: its turn goes to the next waiter
        await asyncio.wait_for(third, 5)
        assert slots.stats() == {"running": 1, "waiting": 0}
        slots.leave(turned=True)
        assert slots.stats() == {"running": 0, "waiting": 0}

    asyncio.run(scenario())


# ---- 4. YAML numbers: YAML 1.2 core forms, bounded digits, finite --------------------------------------

def test_a_base_60_number_is_not_read_as_one_and_costs_nothing():
    text = "1:" + ":".join(["59"] * 100_000)
    start = time.monotonic()
    found = issues(f"  serving: {{max_queued: {text}}}\n")
    assert time.monotonic() - start < 1
    assert [i.field for i in found] == ["spec.serving.max_queued"], found


@pytest.mark.parametrize("value, fragment", [
    ("9" * 5000, "a number of 5000 digits; at most 30"),
    ("0x" + "f" * 5000, "a number of 5000 digits"),
    (".inf", ".inf is not a finite number"),
    ("-.inf", "not a finite number"),
    (".nan", ".nan is not a finite number"),
    ("1e400", "too large for a number"),
    ("!!int 1:30", "is not a YAML 1.2 integer"),
])
def test_a_number_deploykit_does_not_read_is_a_located_error(value, fragment):
    found = issues(f"  lifecycle: {{keep_alive: {value}}}\n")
    assert len(found) == 1 and fragment in found[0].message, found
    assert (found[0].line, found[0].column, found[0].field) == (6, 27, "spec.lifecycle.keep_alive")


@pytest.mark.parametrize("value", ["1_000", "0b1010", "1:30"])
def test_yaml_1_1_number_forms_are_strings_and_refused_as_counts(value):
    assert [i.field for i in issues(f"  serving: {{max_queued: {value}}}\n")] == ["spec.serving.max_queued"]


def test_yaml_1_2_core_numbers_are_read():
    loaded = parsed("  serving: {max_queued: 0x10, max_input_items: 0o17}\n  lifecycle: {keep_alive: 1.5e2}\n")
    serving = loaded.manifest.spec.serving
    assert (serving.max_queued, serving.max_input_items) == (16, 15)
    assert loaded.manifest.spec.lifecycle.keep_alive == 150.0


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 10**400, 0x10000000000000000000000000000,
                                   "99999999999999999999999999h", 0.0001])
def test_durations_are_finite_and_bounded(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize("value", [2**60 + 1, 10**400, "9999999999999999999999TiB"])
def test_sizes_are_bounded(value):
    with pytest.raises(ValueError, match="at most"):
        parse_size(value)


@pytest.mark.parametrize("seconds", [0.001, 0.5, 1.5, 119.0, 3600.0, 366 * 86400.0])
def test_every_duration_read_is_written_back_readable(seconds):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds, rel=1e-5)


# ---- 3. a device spec names at most 4096 GPUs and 1024 nodes --------------------------------------------

@pytest.mark.parametrize("spec, fragment", [
    ("3000000x1GiB", "a device count of 7 digits"),
    ("4097x1GiB", "more than 4096 GPUs"),
    ("2000x1GiB,2097x1GiB", "more than 4096 GPUs"),
    ("1025x(1GiB)", "more than 1024 nodes"),
    ("2x(2049x1GiB)", "more than 4096 GPUs in all"),
    ("9" * 5000 + "x(1GiB)", "at most 4096 characters"),
])
def test_a_device_spec_past_its_bounds_is_refused_before_anything_is_built(spec, fragment):
    from deploykit.errors import InventoryError
    from deploykit.placement.inventory import parse_devices

    start = time.monotonic()
    with pytest.raises(InventoryError, match=fragment):
        parse_devices(spec)
    assert time.monotonic() - start < 0.5


def test_a_device_spec_at_its_bounds_is_read():
    from deploykit.placement.inventory import parse_devices

    assert len(parse_devices("4096x1GiB").gpus) == 4096
    assert len(parse_devices("1024x(4x1GiB)").nodes) == 1024


# ---- 6. a refused body is read away within the body timeout and a byte cap, else the connection closes ---

def _guarded(receive, content_length: int) -> list[dict]:
    """What ``Guard`` sends for a request declaring ``content_length`` whose body ``receive`` delivers."""
    from deploykit.serve.auth import Guard

    sent: list[dict] = []

    async def app(scope, receive, send) -> None:
        raise AssertionError("a refused body reached the app")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "method": "POST",
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", str(content_length).encode())]}
    guard = Guard(app, api_key=None, body_timeout=0.3)
    asyncio.run(asyncio.wait_for(guard(scope, receive, send), 10))
    return sent


def test_a_declared_body_that_never_arrives_gets_its_413_at_the_body_timeout_and_the_connection_closes():
    async def never() -> dict:
        await asyncio.Event().wait()
        raise AssertionError

    start = time.monotonic()
    sent = _guarded(never, 8 << 20)  # over the 4 MiB limit, under the drain factor's 64 MiB
    assert time.monotonic() - start < 5
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]


def test_a_body_larger_than_declared_is_read_away_no_further_than_the_cap():
    received = 0

    async def endless() -> dict:
        nonlocal received
        received += 1 << 20
        await asyncio.sleep(0)
        return {"type": "http.request", "body": b"x" * (1 << 20), "more_body": True}

    sent = _guarded(endless, 8 << 20)
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    assert received <= (64 << 20) + (1 << 20)


def test_a_body_read_away_in_time_keeps_the_connection():
    chunks = iter([{"type": "http.request", "body": b"x" * (8 << 20), "more_body": True},
                   {"type": "http.request", "body": b"", "more_body": False}])

    async def quick() -> dict:
        return next(chunks)

    sent = _guarded(quick, 8 << 20)
    assert sent[0]["status"] == 413 and (b"connection", b"close") not in sent[0]["headers"]


# ---- 7. the control token never goes through a proxy to a local server ---------------------------------

class _Recorder:
    """A TCP listener that counts the connections it gets (a proxy that must never be used)."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)


@pytest.mark.parametrize("bound, connect", [("0.0.0.0", "0.0.0.0"), ("127.0.0.1", "127.0.0.1"),
                                            ("0.0.0.0", "localhost")])
def test_a_local_server_is_reached_without_the_proxy_of_the_environment(monkeypatch, bound, connect):
    import http.server

    from deploykit.cli.remote import opener_for

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    proxy = _Recorder()
    target = http.server.ThreadingHTTPServer((bound, 0), Answer)
    serving = threading.Thread(target=target.serve_forever, daemon=True)
    serving.start()
    try:
        for variable in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
            monkeypatch.setenv(variable, f"http://127.0.0.1:{proxy.port}")
        for variable in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(variable, raising=False)
        url = f"http://{connect}:{target.server_address[1]}/control/v1/status"
        with opener_for(url, None).open(url, timeout=10) as answer:
            assert answer.status == 200
        assert proxy.connections == 0
    finally:
        target.shutdown()
        serving.join(10)
        target.server_close()
        proxy.close()


def test_serve_on_every_interface_writes_a_loopback_url_to_server_json(tmp_path):
    import json
    import signal
    import subprocess
    import sys

    from helpers import wait_until
    from servers import free_port

    port, state = free_port(), tmp_path / "state"
    process = subprocess.Popen([sys.executable, "-m", "deploykit.cli", "serve", "--host", "0.0.0.0", "--port", str(port)],
                               env={**os.environ, "DEPLOYKIT_STATE": str(state),
                                    "DEPLOYKIT_API_KEY": "sk-bounds-tests-api-key"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (state / "server.json").exists() or process.poll() is not None, 120, "server.json")
        written = json.loads((state / "server.json").read_text())
        assert written["url"] == f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


def test_a_control_token_equal_to_the_api_key_is_refused_at_start(tmp_path):
    import subprocess
    import sys

    secret = "the-same-secret-for-both"
    done = subprocess.run([sys.executable, "-m", "deploykit.cli", "serve", "--api-key", secret, "--control-token",
                           secret, "--port", "0"], env={**os.environ, "DEPLOYKIT_STATE": str(tmp_path / "state")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "the control token is the API key" in done.stderr


# ---- 8. the llama-server --version check sees the engine's scrubbed environment -------------------------

def test_the_version_check_of_a_binary_sees_no_credential(tmp_path, monkeypatch):
    import stat

    from deploykit.engine.llamacpp.binary import find_binary

    script = tmp_path / "llama-server"
    script.write_text('#!/bin/sh\necho "version: 1 ($HF_TOKEN$AWS_SECRET_ACCESS_KEY$DEPLOYKIT_TOKEN/$PATH)"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("DEPLOYKIT_TOKEN", "control-secret")
    version = find_binary(script).version
    assert "secret" not in version and "/bin" in version, version  # PATH is the engine's too


# ---- 9. what deploykit leaves on disk: stale socket directories, a state directory open to others -------

def _dead_pid() -> int:
    import subprocess

    child = subprocess.Popen(["/bin/true"])
    child.wait()
    return child.pid


def test_socket_directories_of_a_killed_deploykit_are_cleared_and_no_others(tmp_path):
    from deploykit.engine.llamacpp.process import clear_stale_socket_dirs

    dead, alive = _dead_pid(), os.getpid()
    stale = tmp_path / f"deploykit-llama-{dead}-abc123"
    live = tmp_path / f"deploykit-llama-{alive}-def456"
    foreign = [tmp_path / "deploykit-llama-xyz", tmp_path / f"other-{dead}-abc", tmp_path / "deploykit-llama-old_1"]
    for directory in (stale, live, *foreign):
        directory.mkdir()
        (directory / "server.sock").write_text("")
    (tmp_path / f"deploykit-llama-{dead}-link").symlink_to(live)
    assert clear_stale_socket_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and all(d.exists() for d in foreign)


def test_an_existing_state_directory_is_made_private_when_opened(tmp_path):
    import stat

    from deploykit.control.revisions.state import StateStore

    directory = tmp_path / "state"
    (directory / "locks").mkdir(parents=True)
    directory.chmod(0o755)
    (directory / "locks").chmod(0o755)
    StateStore(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "locks").stat().st_mode) == 0o700


# ---- 10. cleanup removes only what this state directory laid out ----------------------------------------

def test_old_shards_are_collected_but_not_another_state_directorys_nor_a_reshard_output(model, tmp_path):
    from deploykit.artifacts.reshard import reshard
    from deploykit.artifacts.verify import read_lock
    from deploykit.control.revisions.reconciler import apply
    from deploykit.control.revisions.state import StateStore
    from deploykit.spec.manifest import load_manifests
    from manifests import write_manifest

    mine, other = StateStore(tmp_path / "state"), StateStore(tmp_path / "other-state")
    root = tmp_path / "shards" / "tiny"
    [theirs] = load_manifests(write_manifest(tmp_path, model, shard="120KiB"))
    their_shards = apply(theirs, store=other).shards
    by_hand = root / "by-hand"
    reshard(model, by_hand, max_shard_size=100 * 1024)  # `deploykit reshard` beside, with its lock file
    assert read_lock(by_hand) is not None
    laid_out = []
    for shard in ("150KiB", "200KiB", "250KiB", "300KiB"):
        [loaded] = load_manifests(write_manifest(tmp_path, model, shard=shard))
        laid_out.append(apply(loaded, store=mine).shards)
    assert len(set(laid_out)) == 4 and all(p.parent == root for p in laid_out)
    assert [p.exists() for p in laid_out] == [False, False, True, True]  # the current and previous Ready kept
    assert their_shards.exists() and by_hand.exists()


# ---- 11. what a relayed llama-server stream tells the client -------------------------------------------

def _upstream_event(model: str, content: str, **extra: object) -> bytes:
    """One event as llama-server writes it: compact JSON, non-ASCII as raw UTF-8."""
    import json

    event = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": content}}], "created": 1,
             "id": "chatcmpl-upstream", "model": model, "system_fingerprint": "b0-unknown",
             "object": "chat.completion.chunk", **extra}
    return b"data: " + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@pytest.mark.parametrize("gguf", ["/models/tiny.gguf", "/modèles/ünïcode-模型.gguf"])
def test_a_relayed_stream_names_neither_the_gguf_path_nor_the_engine_build(gguf):
    import json

    from deploykit.serve.openai.rewrite import Rewriter

    rewrite = Rewriter("chatcmpl-ours", "tiny-chat", wants_usage=False)
    upstream = (_upstream_event(gguf, "Hé") + _upstream_event(gguf, " there") + _upstream_event(gguf, "!")
                + b"data: [DONE]\n\n")
    out = b"".join(rewrite.feed(upstream[i:i + 7]) for i in range(0, len(upstream), 7))  # split anywhere
    assert gguf.encode() not in out and b"b0-unknown" not in out and b"upstream" not in out, out
    events = [json.loads(line[6:]) for line in out.split(b"\n\n") if line and line != b"data: [DONE]"]
    assert [e["choices"][0]["delta"]["content"] for e in events] == ["Hé", " there", "!"]
    assert all(e["id"] == "chatcmpl-ours" and e["model"] == "tiny-chat" and "system_fingerprint" not in e
               for e in events), events
    assert rewrite.ended


def test_an_engine_event_that_never_ends_fails_the_stream_instead_of_growing():
    from deploykit.engine.llamacpp.client import UpstreamError
    from deploykit.serve.openai.rewrite import MAX_EVENT_BYTES, Rewriter

    rewrite = Rewriter("chatcmpl-ours", "tiny-chat", wants_usage=False)
    rewrite.feed(_upstream_event("/m.gguf", "a"))
    with pytest.raises(UpstreamError, match="more than"):
        for _ in range(MAX_EVENT_BYTES // (1 << 20) + 2):
            rewrite.feed(b"data: {" + b"x" * (1 << 20))
