"""spec.placement.tensor_parallel: validation, each rank's share in the plan, per-rank shards on disk,
and ranks started by deploykit serving greedy tokens equal to one process."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from deploykit.engine.text import RequestError

from test_cli import deploykit

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: tp
spec:
  model:
    path: {path}
    dtype: float32
  placement:
    gpus: {gpus}
    reserve: 0
    tensor_parallel: {ranks}
{extra}"""


def write(tmp_path: Path, model: Path, *, ranks: int = 2, gpus: str = "[]", extra: str = "",
          name: str = "tp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(MANIFEST.format(path=model, ranks=ranks, gpus=gpus, extra=extra))
    return path


@pytest.fixture(scope="module")
def llama(tiny_model) -> Path:
    return tiny_model("llama")  # 4 attention heads, 2 key-value heads


def test_plan_shows_each_gpu_holding_half_the_split_weights(tmp_path, llama):
    from deploykit.model.structure import load_structure

    result = deploykit("plan", str(write(tmp_path, llama, gpus="[0, 1]")), "--devices", "2x1GiB", "-o", "json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    structure = load_structure(llama, task="causal-lm", dtype="float32")
    split = sum(b.split_bytes for b in structure.blocks)
    whole = structure.weight_bytes - split
    # the norms and rotary tables stay whole; attention, MLP, embeddings and head split in two
    assert whole and split > 0.95 * structure.weight_bytes
    assert [d["device"] for d in plan["devices"]] == [0, 1]
    assert [d["weight_bytes"] for d in plan["devices"]] == [whole + split // 2] * 2
    single = json.loads(deploykit("plan", str(write(tmp_path, llama, ranks=1, gpus="[0]", name="one.yaml")),
                                  "--devices", "1x1GiB", "-o", "json").stdout)
    assert single["devices"][0]["weight_bytes"] == structure.weight_bytes
    assert single["digest"] != plan["digest"]


def test_plan_on_a_cpu_host_lists_one_worker_per_rank(tmp_path, llama):
    result = deploykit("plan", str(write(tmp_path, llama)), "--devices", "cpu=8GiB", "-o", "json")
    assert result.returncode == 0, result.stderr
    devices = json.loads(result.stdout)["devices"]
    assert [(d["device"], d["tier"], d["budget"]) for d in devices] == [("cpu:0", "cpu", 4 * 2**30),
                                                                        ("cpu:1", "cpu", 4 * 2**30)]


def test_ranks_must_divide_the_heads_at_the_fields_line(tmp_path, llama):
    path = write(tmp_path, llama, ranks=4)  # 4 attention heads but 2 key-value heads
    for verb in ("validate", "plan"):
        result = deploykit(verb, str(path))
        assert result.returncode == 2, (verb, result.stdout, result.stderr)
        assert f"{path}:12:22: spec.placement.tensor_parallel: tensor_parallel 4 must divide the model's heads, " \
               "but it has 2 key-value heads" in result.stderr, result.stderr


@pytest.mark.parametrize("extra, ranks, gpus, message", [
    ("    nodes: 2\n  cluster: {address: local}\n", 2, "[]", "tensor_parallel 2 with nodes 2 is not supported yet"),
    ("", 2, "[0, 1, 2]", "tensor_parallel 2 needs one GPU per rank, but gpus lists 3"),
    ("  cluster: {address: local}\n", 2, "[]", "tensor_parallel with spec.cluster"),
    ("  offload: {disk: {path: /tmp}}\n", 2, "[]", "tensor_parallel with spec.offload.disk is not supported"),
    ("  serving: {batching: continuous}\n", 2, "[]", "tensor_parallel runs deploykit's padded batch loop"),
])
def test_combinations_not_run_are_refused_at_the_field(tmp_path, llama, extra, ranks, gpus, message):
    path = write(tmp_path, llama, ranks=ranks, gpus=gpus, extra=extra)
    for verb in ("validate", "plan"):
        result = deploykit(verb, str(path))
        assert result.returncode == 2, (verb, result.stderr)
        assert f"{path}:12:22: spec.placement.tensor_parallel: {message}" in result.stderr, result.stderr


def test_a_model_without_a_tp_plan_is_refused(tmp_path, tiny_model):
    result = deploykit("plan", str(write(tmp_path, tiny_model("gpt2"))), "--devices", "cpu=8GiB")
    assert result.returncode == 1
    assert "GPT2LMHeadModel declares no tensor-parallel plan" in result.stderr
    assert "spec.placement.tensor_parallel" in result.stderr


def test_the_default_keeps_manifest_digests():
    from deploykit.spec.schema import Placement

    assert "tensor_parallel" not in Placement().model_dump()
    assert Placement(tensor_parallel=2).model_dump()["tensor_parallel"] == 2


# ---------------------------------------------------------------------------------------------------
# Per-rank shards and ranks started by deploykit (real processes, gloo, on this CPU).

CHAT = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: {name}
spec:
  model:
    path: {path}
    dtype: float32
  placement:
    tensor_parallel: {ranks}
  serving: {{max_tokens: 64, default_max_tokens: 12, max_concurrent: 4}}
"""


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from chatmodel import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("tp") / "chat")


def chat_manifest(tmp_path: Path, model: Path, *, ranks: int = 2, name: str = "tp-chat",
                  file: str = "chat.yaml") -> Path:
    path = tmp_path / file
    path.write_text(CHAT.format(path=model, ranks=ranks, name=name))
    return path


def reference(model_dir: Path, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def test_rank_files_hold_each_ranks_slices_with_checksums(tmp_path, chat_model):
    import torch
    from safetensors.torch import load_file

    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.artifacts.verify import read_lock, shard_problem, verify
    from deploykit.model.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(chat_model)
    dst = write_rank_shards(checkpoint, tmp_path / "ranks", rank_layout(checkpoint, ranks=2, dtype="float32"))
    full = load_file(str(chat_model / "model.safetensors"))
    r0, r1 = (load_file(str(dst / f"rank-{r}-of-2.safetensors")) for r in (0, 1))
    q = "model.layers.0.self_attn.q_proj.weight"  # colwise: rows split
    o = "model.layers.0.self_attn.o_proj.weight"  # rowwise: columns split
    norm = "model.layers.0.input_layernorm.weight"  # replicated
    assert torch.equal(torch.cat([r0[q], r1[q]], 0), full[q]) and r0[q].shape[0] == full[q].shape[0] // 2
    assert torch.equal(torch.cat([r0[o], r1[o]], 1), full[o]) and r0[o].shape[1] == full[o].shape[1] // 2
    assert torch.equal(r0[norm], full[norm]) and torch.equal(r1[norm], full[norm])
    assert set(r0) == set(r1) == set(full)
    lock = read_lock(dst)
    assert lock is not None and [s["file"] for s in lock["shards"]] == ["rank-0-of-2.safetensors",
                                                                       "rank-1-of-2.safetensors"]
    assert shard_problem(dst, lock, hashes=True) is None
    assert verify(dst) == []
    size = sum((dst / s["file"]).stat().st_size for s in lock["shards"])
    assert size < 1.05 * (chat_model / "model.safetensors").stat().st_size  # slices, not copies
    with open(dst / "rank-1-of-2.safetensors", "r+b") as fh:  # a flipped byte is caught
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    assert "differs from its recorded checksum" in shard_problem(dst, lock, hashes=True)
    assert verify(dst) == [f"{dst / 'rank-1-of-2.safetensors'}: content hash differs from the lock file (the file "
                           "was modified)"]


def test_a_tied_head_gets_its_slices_from_the_embeddings(tmp_path, tiny_model):
    import torch
    from safetensors.torch import load_file

    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.model.checkpoint import open_checkpoint

    source = tiny_model("llama-tied")
    checkpoint = open_checkpoint(source)
    dst = write_rank_shards(checkpoint, tmp_path / "ranks", rank_layout(checkpoint, ranks=2, dtype="float32"))
    full = load_file(str(source / "model.safetensors"))
    assert "lm_head.weight" not in full
    r1 = load_file(str(dst / "rank-1-of-2.safetensors"))
    assert torch.equal(r1["lm_head.weight"], full["model.embed_tokens.weight"][128:])


def test_library_greedy_equals_one_process_and_ranks_read_only_their_file(tmp_path, chat_model):
    from concurrent.futures import ThreadPoolExecutor

    from deploykit import Deployment

    prompts = ["hello there", "tensor parallel", "a", "the quick brown fox"]
    expected = {p: reference(chat_model, p, 12) for p in prompts}
    with Deployment.from_manifest(chat_manifest(tmp_path, chat_model), state_dir=tmp_path / "state") as dep:
        group, shards = _ranks_of(dep)
        engine = _runtime_of(dep).engine
        infos = group.info()
        assert [i["rank"] for i in infos] == [0, 1]
        assert [i["files_read"] for i in infos] == [[str(shards / f"rank-{r}-of-2.safetensors")] for r in (0, 1)]
        assert [dep.generate(p, max_tokens=12).text for p in prompts] == [expected[p] for p in prompts]
        with ThreadPoolExecutor(4) as pool:  # together: one left-padded batch on the ranks
            texts = list(pool.map(lambda p: dep.generate(p, max_tokens=12).text, prompts))
        assert texts == [expected[p] for p in prompts]
        deadline = time.monotonic() + 30  # a batch frees its caches on every rank just after its last token
        while engine.stats() != {"running": 0, "waiting": 0}:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.05)
        assert [i["open_groups"] for i in group.info()] == [[], []]
        pids = group.pids
        assert all(_alive(pid) for pid in pids)
        os.kill(pids[1], signal.SIGKILL)  # a rank dies under a serving generation: requests fail, none hang
        with pytest.raises(RequestError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            dep.generate("hello there", max_tokens=4)
        assert not group.alive() and not _alive(pids[0])  # the broken group stopped its other rank
    assert not any(_alive(pid) for pid in pids)  # close stopped every rank


def test_ranks_exit_when_their_driver_is_killed(tmp_path, chat_model):
    import subprocess
    import sys

    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.model.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(chat_model)
    shards = write_rank_shards(checkpoint, tmp_path / "ranks", rank_layout(checkpoint, ranks=2, dtype="float32"))
    driver = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from deploykit.engine.tensor_parallel.group import RankGroup
from deploykit.engine.tensor_parallel.runtime import RankOptions, rank_specs
if __name__ == "__main__":
    group = RankGroup.start(rank_specs(Path({str(shards)!r}), RankOptions(ranks=2)))
    print(*group.pids, flush=True)
    sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        driver.kill()  # no close, no atexit: the ranks must notice on their own
        driver.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, "a rank outlived its driver"
            time.sleep(0.1)
    finally:
        driver.kill()


def _runtime_of(dep):
    gen = dep.pool.pin(10)
    try:
        return gen.runtime
    finally:
        dep.pool.unpin(gen)


def _ranks_of(dep) -> tuple:
    gen = dep.pool.pin(10)
    try:
        return gen.runtime.ranks, gen.loaded.source
    finally:
        dep.pool.unpin(gen)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not running
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> set[int]:
    """Live rank processes whose parent is ``pid`` (from /proc; not multiprocessing's resource tracker)."""
    import os

    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z" and _is_rank(int(entry)):
                found.add(int(entry))
    return found


def _is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"spawn_main" in fh.read()
    except OSError:
        return False


def test_serve_completions_reloads_a_dying_rank_and_sigterm(tmp_path, chat_model):
    import threading

    import openai

    from manifests import replace_like_an_editor
    from servers import Server
    from test_serve_reload import status, wait_for

    prompts = ["hello there", "tensor parallel", "a", "the quick brown fox"]
    expected = {p: reference(chat_model, p, 12) for p in prompts}
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = chat_manifest(manifests, chat_model)
    failpoint = tmp_path / "failpoint"
    with Server(manifests, tmp_path / "state", env={"DEPLOYKIT_TP_FAILPOINT": str(failpoint)}) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def complete(prompt: str) -> str:
            answer = client.completions.create(model="tp-chat", prompt=prompt, max_tokens=12, temperature=0)
            return answer.choices[0].text

        assert server.process is not None
        first = _children(server.process.pid)
        assert len(first) == 2, first  # the ranks are the server's own children
        assert [complete(p) for p in prompts] == [expected[p] for p in prompts]
        results: dict[str, str] = {}
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, complete(p))) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == expected
        stream = client.completions.create(model="tp-chat", prompt=prompts[3], max_tokens=12, temperature=0,
                                           stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == expected[prompts[3]]

        # a new revision whose rank 1 dies at its first step (the health check): the old one keeps serving
        failpoint.write_text("exit-on-step:1")
        replace_like_an_editor(path, CHAT.format(path=chat_model, ranks=2, name="tp-chat").replace(
            "default_max_tokens: 12", "default_max_tokens: 11"))
        wait_for(lambda: "rank 1" in (status(server.url)["last_error"] or ""), timeout=180)
        assert "exited with code 17" in status(server.url)["last_error"]
        assert status(server.url)["generation"] == 1
        assert [complete(p) for p in prompts] == [expected[p] for p in prompts]
        wait_for(lambda: _children(server.process.pid) == first)  # the failed generation's ranks are gone

        # blue-green, then recreate: new ranks serve the same greedy tokens, the old ones exit
        failpoint.unlink()
        for generation, strategy in ((2, "blue-green"), (3, "recreate")):
            replace_like_an_editor(path, CHAT.format(path=chat_model, ranks=2, name="tp-chat").replace(
                "max_concurrent: 4", f"max_concurrent: {generation + 2}") + f"  rollout: {{strategy: {strategy}}}\n")
            wait_for(lambda: status(server.url)["generation"] == generation, timeout=180)
            assert [complete(p) for p in prompts] == [expected[p] for p in prompts]
            wait_for(lambda: len(_children(server.process.pid) & first) == 0)
        ranks = _children(server.process.pid)
        assert len(ranks) == 2
    assert server.process.returncode == 0
    assert not any(_alive(pid) for pid in ranks | first)  # SIGTERM stopped every rank


def test_rank_peak_rss_is_its_share_plus_the_runtime(tmp_path, chat_model):
    """Each rank of a ~190 MB model stays within a tiny model's rank (the runtime: torch, transformers)
    plus its half and a quarter of the model; a rank that read the whole checkpoint would not."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.engine.tensor_parallel.runtime import RankOptions, rank_specs
    from deploykit.engine.tensor_parallel.group import RankGroup
    from deploykit.model.checkpoint import open_checkpoint

    big = tmp_path / "big"
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(big)
    full = (big / "model.safetensors").stat().st_size
    assert full > 150 * 2**20

    def peaks(model: Path) -> list[int]:
        checkpoint = open_checkpoint(model)
        shards = write_rank_shards(checkpoint, tmp_path / f"{model.name}-ranks",
                                   rank_layout(checkpoint, ranks=2, dtype="float32"))
        group = RankGroup.start(rank_specs(shards, RankOptions(ranks=2)))
        try:
            ids = torch.tensor([[1, 2, 3]])
            group.step("g", ids, torch.ones_like(ids), torch.arange(3)[None])
            return [i["peak_rss"] for i in group.info()]
        finally:
            group.close()

    runtime = max(peaks(chat_model))
    for peak in peaks(big):
        assert peak < runtime + full / 2 + full / 4, (peak, runtime, full)


def test_a_warm_tensor_parallel_plan_imports_no_torch(tmp_path, llama):
    import subprocess
    import sys

    path = write(tmp_path, llama)
    assert deploykit("plan", str(path), "--devices", "cpu=8GiB").returncode == 0  # warms the structure cache
    probe = subprocess.run([sys.executable, "-c", f"""
import sys
from deploykit.spec.manifest import load_manifests
from deploykit.placement.planning import plan_manifest
plan = plan_manifest(load_manifests({str(path)!r})[0], devices="cpu=8GiB")
print(len(plan.devices), 'torch' in sys.modules, 'transformers' in sys.modules)
"""], capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["2", "False", "False"], probe.stderr


def test_a_restart_verifies_the_rank_files_and_lays_a_damaged_one_out_again(tmp_path, chat_model, caplog):
    from deploykit import Deployment

    manifest = chat_manifest(tmp_path, chat_model)
    expected = reference(chat_model, "hello there", 8)
    with Deployment.from_manifest(manifest, state_dir=tmp_path / "state") as dep:
        _, shards = _ranks_of(dep)
        revision = dep.last_outcome.revision
    damaged = shards / "rank-0-of-2.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1  # same size, other content
    damaged.write_bytes(bytes(data))
    with caplog.at_level("WARNING"), Deployment.from_manifest(manifest, state_dir=tmp_path / "state") as dep:
        assert dep.generate("hello there", max_tokens=8).text == expected
        _, again = _ranks_of(dep)
        assert again == shards and dep.last_outcome.revision == revision + 1
    assert "rank-0-of-2.safetensors: content differs from its recorded checksum" in caplog.text
    assert "laying the rank shards out again" in caplog.text


def test_blue_green_room_counts_every_cpu_rank(tmp_path, llama):
    """A simulated host's memory left beside a serving tensor-parallel generation is net of all its
    ranks, so a rollout does not plan a second copy into memory the first one holds."""
    from deploykit.control.live.pool import Generation
    from deploykit.control.live.rollout import inventory_beside
    from deploykit.placement.inventory import resolve
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import load_manifests

    plan = plan_manifest(load_manifests(write(tmp_path, llama))[0], devices="cpu=8GiB")
    assert [d.tier for d in plan.devices] == ["cpu", "cpu"]
    beside = inventory_beside(resolve("cpu=8GiB"), Generation(1, 1, None, plan))
    assert beside.cpu == 8 * 2**30 - plan.devices[0].bytes - plan.devices[1].bytes


def test_cli_apply_lays_out_rank_files_and_checks_the_ranks(tmp_path, chat_model):
    manifest = chat_manifest(tmp_path, chat_model)
    env = {"DEPLOYKIT_STATE": str(tmp_path / "state")}
    result = deploykit("apply", str(manifest), env=env)
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in (tmp_path / "state" / "shards" / "tp-chat").glob("*/rank-*.safetensors"))
    assert files == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    [status] = json.loads(deploykit("status", "-o", "json", env=env).stdout)
    assert status["phase"] == "Ready" and [d["device"] for d in status["plan"]["devices"]] == ["cpu:0", "cpu:1"]
    [revision] = json.loads(deploykit("history", "tp-chat", "-o", "json", env=env).stdout)
    assert revision["reason"].startswith("causal-lm forward through 2 tensor-parallel ranks")


def test_cli_reshard_writes_rank_files_and_verify_checks_them(tmp_path, chat_model):
    dst = tmp_path / "ranks"
    result = deploykit("reshard", str(chat_model), str(dst), "--max-shard-size", "1GiB", "--dtype", "float32",
                       "--tensor-parallel", "2")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in dst.glob("*.safetensors")) == ["rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    assert deploykit("verify", str(dst)).returncode == 0
    no_dtype = deploykit("reshard", str(chat_model), str(tmp_path / "x"), "--max-shard-size", "1GiB",
                         "--tensor-parallel", "2")
    assert no_dtype.returncode == 2 and "--dtype" in no_dtype.stderr


def test_a_rank_that_cannot_build_fails_the_start_and_stops_the_others(tmp_path, chat_model):
    from deploykit.artifacts.rank_shards import rank_layout, write_rank_shards
    from deploykit.engine.tensor_parallel.group import RankFailed, RankGroup
    from deploykit.engine.tensor_parallel.runtime import RankOptions, rank_specs
    from deploykit.model.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(chat_model)
    shards = write_rank_shards(checkpoint, tmp_path / "ranks", rank_layout(checkpoint, ranks=2, dtype="float32"))
    (shards / "rank-1-of-2.safetensors").unlink()
    before = _children(os.getpid())
    with pytest.raises(RankFailed, match=r"rank 1 failed: .*rank-1-of-2\.safetensors"):
        RankGroup.start(rank_specs(shards, RankOptions(ranks=2)), timeout=120)
    assert _children(os.getpid()) == before  # the rank that built its share was stopped too
