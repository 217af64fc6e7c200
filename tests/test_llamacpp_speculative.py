"""spec.speculative on the llama.cpp engine: the llama-server flags each manifest becomes, the draft model
planned (its weights and the KV of its own layers, on the device with room) and refused where it cannot
serve (missing, not GGUF, another vocabulary), located at the field; then a real `deploykit serve`: greedy
answers identical with and without ngram speculation and with the model as its own draft, llama-server's
accepted drafts counted in deploykit's metrics, the settings in status, a reload that changes only
spec.speculative restarting llama-server with the new flags, and a draft that fails to load leaving the
last good generation serving with the error in status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest
from helpers import smollm2_file, wait_until
from llamacpp import engine_pids, llama_server, manifest
from servers import Server, get

from deploykit.control.budget.tiers import plan_tiers
from deploykit.control.revisions.change import host_issues
from deploykit.engine.llamacpp.flags import speculative_flags
from deploykit.errors import ManifestError, PlanInfeasible
from deploykit.model.gguf import gguf_metadata
from deploykit.model.gguf_blocks import gguf_blocks
from deploykit.placement.plan import Plan
from deploykit.placement.planning import plan_manifest
from deploykit.spec.manifest import LoadedManifest, parse_manifests

NGRAM = "  speculative: {method: ngram, num_tokens: 16, ngram_min: 4, ngram_max: 4}\n"
SLOTS, CONTEXT = 2, 512
# the copy task: an answer that repeats spans of its prompt, where ngram drafts are accepted
COPY = ("Repeat this text exactly, word for word: The quick brown fox jumps over the lazy dog. A stitch in time "
        "saves nine. All that glitters is not gold. Actions speak louder than words.")


def _loaded(text: str, tmp_path: Path) -> LoadedManifest:
    (tmp_path / "m.yaml").write_text(text)
    [loaded] = parse_manifests(text.encode(), source=str(tmp_path / "m.yaml"), base_dir=tmp_path)
    return loaded


def _draft(path: Path, **extra: str) -> str:
    more = "".join(f", {k}: {v}" for k, v in extra.items())
    return f"  speculative: {{method: draft, num_tokens: 6, draft: {{path: {path}}}{more}}}\n"


def _other_vocabulary(path: Path) -> Path:
    """A GGUF file with a vocabulary of three tokens (and no tensors): a draft no SmolLM2 can check."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- flags and plans (no server) -----------------------------------------------------------------------------

def test_ngram_becomes_ngram_simple_with_the_lookup_length_and_the_draft_length(tmp_path):
    loaded = _loaded(manifest(smollm2_file(), extra=NGRAM), tmp_path)
    plan = plan_manifest(loaded, devices="cpu=8GiB")
    flags = speculative_flags(loaded.manifest.spec.speculative, plan.draft)
    assert flags is not None and plan.draft is None
    assert flags.as_args() == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                               "--spec-ngram-simple-size-m", "16"]


def test_an_ngram_range_llama_cpp_cannot_match_is_refused_at_ngram_min(tmp_path):
    text = manifest(smollm2_file(), extra="  speculative: {method: ngram, ngram_min: 2, ngram_max: 5}\n")
    with pytest.raises(ManifestError) as err:
        _loaded(text, tmp_path)
    [issue] = err.value.issues
    assert "speculative.ngram_min" in str(issue) and "set ngram_min to 5" in str(issue), issue
    assert issue.line == 8, issue  # the speculative line of the manifest


