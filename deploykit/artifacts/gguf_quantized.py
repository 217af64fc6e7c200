"""A GGUF file imported straight to quantized safetensors shards, one tensor at a time.

Why not ``artifacts.gguf``'s conversion: it has transformers dequantize the whole model into memory and
``save_pretrained`` write it at full precision; for ``quantization: int8 | int4`` that full-precision copy
(on disk and in memory) is what quantizing exists to avoid. Here each GGUF tensor is dequantized alone
(``gguf.dequantize``), put in transformers' layout with transformers' own GGUF helpers (the tensor
processor that undoes llama.cpp's q/k permutation, and ``get_gguf_hf_weights_map`` for the names), and
written at once: quantized (``artifacts.quantize``) if it is a linear weight of the layers, else at the
deployment dtype. The peak is the largest single tensor at float32 (SmolLM2: the 113 MB embeddings).

The result is an import directory like any other (config, generation config, tokenizer, index, shards
of at most ``max_shard_size``); the reshard then finds nothing left to quantize and copies its bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..model.checkpoint import INDEX, Tensor
from ..model.hf import quiet_transformers
from ..model.safetensors_io import encode_header
from ..model.structure import build_meta_model, quantized_linears
from ..names import DTYPE_SIZES, FROM_TORCH
from .quantize import Quantize, pwrite_all, tensor_rows, write_quantized


def convert_quantized(gguf_file: Path, out: Path, *, dtype: str, max_shard_size: int, scheme: str,
                      config: Any, say: Callable[[str], None]) -> None:
    """Write ``gguf_file``'s weights into the empty directory ``out`` with the linear weights of its layers
    quantized with ``scheme`` and everything else at ``dtype``; ``config`` is its transformers config."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                         get_gguf_hf_weights_map, load_gguf_checkpoint)

    meta = build_meta_model(config, task="causal-lm")
    quantize = Quantize(scheme, dtype, frozenset(f"{m}.weight" for m in quantized_linears(meta, scheme)))
    with quiet_transformers():
        parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=False)  # metadata only
    reader = GGUFReader(str(gguf_file))
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(meta, processor)
    shapes = {n: tuple(t.shape) for n, t in meta.state_dict().items()}
    sources = [(t, names[t.name]) for t in reader.tensors if t.name in names]
    if not sources:
        raise CheckpointError(f"{gguf_file}: none of its tensors maps to a {config.model_type} model")
    say(f"importing {gguf_file.name} ({architecture}, {len(sources)} tensors) quantized to {scheme}, one "
        "tensor at a time")
    entries = [Tensor(hf, "F32", shapes[hf], _count(shapes[hf]) * 4, gguf_file) for _, hf in sources]
    shards = _group(entries, quantize, dtype, max_shard_size)
    weight_map: dict[str, str] = {}
    by_name = dict(zip((e.name for e in entries), sources))
    for number, members in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _write_file(out / file, members, by_name, processor, quantize, dtype)
        weight_map.update({name: file for t in members for name, *_ in _outputs(t, quantize, dtype)})
    total = sum(nbytes for t in entries for *_, nbytes in _outputs(t, quantize, dtype))
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    _save_configs(config, out)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _outputs(t: Tensor, quantize: Quantize, dtype: str) -> list[tuple[str, str, tuple[int, ...], int]]:
    if quantize.covers(t):
        return quantize.entries(t)
    out = FROM_TORCH[dtype]
    return [(t.name, out, t.shape, _count(t.shape) * DTYPE_SIZES[out])]


def _group(entries: list[Tensor], quantize: Quantize, dtype: str, max_shard_size: int) -> list[list[Tensor]]:
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in entries:
        nbytes = sum(e[3] for e in _outputs(t, quantize, dtype))
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += nbytes
    return groups


def _write_file(path: Path, members: list[Tensor], by_name: dict[str, Any], processor: Any, quantize: Quantize,
                dtype: str) -> None:
    import torch

    header = encode_header([e for t in members for e in _outputs(t, quantize, dtype)])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        offset = len(header)
        for t in members:
            weights = _dequantized(by_name[t.name][0], processor).reshape(t.shape)
            if quantize.covers(t):
                offset += write_quantized(t, quantize, tensor_rows(weights), fd, offset, lambda n: None)
                continue
            data = weights.to(getattr(torch, dtype)).contiguous().view(torch.uint8).numpy().tobytes()
            pwrite_all(fd, memoryview(data), offset)
            offset += len(data)
    finally:
        os.close(fd)


def _dequantized(source: Any, processor: Any) -> Any:
    """One GGUF tensor at float32 in transformers' layout."""
    import numpy as np
    import torch
    from gguf import dequantize

    weights = processor.process(weights=dequantize(source.data, source.tensor_type), name=source.name,
                                tensor_key_mapping={}, parsed_parameters={}).weights
    return torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))  # a writable copy


def _save_configs(config: Any, out: Path) -> None:
    from transformers import GenerationConfig

    with quiet_transformers():
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
