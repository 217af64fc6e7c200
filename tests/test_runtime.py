"""Deployment: a live model in this process, reloaded under load with real threads and real files."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from deploykit.errors import ApplyError
from deploykit.placement.inventory import process_rss
from deploykit.control.live.deployment import Deployment
from deploykit.control.revisions.loading import serving_of
from deploykit.spec.manifest import load_manifests
from manifests import manifest_text, replace_like_an_editor, write_manifest

IDS = torch.tensor([[1, 7, 42, 100, 3, 9]])


def reference_logits(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(IDS).logits


class Load:
    """Threads that run forward passes without pause and check every output."""

    def __init__(self, dep: Deployment, expected: torch.Tensor, threads: int = 3) -> None:
        self.dep, self.expected = dep, expected
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.generations: set[int] = set()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                generation = self.dep.generation
                with self.dep.acquire(timeout=60) as m, torch.no_grad():
                    out = m(IDS).logits
                if not torch.equal(out, self.expected):
                    self.failures.append(f"generation {generation}: different logits")
                self.generations.add(generation)
                self.ok += 1
            except Exception as exc:  # every failure is recorded: the test requires none
                self.failures.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def test_library_basics(model, tmp_path):
    path = write_manifest(tmp_path, model, cpu=300_000)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    assert dep.generation == 1
    status = dep.status()
    assert (status["name"], status["phase"], status["revision"], status["serving"]) == ("tiny", "Ready", 1, True)
    assert not status["serialize_forward"]  # CPU plan: disk blocks are mapped, no offload hooks
    with dep.acquire() as m, torch.no_grad():
        assert torch.equal(m(IDS).logits, reference_logits(model))
    dep.close()
    with pytest.raises(ApplyError, match="closed"):
        with dep.acquire(timeout=1):
            pass


def test_reload_under_load_never_fails_a_request(model, tmp_path):
    path = write_manifest(tmp_path, model)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    seen = []
    dep.on_reload(lambda d: seen.append(d.generation))
    expected = reference_logits(model)
    with Load(dep, expected) as load:
        steps = [
            (manifest_text(model, cpu=300_000), True),  # tier change: part of the model to disk
            (manifest_text(model, cpu=300_000, shard="100KiB"), True),  # shard-size change
            ('apiVersion: deploykit/v1\nkind: "ModelDeployment\n', False),  # broken YAML
            (manifest_text(model, cpu=300_000, shard="100KiB"), False),  # identical rewrite
            (manifest_text(model, cpu=300_000, shard="100KiB").replace("float32", "fp8"), False),  # invalid
            (manifest_text(model), True),  # fixed
        ]
        generations = []
        for text, swaps in steps:
            replace_like_an_editor(path, text)
            assert dep.reload() is swaps
            generations.append(dep.generation)
            broken = dep.status()["last_error"] is not None  # pending: the last good generation serves
            assert dep.status()["phase"] == ("Failed" if broken else "Ready") and dep.status()["serving"]
            if text.startswith("apiVersion: deploykit/v1\nkind: \"Model"):
                assert f"{path}:2:7: invalid YAML" in dep.status()["last_error"]
                assert dep.status()["phase"] == "Failed" and dep.status()["serving"]  # generation 3 serves on
            time.sleep(0.2)
    assert load.failures == []
    assert load.ok > 20 and load.generations >= {1, 2, 3}
    assert generations == [2, 3, 3, 3, 3, 4]
    assert seen == [2, 3, 4]
    assert dep.status()["last_error"] is None
    assert [r.ok for r in dep.reloads] == [True, True, False, False, True]  # the identical rewrite: no-op
    events = [e.kind for e in dep.store.events("tiny", limit=50)]
    assert events.count("ReloadFailed") == 2
    dep.close()


def test_invalid_field_error_has_file_line(model, tmp_path):
    path = write_manifest(tmp_path, model)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    path.write_text(manifest_text(model).replace("dtype: float32", "dtype: fp8"))
    assert dep.reload() is False
    assert f"{path}:9:12: spec.model.dtype:" in dep.status()["last_error"]
    # plan infeasible: 100 bytes of CPU, 1 KiB of disk
    path.write_text(manifest_text(model, cpu=100).replace("max_size: 1GiB", "max_size: 1KiB"))
    assert dep.reload() is False
    assert f"{path}:15:3: spec.offload:" in dep.status()["last_error"]
    assert dep.generation == 1
    dep.close()


def test_watch_reloads_on_real_file_events(model, tmp_path):
    path = write_manifest(tmp_path, model)
    dep = Deployment.from_manifest(path, watch=True, state_dir=tmp_path / "state", debounce=0.2)

    def wait_for(predicate, timeout=60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return False

    try:
        with Load(dep, reference_logits(model), threads=2) as load:
            replace_like_an_editor(path, manifest_text(model, cpu=300_000))
            assert wait_for(lambda: dep.generation == 2)
            revisions = len(dep.store.history(dep.name))
            path.touch()  # a touch: no content change, no reload
            path.write_text("spec: [\n")  # then broken in place; file events are handled in order
            assert wait_for(lambda: dep.status()["last_error"] is not None)
            assert dep.generation == 2 and dep.status()["serving"]
            assert len(dep.store.history(dep.name)) == revisions  # neither the touch nor the break recorded one
            assert [r.ok for r in dep.reloads] == [True, False]  # one swap, then the failure: the touch did nothing
            replace_like_an_editor(path, manifest_text(model))  # fixed: recovers by itself
            assert wait_for(lambda: dep.generation == 3 and dep.status()["last_error"] is None)
        assert load.failures == [] and load.ok > 0
    finally:
        dep.close()


def test_recreate_waits_instead_of_failing(model, tmp_path):
    path = write_manifest(tmp_path, model, strategy="recreate")
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    with Load(dep, reference_logits(model)) as load:
        replace_like_an_editor(path, manifest_text(model, cpu=300_000, strategy="recreate"))
        assert dep.reload() is True
        time.sleep(0.3)
    assert load.failures == [] and dep.generation == 2
    assert dep.reloads[-1].strategy == "recreate"
    dep.close()


def test_failed_recreate_restores_the_last_good_revision(model, tmp_path):
    path = write_manifest(tmp_path, model, strategy="recreate")
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    broken = Path(shutil.copytree(model, tmp_path / "nan-model"))
    from safetensors.torch import load_file, save_file

    state = load_file(broken / "model.safetensors")
    state["model.norm.weight"][:] = float("nan")
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    replace_like_an_editor(path, manifest_text(broken, strategy="recreate"))
    assert dep.reload() is False
    assert "not finite" in dep.status()["last_error"]
    assert dep.status()["serving"] and dep.status()["revision"] == 1
    with dep.acquire(timeout=5) as m, torch.no_grad():
        assert torch.equal(m(IDS).logits, reference_logits(model))
    dep.close()


def test_auto_falls_back_to_recreate_when_both_do_not_fit(model, tmp_path):
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    path = tmp_path / "tiny.yaml"
    path.write_text(manifest_text(model, cpu="1GiB").replace("    disk: {path: offload, max_size: 1GiB}\n", ""))
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state", devices=f"cpu={int(size * 1.5)}")
    path.write_text(path.read_text().replace("200KiB", "100KiB"))
    assert dep.reload() is True
    assert dep.reloads[-1].strategy == "recreate"  # a second copy does not fit beside the first
    blue_green = tmp_path / "bg.yaml"
    blue_green.write_text(path.read_text().replace("strategy: auto", "strategy: blue-green"))
    dep.manifest_path = blue_green
    blue_green.write_text(blue_green.read_text().replace("100KiB", "150KiB"))
    assert dep.reload() is False and "does not fit" in dep.status()["last_error"]
    assert dep.generation == 2
    dep.close()


def test_offload_hooks_are_serialised_under_threads(model, tmp_path):
    """accelerate's disk-offload hooks break under concurrent forwards; deploykit runs one at a time."""
    from transformers import AutoModelForCausalLM

    from deploykit.engine.loader import LoadedModel

    path = write_manifest(tmp_path, model)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "disk", "model.norm": "disk",
                  "model.rotary_emb": "disk", "lm_head": "disk"}
    hooked = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, device_map=device_map,
                                                  offload_folder=str(tmp_path / "off"))
    loaded = LoadedModel(hooked, dep.pool.current.plan, model, "cpu", serialize_forward=True)
    dep.pool.install(loaded, dep.pool.current.plan, 1, "test", serving_of(load_manifests(path)[0]))
    assert dep.status()["serialize_forward"]
    active, peak = [0], [0]
    lock = threading.Lock()
    real_forward = hooked.forward

    def counting_forward(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real_forward(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    hooked.forward = counting_forward
    with Load(dep, reference_logits(model), threads=3) as load:
        time.sleep(2)
    assert load.failures == [] and load.ok > 5
    assert peak[0] == 1
    dep.close()


def test_memory_is_given_back_after_reloads(tiny_model, tmp_path):
    """A ~100 MB model reloaded 6 times: RSS stays within about one model of where it started."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    big = tmp_path / "big"
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(big)
    size = sum(p.stat().st_size for p in big.glob("*.safetensors"))
    path = write_manifest(tmp_path, big, shard="16MiB")
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    with dep.acquire() as m, torch.no_grad():
        m(IDS)
    start = process_rss()
    for i in range(6):
        cpu = "1GiB" if i % 2 else int(size * 0.6)
        shard = "16MiB" if i % 3 else "8MiB"
        replace_like_an_editor(path, manifest_text(big, cpu=cpu, shard=shard))
        assert dep.reload() is True
        with dep.acquire() as m, torch.no_grad():
            m(IDS)
    end = process_rss()
    assert dep.generation == 7
    assert end - start < size, f"RSS grew {(end - start) / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB model"
    assert all(r.rss_after is not None for r in dep.reloads)
    dep.close()


def test_leak_guard_warns_when_old_models_are_kept(tmp_path, caplog):
    """Keeping models past acquire() keeps their memory: the guard records RSS and warns."""
    import logging

    from transformers import AutoModelForCausalLM, LlamaConfig

    big = tmp_path / "big"
    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=32000)
    AutoModelForCausalLM.from_config(config).save_pretrained(big)
    path = write_manifest(tmp_path, big, shard="16MiB")
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    kept = []
    with caplog.at_level(logging.WARNING, logger="deploykit.control.live.pool"):
        for i in range(3):
            with dep.acquire() as m, torch.no_grad():
                m(IDS)
                kept.append(m)  # the mistake: a reference that outlives the with block
            replace_like_an_editor(path, manifest_text(big, shard="16MiB" if i % 2 else "8MiB"))
            assert dep.reload()
    assert len(dep.memory) == 3 and all(rss > 0 for _, rss in dep.memory)
    assert any("memory not reclaimed" in r.message for r in caplog.records)
    dep.close()