def test_a_draft_model_is_planned_beside_the_model_and_becomes_model_draft_flags(tmp_path):
    gguf = smollm2_file()
    loaded = _loaded(manifest(gguf, extra=_draft(gguf)), tmp_path)
    alone = plan_manifest(_loaded(manifest(gguf), tmp_path / ".." / tmp_path.name), devices="cpu=8GiB")
    plan = plan_manifest(loaded, devices="cpu=8GiB")
    assert plan.draft is not None and plan.draft.device == "cpu" and plan.draft.layers == 30
    expected = sum(b.weight_bytes for b in gguf_blocks(gguf, kv_tokens=SLOTS * CONTEXT, batch_tokens=512).blocks)
    assert plan.draft.bytes == expected and plan.total_bytes == alone.total_bytes + expected
    assert plan.draft.kv_bytes > 0 and plan.draft.weight_bytes + plan.draft.kv_bytes == expected
    assert plan_tiers(plan)["cpu"] == plan_tiers(alone)["cpu"] + expected  # what a serve --budget counts
    assert Plan.from_dict(json.loads(plan.to_json())) == plan and "draft" not in alone.to_dict()  # as recorded
    flags = speculative_flags(loaded.manifest.spec.speculative, plan.draft)
    assert flags is not None and flags.as_args() == [
        "--spec-type", "draft-simple", "--spec-draft-model", str(gguf.resolve()), "--spec-draft-n-max", "6",
        "--spec-draft-ngl", "0"]
    # on GPUs: the whole draft on the one with the most room beside the model's layers
    gpus = _loaded(manifest(gguf, extra="  placement: {gpus: all}\n" + _draft(gguf)), tmp_path)
    on_gpus = plan_manifest(gpus, devices="2x4GiB")
    held = {d.device: d.bytes for d in on_gpus.devices}
    assert on_gpus.draft is not None and on_gpus.draft.device == min((0, 1), key=lambda g: held.get(g, 0))
    gpu = on_gpus.draft.device
    args = speculative_flags(gpus.manifest.spec.speculative, on_gpus.draft).as_args()  # type: ignore[union-attr]
    assert args[-6:] == ["--spec-draft-ngl", "31", "--spec-draft-device", f"CUDA{gpu}",
                         "--spec-draft-override-tensor", rf"^token_embd\.weight$=CUDA{gpu}"]
    assert plan_tiers(on_gpus)[f"gpu{gpu}"] == held.get(gpu, 0) + expected
    with pytest.raises(PlanInfeasible) as short:  # no device has room for it beside the model
        plan_manifest(loaded, devices=f"cpu={alone.total_bytes + expected // 2}")
    assert short.value.field == "spec.speculative.draft.path", short.value


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "absent.gguf", "does not exist"),
    (lambda d: (d / "text.gguf", (d / "text.gguf").write_text("not a model"))[0], "is not a GGUF file"),
    (lambda d: _other_vocabulary(d / "other.gguf"), "vocabulary (3 tokens) is not the serving model's (49152"),
])
def test_a_draft_that_cannot_serve_is_refused_at_its_path(tmp_path, make, words):
    draft = make(tmp_path)
    loaded = _loaded(manifest(smollm2_file(), extra=_draft(draft)), tmp_path)
    with pytest.raises(ManifestError) as err:
        plan_manifest(loaded, devices="cpu=8GiB")
    [issue] = err.value.issues
    assert issue.field == "spec.speculative.draft.path" and issue.line == 8 and words in str(issue), issue
    llama_server()  # `deploykit validate` says it too, before any apply
    [said] = host_issues(loaded)
    assert said.field == "spec.speculative.draft.path" and said.line == 8 and words in str(said), said


# -- a real deploykit serve ----------------------------------------------------------------------------------

def _copy(url: str, model: str, *, stream: bool = False, max_tokens: int = 24) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": COPY}]
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content or ""


