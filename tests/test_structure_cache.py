"""The on-disk structure cache: same structure and plan as a fresh build, no torch/transformers when warm,
corrupt files ignored and rewritten, a new key for a changed config. Real tiny models and real configs; the
cache always lives in a tmp dir (DEPLOYKIT_CACHE), never in the user's home."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from deploykit.model import structure, structure_cache
from deploykit.model.structure import Structure, load_config, load_structure, structure_from_config
from deploykit.placement.inventory import parse_devices
from deploykit.placement.planner import plan
from deploykit.spec.schema import Spec
from tiny import TINY

CONFIGS = REPO / "manifests" / "configs"
TINY_CASES = ["llama", "llama-tied", "gpt2", "bert", "t5"]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty cache dir per test, and an empty in-process cache, so every load hits the disk."""
    directory = tmp_path / "structure-cache"
    monkeypatch.setenv(structure_cache.ENV_VAR, str(directory))
    monkeypatch.setattr(structure, "_STRUCTURES", {})
    return directory


def forget_in_process() -> None:
    structure._STRUCTURES.clear()


def no_rebuild(*args: object, **kwargs: object) -> None:
    raise AssertionError("the structure was rebuilt instead of read from the cache")


def plan_of(s: Structure, model_dir: Path) -> dict:
    spec = Spec.model_validate({"model": {"path": str(model_dir)}, "placement": {"gpus": [0, 1, 2], "reserve": 0}})
    per_gpu = -(-s.weight_bytes // 2**20) // 2 + 1  # two GPUs' worth holds it: all three get some
    return plan(s, spec, parse_devices(f"3x{per_gpu}MiB"), name="cache-test").to_dict()


@pytest.mark.parametrize("name", TINY_CASES + sorted(p.name for p in CONFIGS.iterdir()))
def test_cached_structure_equals_fresh_and_plans_identically(name, tiny_model, cache, monkeypatch):
    if name in TINY:
        model_dir, task, dtype = tiny_model(name), TINY[name][2], "float32"
    else:
        model_dir, task, dtype = CONFIGS / name, "causal-lm", "bfloat16"
    fresh = structure_from_config(load_config(model_dir), task=task, dtype=dtype)  # no cache involved

    first = load_structure(model_dir, task=task, dtype=dtype)  # builds and writes the cache
    assert len(list(cache.glob("*.json"))) == 1
    forget_in_process()
    monkeypatch.setattr(structure, "load_config", no_rebuild)
    cached = load_structure(model_dir, task=task, dtype=dtype)

    assert cached == fresh == first
    assert cached.to_dict() == fresh.to_dict()  # notes too (they are not part of ==)
    p_cached, p_fresh = plan_of(cached, model_dir), plan_of(fresh, model_dir)
    assert p_cached["digest"] == p_fresh["digest"]
    assert p_cached == p_fresh


WARM_RUN = """
import sys
from deploykit.cli import main
for args in ({plan!r}, {diff!r}):
    try:
        main(list(args), standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, exc.code
heavy = sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules)
print("HEAVY", ",".join(heavy))
"""


def test_second_process_imports_neither_torch_nor_transformers(tiny_model, cache, tmp_path):
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(
        "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: tiny}\n"
        f"spec:\n  model: {{path: {tiny_model('llama')}, dtype: float32}}\n"
        "  placement: {gpus: [0, 1], reserve: 0}\n")
    plan_args = ("plan", str(manifest), "--devices", "2x1GiB")
    diff_args = ("diff", str(manifest), "--devices", "2x1GiB", "--state-dir", str(tmp_path / "state"))
    code = WARM_RUN.format(plan=plan_args, diff=diff_args)
    env = {**os.environ, structure_cache.ENV_VAR: str(cache), "COLUMNS": "120"}

    def run() -> str:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                cwd=REPO, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()[-1]

    assert "transformers" in run()  # cold: built the structure (and the cache)
    assert len(list(cache.glob("*.json"))) == 1
    assert run() == "HEAVY "  # warm: plan and diff from the cache alone


@pytest.mark.parametrize("garbage", [
    b"", b"{not json", b"\xff\xfe", b"[]", b'{"key": "other", "payload": {}}',
    "truncated", "wrong field type", "unknown block kind",
])
def test_corrupt_cache_file_is_ignored_and_rewritten(garbage, tiny_model, cache):
    model_dir = tiny_model("gpt2")
    good = load_structure(model_dir, task="causal-lm", dtype="float16")
    (path,) = cache.glob("*.json")
    text = path.read_text()
    payload = json.loads(text)
    if garbage == "truncated":
        bad = text[: len(text) // 2].encode()
    elif garbage == "wrong field type":
        payload["payload"]["blocks"][0]["weight_bytes"] = "12"
        bad = json.dumps(payload).encode()
    elif garbage == "unknown block kind":
        payload["payload"]["blocks"][0]["kind"] = "mystery"
        bad = json.dumps(payload).encode()
    else:
        assert isinstance(garbage, bytes)
        bad = garbage
    path.write_bytes(bad)
    forget_in_process()

    again = load_structure(model_dir, task="causal-lm", dtype="float16")

    assert again.to_dict() == good.to_dict()
    assert path.read_text() == text  # rewritten, whole
    assert Structure.from_dict(structure_cache.load(path.stem)).to_dict() == good.to_dict()


def test_changed_config_gives_a_new_key(tiny_model, cache, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config))
    four = load_structure(model_dir, task="causal-lm", dtype="float16")

    config["num_hidden_layers"] = 2
    (model_dir / "config.json").write_text(json.dumps(config))
    two = load_structure(model_dir, task="causal-lm", dtype="float16")  # the in-process cache is not stale

    assert sum(b.kind == "layer" for b in four.blocks) == 4
    assert sum(b.kind == "layer" for b in two.blocks) == 2
    assert len(list(cache.glob("*.json"))) == 2
    load_structure(model_dir, task="causal-lm", dtype="float32")  # dtype is part of the key too
    assert len(list(cache.glob("*.json"))) == 3


def test_key_covers_config_bytes_task_dtype_remote_code_and_format(tmp_path):
    (tmp_path / "modeling_x.py").write_text("A = 1\n")

    def key(config: bytes = b"{}", **changes: object) -> str:
        args: dict = dict(model_dir=tmp_path, task="causal-lm", dtype="float16", trust_remote_code=False,
                          format_version=1)
        return structure_cache.structure_key(config, **{**args, **changes})

    variants = [key(), key(b"{ }"), key(task="seq2seq-lm"), key(dtype="float32"), key(trust_remote_code=True),
                key(format_version=2)]
    assert len(set(variants)) == len(variants)
    assert key() == variants[0]
    remote = key(trust_remote_code=True)
    (tmp_path / "modeling_x.py").write_text("A = 2\n")
    assert key(trust_remote_code=True) != remote
    assert key() == variants[0]  # code files matter only with trust_remote_code
    assert structure_cache.transformers_version() not in ("", "unknown")


def test_unwritable_cache_dir_means_no_caching(tiny_model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(structure_cache.ENV_VAR, str(blocker / "cache"))  # cannot be created, even by root
    s = load_structure(tiny_model("bert"), task="feature-extraction", dtype="float16")
    assert s.blocks and not list(tmp_path.rglob("*.json"))


def test_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert structure_cache.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("DEPLOYKIT_CACHE")
    assert structure_cache.cache_dir() == tmp_path / "xdg" / "deploykit" / "structures"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert structure_cache.cache_dir() == tmp_path / "home" / ".cache" / "deploykit" / "structures"
