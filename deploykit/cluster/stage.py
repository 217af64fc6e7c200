"""One pipeline stage: a contiguous run of a decoder-only model's layers, built from transformers' own
modules, holding a KV cache per request. Runs inside a Ray actor (see ``pipeline``); plain Python here,
so it can be tested and benchmarked in process too.

What it takes for a stage's greedy outputs to equal the whole model's (measured on transformers 5.23):

- the model is built on the meta device from a *cut* config (``num_hidden_layers`` = the stage's
  layers, ``layer_types`` sliced), so its layers are numbered from 0 and ``DynamicCache(config=cut)``
  matches them; weights ``model.layers.{start + i}.*`` load as ``model.layers.{i}.*`` with
  ``load_state_dict(assign=True)``;
- the rotary ``inv_freq`` buffer is not in the weights: the rotary module is rebuilt off the meta device;
- stages other than the first take hidden states (``inputs_embeds``), stages other than the last have an
  identity final norm and return hidden states; the last returns the logits of the last position only;
- every stage gets the 2-D attention mask (growing by one per step) and position ids
  ``cumsum(mask) - 1`` (padding at 0), exactly as ``generate`` computes them.

Only the tensors of the stage's own modules are read from the checkpoint's safetensors files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # embeddings not rescaled inside forward
_LAYER_RE = re.compile(r"(.*\.layers\.)([0-9]+)(\..*)", re.DOTALL)  # fullmatch


@dataclass(frozen=True)
class StageSpec:
    """What one stage holds: layers [start, end) of the model at ``checkpoint``."""

    index: int
    count: int
    start: int
    end: int
    checkpoint: str
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def tensor_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index (or the files' headers)."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint / file for name, file in weight_map.items()}
    from safetensors import safe_open

    found: dict[str, Path] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:  # reads the header only
            found.update((name, file) for name in fh.keys())
    return found


class Stage:
    """A built stage with its per-request caches. Not thread-safe: its actor runs one call at a time."""

    def __init__(self, spec: StageSpec) -> None:
        import torch

        torch.set_num_threads(max(1, spec.threads))  # Ray sets OMP threads from num_cpus (0 when fractional)
        self.spec = spec
        self.caches: dict[str, Any] = {}
        self.tensors_read: list[str] = []
        self.files_read: set[str] = set()
        self.model, self.config = self._build()

    def _build(self) -> tuple[Any, Any]:
        import torch
        from torch import nn
        from transformers import AutoConfig, AutoModelForCausalLM

        spec = self.spec
        config = AutoConfig.from_pretrained(spec.checkpoint)
        if config.model_type not in SUPPORTED:
            raise ValueError(f"pipeline stages support {', '.join(SUPPORTED)} models, not {config.model_type!r}")
        total = config.num_hidden_layers
        if not 0 <= spec.start <= spec.end <= total:
            raise ValueError(f"stage {spec.index}: layers [{spec.start}, {spec.end}) outside 0..{total}")
        cut = config.__class__.from_dict(config.to_dict())
        cut.num_hidden_layers = spec.end - spec.start
        if getattr(cut, "layer_types", None):
            cut.layer_types = list(config.layer_types[spec.start:spec.end])
        dtype = getattr(torch, spec.dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cut, dtype=dtype)
        if not spec.first:
            model.model.embed_tokens = nn.Identity()
        if not spec.last:
            model.model.norm = nn.Identity()
            model.lm_head = nn.Identity()
        files = tensor_files(Path(spec.checkpoint))
        tied = "lm_head.weight" not in files
        state: dict[str, Any] = {}
        opened: dict[Path, Any] = {}
        from safetensors import safe_open

        try:
            for key in model.state_dict():
                source = key
                match = _LAYER_RE.fullmatch(key)
                if match:
                    source = f"{match.group(1)}{int(match.group(2)) + spec.start}{match.group(3)}"
                if source == "lm_head.weight" and tied:
                    source = "model.embed_tokens.weight"
                if source not in files:
                    raise KeyError(f"{source} is not in the checkpoint {spec.checkpoint}")
                file = files[source]
                if file not in opened:
                    opened[file] = safe_open(str(file), framework="pt")
                state[key] = opened[file].get_tensor(source).to(dtype)
                self.tensors_read.append(source)
        finally:
            opened.clear()
        self.files_read = {str(f) for f in {files[s] for s in self.tensors_read}}
        model.load_state_dict(state, strict=True, assign=True)
        rotary = model.model.rotary_emb
        model.model.rotary_emb = type(rotary)(config=cut)  # inv_freq is a buffer, not a weight
        model.eval()
        if spec.device != "cpu":
            model.to(spec.device)
        return model, cut

    def forward(self, request: str, x: Any, mask: Any, positions: Any) -> Any:
        """One step for request group ``request``: ``x`` token ids (first stage) or hidden states; returns
        hidden states, or on the last stage float32 logits of the last position ``[batch, vocab]``."""
        import torch
        from transformers import DynamicCache

        from ..engine.kvcache import with_cache

        try:
            with torch.inference_mode():
                cache = self.caches.get(request)
                if cache is None:
                    cache = self.caches[request] = DynamicCache(config=self.config)
                device = self.spec.device
                x, mask, positions = x.to(device), mask.to(device), positions.to(device)
                inputs = {"input_ids": x} if self.spec.first else {"inputs_embeds": x}
                out = self.model.model(attention_mask=mask, position_ids=positions, use_cache=True, **inputs,
                                       **with_cache(self.model.model, cache))
                hidden = out.last_hidden_state
                if not self.spec.last:
                    return hidden.cpu()
                return self.model.lm_head(hidden[:, -1:, :])[:, -1].float().cpu()
        except Exception:
            self.caches.pop(request, None)  # a failed request frees its cache here too
            raise

    def release(self, request: str) -> bool:
        """Free the KV cache of ``request`` (a finished, cancelled or failed request group)."""
        return self.caches.pop(request, None) is not None

    def info(self) -> dict[str, Any]:
        import os
        import socket

        return {"index": self.spec.index, "layers": [self.spec.start, self.spec.end], "pid": os.getpid(),
                "host": socket.gethostname(), "tensors_read": list(self.tensors_read),
                "files_read": sorted(self.files_read), "open_requests": sorted(self.caches),
                "threads": __import__("torch").get_num_threads()}

    def node_id(self) -> str:
        from .ray_env import require_ray

        return str(require_ray().get_runtime_context().get_node_id())