def _status(url: str, name: str) -> dict[str, Any]:
    status, body = get(f"{url}/status")
    assert status == 200, body
    [dep] = [d for d in body if d["name"] == name]
    return dep  # type: ignore[no-any-return]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_greedy_answers_are_identical_with_ngram_and_draft_speculation_and_drafts_are_counted(tmp_path):
    llama_server()
    gguf = smollm2_file()
    text = (manifest(gguf, name="plain") + "---\n" + manifest(gguf, name="ngram", extra=NGRAM) + "---\n"
            + manifest(gguf, name="drafted", extra=_draft(gguf)))
    (tmp_path / "m.yaml").write_text(text)
    with Server(tmp_path / "m.yaml", tmp_path / "state") as server:
        expected = _copy(server.url, "plain")
        assert len(expected) > 20, expected
        assert _copy(server.url, "ngram") == expected
        assert _copy(server.url, "ngram", stream=True) == expected
        accepted = server.metric("deploykit_speculative_accepted_tokens_total", model_name="ngram")
        drafted = server.metric("deploykit_speculative_drafted_tokens_total", model_name="ngram")
        assert 0 < accepted <= drafted, (accepted, drafted)
        assert server.metric("deploykit_speculative_drafted_tokens_total", model_name="plain") == 0
        assert _copy(server.url, "drafted") == expected  # the model as its own draft: same vocabulary
        assert server.metric("deploykit_speculative_accepted_tokens_total", model_name="drafted") > 0
        shown = _status(server.url, "ngram")["engine_process"]["speculative"]
        assert shown["method"] == "ngram" and shown["ngram"] == 4 and shown["num_tokens"] == 16, shown
        assert "--spec-ngram-simple-size-m" in shown["flags"]
        assert _status(server.url, "drafted")["engine_process"]["speculative"]["draft_device"] == "cpu"
        assert _status(server.url, "plain")["engine_process"]["speculative"] is None
        said = subprocess.run([sys.executable, "-m", "deploykit.cli", "status", "drafted"],  # the server of the
                              capture_output=True, text=True, timeout=120, env=server.env)  # state directory
        assert "cpu: draft model" in said.stdout and "speculative: draft, up to 6 tokens drafted" in said.stdout, (
            said.stdout, said.stderr)


def test_a_reload_of_only_spec_speculative_restarts_llama_server_and_a_broken_draft_keeps_the_last_good(tmp_path):
    llama_server()
    gguf = smollm2_file()
    path = tmp_path / "smol.yaml"
    path.write_text(manifest(gguf, name="smol", extra=NGRAM))
    with Server(path, tmp_path / "state") as server:
        assert server.process is not None
        [old] = engine_pids(server.process.pid)
        assert "--spec-ngram-simple-size-m 16" in _cmdline(old)
        path.write_text(manifest(gguf, name="smol", extra=NGRAM.replace("num_tokens: 16", "num_tokens: 5")))
        [new] = wait_until(lambda: (p := engine_pids(server.process.pid)) != [old] and len(p) == 1 and p,  # type: ignore[union-attr]
                           180, "a new llama-server with the new flags")
        assert "--spec-ngram-simple-size-m 5" in _cmdline(new)
        wait_until(lambda: _status(server.url, "smol")["engine_process"]["speculative"]["num_tokens"] == 5, 60,
                   "status shows the new settings")
        # a draft with the model's vocabulary and header that llama-server cannot load (a tensor renamed)
        broken = tmp_path / "broken.gguf"
        data = bytearray(gguf.read_bytes())
        at = data.index(b"output_norm.weight", 0, gguf_metadata(gguf).metadata_end)
        data[at:at + 11] = b"output_nor_"
        broken.write_bytes(bytes(data))
        path.write_text(manifest(gguf, name="smol", extra=_draft(broken)))
        error = wait_until(lambda: _status(server.url, "smol")["last_error"], 240, "the failed reload in status")
        assert "failed to load draft model" in error, error
        assert engine_pids(server.process.pid) == [new]  # the last good generation serves on
        assert _copy(server.url, "smol", max_tokens=4)


def test_deploykit_plan_shows_the_draft_and_its_flags(tmp_path):
    import os

    gguf = smollm2_file()
    (tmp_path / "m.yaml").write_text(manifest(gguf, extra="  placement: {gpus: all}\n" + _draft(gguf)))
    env = {**os.environ, "DEPLOYKIT_LLAMA_SERVER": "/bin/true"}  # planning runs no binary

    def plan(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "deploykit.cli", "plan", str(tmp_path / "m.yaml"),
                               "--devices", "2x4GiB", *args], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    shown = json.loads(plan("-o", "json"))
    assert shown["draft"]["layers"] == 30 and shown["draft"]["device"] in (0, 1)
    assert shown["llama_server"]["flags"][-4:-2] == ["--spec-draft-device", f"CUDA{shown['draft']['device']}"]
    text = plan()
    assert f"draft model {gguf.resolve()}" in text and f"on cuda:{shown['draft']['device']}" in text, text
