"""Live adapter changes swap, never mutate (control/live/adapters.py on a real Deployment, tiny model, real
PEFT adapters): a change whose adapter fails to load leaves the base and the served adapters answering bit for
bit as before and the recorded revision what serves; removals and changes never wait for requests, so a close
during one returns at once; adapter files saved again in place are a change (a new revision), not served
silently."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deploykit.control.live.deployment import Deployment
from deploykit.engine.batching import GenerationRequest
from lora import adapters_manifest, altered_copy, chat_ids, last_logits

TOKENS = 12


def _answer(dep: Deployment, model: str | None, prompt: list[int]) -> list[int]:
    gen = dep.pin()
    try:
        engine: Any = gen.runtime.engine  # type: ignore[union-attr]
        return list(engine.submit(GenerationRequest(prompt, max_new_tokens=TOKENS, adapter=model)).result(120)
                    .token_ids)
    finally:
        dep.unpin(gen)


def _adapters(dep: Deployment) -> Any:
    gen = dep.pin()
    dep.unpin(gen)
    return gen.runtime.adapters  # type: ignore[union-attr]


def _seen(dep: Deployment, prompt: list[int]) -> tuple[Any, ...]:
    """What serves: the base's logits and greedy answer, pirate's logits and answer, the names served."""
    adapters = _adapters(dep)
    slot = adapters.hold("pirate")
    try:
        pirate = last_logits(adapters, prompt, slot)
    finally:
        adapters.release(slot)
    return (last_logits(adapters, prompt), _answer(dep, None, prompt), pirate, _answer(dep, "pirate", prompt),
            adapters.names())


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all((x == y).all().item() if hasattr(x, "shape") else x == y for x, y in zip(a, b))


def test_a_failed_add_and_a_failed_change_leave_everything_serving_as_before(lora: Any, tmp_path: Path) -> None:
    broken = altered_copy(lora.polite, tmp_path / "broken", truncate=True)  # validates (header), fails to load
    path = tmp_path / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate}))
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        prompt = chat_ids(lora.base, "hi")
        before, revision, generation = _seen(dep, prompt), dep.state().revision, dep.generation
        for adapters in ({"pirate": lora.pirate, "broken": broken}, {"pirate": broken}):  # an add, a change
            path.write_text(adapters_manifest(lora.base, adapters))
            with pytest.raises(Exception):
                dep.reconcile()
            assert _same(_seen(dep, prompt), before), adapters
            assert dep.state().revision == revision and dep.generation == generation
            current = dep.store.current("chat")
            assert current is not None and current.revision == revision
            assert len(_adapters(dep).slots()) == 1  # nothing of the failed load is left
            failed = dep.store.history("chat")[-1]
            assert failed.phase == "Failed" and "could not be loaded" in (failed.reason or ""), failed
    finally:
        dep.close()


def test_close_during_an_adapter_change_with_a_request_running_returns_at_once(lora: Any, tmp_path: Path) -> None:
    """The removed adapter and the changed one each hold a running request: the change is applied at once
    (the requests finish with the versions they started with), and close does not wait behind it."""
    path = tmp_path / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite}))
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    adapters = _adapters(dep)
    running = [adapters.hold("pirate"), adapters.hold("polite")]
    try:
        path.write_text(adapters_manifest(lora.base, {"polite": lora.pirate}))  # pirate removed, polite changed
        changing = threading.Thread(target=dep.reconcile)
        changing.start()
        changing.join(30)
        assert not changing.is_alive(), "the change waited for the running requests"
        assert adapters.names() == ["polite"] and dep.state().revision == 2
        started = time.monotonic()
        dep.close(timeout=30)
        assert time.monotonic() - started < 5
    finally:
        for slot in running:
            adapters.release(slot)
        dep.close()


def test_adapter_files_saved_again_in_place_are_a_new_revision(lora: Any, tmp_path: Path) -> None:
    """Live (a reconcile of the same manifest) and at a restart: the revision pins the adapter's files."""
    adapter = tmp_path / "adapter"
    shutil.copytree(lora.pirate, adapter)
    path = tmp_path / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {"pirate": adapter}))
    state = tmp_path / "state"
    prompt = chat_ids(lora.base, "hi")
    dep = Deployment.from_manifest(path, state_dir=state)
    try:
        pirate = _answer(dep, "pirate", prompt)
        generation = dep.generation
        _save_over(adapter, lora.polite)
        result = dep.reconcile()
        assert result.strategy == "live" and dep.generation == generation and dep.state().revision == 2
        assert _answer(dep, "pirate", prompt) != pirate  # polite's files serve now
        polite = _answer(dep, "pirate", prompt)
    finally:
        dep.close()
    _save_over(adapter, lora.pirate)
    dep = Deployment.from_manifest(path, state_dir=state)  # a restart: the files changed meanwhile
    try:
        assert dep.state().revision == 3
        assert _answer(dep, "pirate", prompt) == pirate != polite
    finally:
        dep.close()


def _save_over(adapter: Path, source: Path) -> None:
    """``source``'s files written over ``adapter``'s, as a training run saving in place does."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(source / name, adapter / name)


def test_a_live_add_sizes_the_kv_room_for_the_plan_with_the_adapter(lora: Any, tmp_path: Path) -> None:
    """Adapters take room the KV cache had (placement.kv.kv_budget): after a live add, new requests are
    admitted against the KV room the new plan leaves, not the old plan's."""
    from deploykit.control.live.pool import kv_cache_budget

    budget = "  offload: {cpu: {max_memory: 96MiB}}\n"  # a CPU budget: the plan says how much KV fits
    path = tmp_path / "chat.yaml"
    path.write_text(adapters_manifest(lora.base, {}) + budget)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        gen = dep.pin()
        dep.unpin(gen)
        engine: Any = gen.runtime.engine  # type: ignore[union-attr]
        before = engine.kv_cache_bytes
        assert before == kv_cache_budget(gen.plan)
        path.write_text(adapters_manifest(lora.base, {"pirate": lora.pirate, "polite": lora.polite}) + budget)
        dep.reconcile()
        assert dep.generation == gen.number  # applied live, on the same generation
        assert engine.kv_cache_bytes == kv_cache_budget(gen.plan) < before
    finally:
        dep.close()
