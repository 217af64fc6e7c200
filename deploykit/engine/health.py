"""The health check a model passes before it serves: one real forward pass on a known input.

causal-lm: a forward over the input (the logits of the next token); feature-extraction: a forward
(the hidden states); seq2seq-lm: one decoder step. Every output must be finite, and the check must end
within its timeout (it runs in a worker thread; a pass that overruns fails the check).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ApplyError
from ..names import Task
from .loader import LoadedModel

T = TypeVar("T")


@dataclass(frozen=True)
class HealthResult:
    seconds: float
    detail: str


def _inputs(loaded: LoadedModel, text: str) -> dict[str, Any]:
    import torch

    if loaded.tokenizer is not None:
        encoded = loaded.tokenizer(text)  # lists, made into tensors on the input device
        inputs = {k: torch.tensor([v], device=loaded.input_device) for k, v in encoded.items()
                  if k in ("input_ids", "attention_mask", "token_type_ids")}
    else:  # no tokenizer shipped: a few in-vocabulary ids stand in for the text
        vocab = loaded.model.get_input_embeddings().num_embeddings
        ids = [(ord(c) % max(vocab - 1, 1)) + 1 for c in text[:16]] or [1]
        inputs = {"input_ids": torch.tensor([ids], device=loaded.input_device)}
    return inputs


def _forward(loaded: LoadedModel, text: str, task: str) -> str:
    import torch

    inputs = _inputs(loaded, text)
    with torch.no_grad():
        if task == Task.SEQ2SEQ_LM:
            start = loaded.model.config.decoder_start_token_id or 0
            decoder = torch.tensor([[start]], device=loaded.input_device)
            output = loaded.model(**inputs, decoder_input_ids=decoder).logits
        elif task == Task.CAUSAL_LM:
            output = loaded.model(**inputs).logits[:, -1]
        else:
            output = loaded.model(**inputs).last_hidden_state
    if not bool(torch.isfinite(output.float()).all()):
        raise ApplyError("health check failed: the model's output is not finite (NaN or inf)")
    return f"{task} forward on {inputs['input_ids'].shape[1]} tokens, output {tuple(output.shape)} finite"


def within(work: Callable[[], T], *, timeout: float, name: str = "deploykit-health") -> tuple[T, float]:
    """``work()`` on its own thread, bounded by ``timeout``: (its result, seconds). A failure or an
    overrun is an ApplyError (a thread that overruns is left to finish on its own: daemon)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except ApplyError as exc:
            outcome["error"] = str(exc)
        except Exception as exc:  # the model itself failed: report it, do not crash the caller
            outcome["error"] = f"health check failed: {type(exc).__name__}: {exc}"

    start = time.perf_counter()
    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(timeout)
    elapsed = time.perf_counter() - start
    if worker.is_alive():
        raise ApplyError(f"health check timed out after {timeout:g}s (health_check.timeout)")
    if "error" in outcome:
        raise ApplyError(outcome["error"])
    return outcome["value"], elapsed


def check(loaded: LoadedModel, *, task: str, text: str, timeout: float) -> HealthResult:
    """Run the check; raises ApplyError on a failure or a timeout."""
    detail, elapsed = within(lambda: _forward(loaded, text, task), timeout=timeout)
    return HealthResult(elapsed, detail)
