from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The structure cache of this run (subprocesses inherit it): never the user's ~/.cache.
os.environ["DEPLOYKIT_CACHE"] = tempfile.mkdtemp(prefix="deploykit-test-cache-")

from tiny import build  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model("llama")`` -> directory of a saved tiny real model, built once per test run."""
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build(name, root / name)
        return cache[name]

    return get


@pytest.fixture
def model(tiny_model: Callable[[str], Path], tmp_path: Path) -> Path:
    """A private copy of the tiny Llama (tests change, corrupt or delete its files)."""
    return Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_continuous_where_refused(items)
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU")
            for item in items:
                if item.get_closest_marker("cuda"):
                    item.add_marker(skip)


def _skip_continuous_where_refused(items: list[pytest.Item]) -> None:
    """Tests of the continuous backend, on a transformers it refuses (``make test-lowest``): skipped with the
    refusal, which tests/test_batching.py checks there."""
    if not any(item.get_closest_marker("continuous") for item in items):
        return
    import transformers

    from deploykit.engine.continuous import continuous_refusal

    refusal = continuous_refusal(transformers.__version__)
    if refusal is not None:
        for item in items:
            if item.get_closest_marker("continuous"):
                item.add_marker(pytest.mark.skip(reason=refusal))


@pytest.fixture(scope="session")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny chat model and real PEFT LoRA adapters trained on it (``pirate``, ``polite``), one for a tiny
    GPT-2 (another architecture) and one for a narrower Llama (another size): built once per test run."""
    from types import SimpleNamespace

    from chatmodel import build_chat_model
    from lora import train_adapter

    root = tmp_path_factory.mktemp("lora")
    base = build_chat_model(root / "base")
    narrow = build_chat_model(root / "narrow", hidden=32, intermediate=64)
    return SimpleNamespace(
        base=base,
        pirate=train_adapter(base, root / "pirate", text="user: hi\nassistant: arr matey arr matey arr matey"),
        polite=train_adapter(base, root / "polite", text="user: hi\nassistant: good day sir, good day sir", seed=1),
        gpt2=train_adapter(build(name="gpt2", directory=root / "gpt2"), root / "gpt2-lora", text="hello hello",
                           steps=2, target_modules=("c_attn",)),
        narrow=train_adapter(narrow, root / "narrow-lora", text="hi", steps=2))
