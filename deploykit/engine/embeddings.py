"""Sentence embeddings from a feature-extraction model, pooled as its checkpoint says.

A sentence-transformers checkpoint says how to pool in ``modules.json`` and ``1_Pooling/config.json``
(mean, CLS or max over the tokens; then a ``Normalize`` module or not). Those files are read here
rather than through the sentence-transformers package: deploykit already holds the loaded transformers
model, and the two files are all that package would add. Without them: mean pooling, not normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
          ("pooling_mode_mean_tokens", "mean"))


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"  # "mean" | "cls" | "max"
    normalize: bool = False


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def pooling_of(directory: Path) -> Pooling:
    """The checkpoint's pooling, from its sentence-transformers files (mean, unnormalised without)."""
    modules = _json(directory / "modules.json")
    if not isinstance(modules, list):
        return Pooling()
    mode, normalize = "mean", False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith("Pooling"):
            config = _json(directory / str(module.get("path", "")) / "config.json") or {}
            mode = next((name for key, name in _MODES if config.get(key)), "mean")
        elif kind.endswith("Normalize"):
            normalize = True
    return Pooling(mode, normalize)


def embed(model: Any, tokenizer: Any, texts: list[str], *, pooling: Pooling, max_length: int,
          device: str = "cpu") -> tuple[list[list[float]], int]:
    """One vector per text and the number of input tokens. Runs the model: never on an event loop."""
    import torch

    encoded = tokenizer(texts, padding=True, truncation=True, max_length=max_length)  # lists: made on ``device``
    inputs = {k: torch.tensor(v, device=device) for k, v in encoded.items()
              if k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state.float()
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    if pooling.mode == "cls":
        vectors = hidden[:, 0]
    elif pooling.mode == "max":
        vectors = hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values
    else:
        vectors = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if pooling.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
    return vectors.cpu().tolist(), int(inputs["attention_mask"].sum())
