"""A model's config and its structure on the meta device: real module tree and names, no memory, no
weights. What planning (``structure``), tensor parallelism and the loader's shape check share; kept
apart so that none of them imports another for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..files import MAX_CONFIG_BYTES, read_regular_file
from .hf import BUILD_LOCK, auto_class, quiet_transformers

if TYPE_CHECKING:
    import torch


def read_config_json(model_dir: Path) -> bytes:
    """The bytes of a checkpoint directory's config.json, checked to be JSON (no transformers needed)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{model_dir}: no config.json; point spec.model.path at a Hugging Face "
                              "checkpoint directory")
    try:
        data = read_regular_file(config_file, MAX_CONFIG_BYTES)
        json.loads(data.decode("utf-8"))
    except OSError as exc:
        raise CheckpointError(f"{config_file}: cannot read: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON: {exc}") from None
    return data


def load_config(model_dir: Path, *, trust_remote_code: bool = False) -> Any:
    """The transformers config of a checkpoint directory, with errors that say what to fix."""
    config_file = Path(model_dir) / "config.json"
    read_config_json(model_dir)
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{config_file}: transformers cannot read this config: {exc}") from None


_META_CACHE: dict[tuple[str, str, bool], Any] = {}


def build_meta_model(config: Any, *, task: str, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model for ``task`` on the meta device: real structure and names, no memory, no weights.

    Cached by config content (meta models hold no data and are only read), so planning and the
    pre-load shape check of one apply build it once.
    """
    key = (config.to_json_string(), task, trust_remote_code)
    with BUILD_LOCK:  # the cache and the build: one thread at a time (``hf.BUILD_LOCK``)
        if key not in _META_CACHE:
            if len(_META_CACHE) > 8:
                _META_CACHE.clear()
            _META_CACHE[key] = _build_meta_model(config, task=task, trust_remote_code=trust_remote_code)
        return _META_CACHE[key]


def _build_meta_model(config: Any, *, task: str, trust_remote_code: bool = False) -> torch.nn.Module:
    import torch

    auto = auto_class(task)
    try:
        with quiet_transformers(), torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise CheckpointError(f"task {task!r} does not fit a {type(config).__name__} "
                              f"({config.model_type}): {str(exc).splitlines()[0]}") from None
    model.eval()
    return model
