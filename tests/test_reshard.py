"""Streaming resharding on real safetensors files from tiny real models."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deploykit.model.checkpoint import LOCK, open_checkpoint
from deploykit.errors import CheckpointError
from deploykit.artifacts.layout import plan_layout
from deploykit.artifacts.reshard import reshard
from deploykit.artifacts.verify import verify

KiB = 1024


def tensors_of(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def tree_digest(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tiny_model, tmp_path) -> Path:
    """A private copy of the tiny Llama checkpoint (tests may damage it)."""
    return Path(shutil.copytree(tiny_model("llama"), tmp_path / "src"))


def test_reshard_splits_and_is_bitwise_equal(src, tmp_path):
    dst = tmp_path / "dst"
    before = tree_digest(src)
    result = reshard(src, dst, max_shard_size=100 * KiB)
    assert result.status == "written" and len(result.layout.shards) > 3
    shards = sorted(dst.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [s.file for s in result.layout.shards]
    for p in shards:  # safetensors' own reader accepts every file
        with safe_open(p, "pt") as fh:
            assert list(fh.keys())
        assert p.stat().st_size - 8 - struct.unpack("<Q", p.read_bytes()[:8])[0] <= 100 * KiB or \
            len(safe_open(p, "pt").keys()) == 1
    original, resharded = tensors_of(src), tensors_of(dst)
    assert original.keys() == resharded.keys()
    assert all(torch.equal(original[k], resharded[k]) and original[k].dtype == resharded[k].dtype
               for k in original)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    assert set(index["weight_map"]) == set(original)
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert tree_digest(src) == before  # the source is untouched
    assert verify(dst) == []
    assert not list(tmp_path.glob(".dst.deploykit-*"))  # no staging left behind


def test_resharded_checkpoint_gives_identical_logits(src, tmp_path):
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "dst"
    reshard(src, dst, max_shard_size=64 * KiB)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_sharded_source_with_index(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model("gpt2")).save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    dst = tmp_path / "one"
    result = reshard(sharded, dst, max_shard_size=100 * 2**20)
    assert len(result.layout.shards) == 1
    original, resharded = tensors_of(sharded), tensors_of(dst)
    assert all(torch.equal(original[k], resharded[k]) for k in original)


def test_dtype_conversion_streams_and_matches_torch(src, tmp_path):
    dst = tmp_path / "bf16"
    reshard(src, dst, max_shard_size=1 << 20, dtype="bfloat16")
    original, converted = tensors_of(src), tensors_of(dst)
    for k, t in original.items():
        assert converted[k].dtype == torch.bfloat16
        assert torch.equal(converted[k], t.to(torch.bfloat16))
    assert verify(dst) == []


def test_device_aligned_layout_never_mixes_devices(src, tmp_path):
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 1,
                  "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
    dst = tmp_path / "aligned"
    result = reshard(src, dst, max_shard_size=10 * 2**20, device_map=device_map)
    devices = [s.device for s in result.layout.shards]
    assert devices == ["0", "1", "cpu", "disk"]  # one shard each: all fit, none mixes
    lock = json.loads((dst / LOCK).read_text())
    for shard in lock["shards"]:
        owners = {next(device_map[m] for m in device_map if n.startswith(m + "."))
                  for n in shard["tensors"]}
        assert len(owners) == 1
    first = result.layout.shards[0].tensors
    assert first[0].startswith("model.embed_tokens")  # execution order


def test_layout_without_plan_uses_natural_order(src):
    layout = plan_layout(open_checkpoint(src), max_shard_size=10**9)
    names = layout.shards[0].tensors
    layers = [n.split(".")[2] for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers, key=int)


def test_second_run_rewrites_nothing(src, tmp_path):
    dst = tmp_path / "dst"
    reshard(src, dst, max_shard_size=100 * KiB)
    stamps = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    again = reshard(src, dst, max_shard_size=100 * KiB)
    assert again.status == "unchanged" and again.bytes_written == 0
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()} == stamps


def test_new_layout_replaces_the_old_one_whole(src, tmp_path):
    dst = tmp_path / "dst"
    reshard(src, dst, max_shard_size=64 * KiB)
    many = len(list(dst.glob("model-*")))
    reshard(src, dst, max_shard_size=10 * 2**20)
    assert len(list(dst.glob("model-*"))) == 1 < many
    assert verify(dst) == []


def test_source_change_triggers_rewrite(src, tmp_path):
    dst = tmp_path / "dst"
    reshard(src, dst, max_shard_size=10 * 2**20)
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    assert reshard(src, dst, max_shard_size=10 * 2**20).status == "written"
    assert torch.equal(tensors_of(dst)["lm_head.weight"], state["lm_head.weight"])


def test_verify_finds_damage(src, tmp_path):
    dst = tmp_path / "dst"
    reshard(src, dst, max_shard_size=100 * KiB)
    shard = sorted(dst.glob("model-*"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert any("content hash differs" in p for p in verify(dst))
    shard.unlink()
    assert any("missing" in p for p in verify(dst))
    assert "no valid deploykit.lock.json" in verify(src)[0]


def test_oversized_tensor_gets_its_own_shard(src, tmp_path):
    result = reshard(src, tmp_path / "dst", max_shard_size=10 * KiB)
    assert "model.embed_tokens.weight" in result.layout.oversized
    assert any("larger than max_shard_size" in w for w in result.warnings)
    for shard in result.layout.shards:
        assert shard.nbytes <= 10 * KiB or len(shard.tensors) == 1


# ---------------------------------------------------------------------------------------------------
# Bad input: a clear error, SRC untouched, DST without partial files.


def damaged(src: Path, how: str) -> Path:
    path = src / "model.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    if how == "truncated-header":
        path.write_bytes(data[: 8 + length // 2])
    elif how == "corrupt-header":
        path.write_bytes(data[:8] + b"{" + b"x" * (length - 1) + data[8 + length:])
    elif how == "cut-data":
        path.write_bytes(data[:-100])
    elif how == "huge-length":
        path.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    elif how == "tiny-file":
        path.write_bytes(b"\x01\x02")
    return src


@pytest.mark.parametrize("how,message", [
    ("truncated-header", "corrupt safetensors header"), ("corrupt-header", "not valid JSON"),
    ("cut-data", "truncated"), ("huge-length", "corrupt safetensors header"), ("tiny-file", "truncated"),
])
def test_corrupt_input(src, tmp_path, how, message):
    damaged(src, how)
    before = tree_digest(src)
    dst = tmp_path / "dst"
    with pytest.raises(CheckpointError, match=message) as info:
        reshard(src, dst, max_shard_size=100 * KiB)
    assert "model.safetensors" in str(info.value)
    assert tree_digest(src) == before
    assert not dst.exists() and not list(tmp_path.glob(".dst.*"))


def test_missing_shard_named_by_index(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model("llama")).save_pretrained(sharded, max_shard_size="100KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"do not exist: .*{victim.name}"):
        reshard(sharded, tmp_path / "dst", max_shard_size=1 << 20)


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_dst_and_src_must_be_apart(src, where):
    dst = {"same": src, "inside": src / "out", "parent": src.parent}[where]
    before = tree_digest(src)
    with pytest.raises(CheckpointError, match="SRC|source"):
        reshard(src, dst, max_shard_size=1 << 20)
    assert tree_digest(src) == before


def test_foreign_destination_is_not_replaced(src, tmp_path):
    dst = tmp_path / "precious"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not written by deploykit"):
        reshard(src, dst, max_shard_size=1 << 20)
    assert (dst / "notes.txt").read_text() == "keep me"


def test_pickle_refused_unless_allowed(src, tmp_path):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(src / "config.json", pickled / "config.json")
    torch.save(load_file(src / "model.safetensors"), pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="--allow-pickle"):
        reshard(pickled, tmp_path / "dst", max_shard_size=1 << 20)
    reshard(pickled, tmp_path / "dst", max_shard_size=100 * KiB, allow_pickle=True)
    original, resharded = tensors_of(src), tensors_of(tmp_path / "dst")
    assert all(torch.equal(original[k], resharded[k]) for k in original)


def test_pickle_with_code_is_refused(src, tmp_path):
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"weight": torch.zeros(2), "payload": os.system}, evil / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused"):
        reshard(evil, tmp_path / "dst", max_shard_size=1 << 20, allow_pickle=True)


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path, request):
    mount = tmp_path / "small"
    if not _tmpfs(mount, request.param):
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("small_fs", ["600k"], indirect=True)
def test_disk_full_is_detected_before_writing(src, small_fs):
    dst = small_fs / "dst"
    with pytest.raises(CheckpointError, match="not enough disk space"):
        reshard(src, dst, max_shard_size=100 * KiB)
    assert not dst.exists() and list(small_fs.iterdir()) == []


class FillDiskMidway:
    """A progress sink that, once some bytes are written, lets another writer take all free space."""

    def __init__(self, filler: Path) -> None:
        self.filler, self.seen = filler, 0

    def start(self, total: int, done: int) -> None:
        pass

    def advance(self, n: int) -> None:
        self.seen += n
        if self.seen > 200 * KiB and not self.filler.exists():
            with open(self.filler, "wb") as fh:
                try:
                    while True:
                        fh.write(b"\0" * 4096)
                        fh.flush()
                except OSError:
                    pass


@pytest.mark.parametrize("small_fs", ["3m"], indirect=True)
def test_disk_full_while_writing_leaves_nothing(src, small_fs):
    dst = small_fs / "dst"
    with pytest.raises(CheckpointError, match="no space left"):
        reshard(src, dst, max_shard_size=100 * KiB, progress=FillDiskMidway(small_fs / "filler"))
    assert not dst.exists()
    assert [p.name for p in small_fs.iterdir()] == ["filler"]
