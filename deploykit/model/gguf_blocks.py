"""The blocks of a GGUF model as llama.cpp holds them, sized exactly from the file's tensor table.

For the llama.cpp engine the bytes a deployment holds are the GGUF's own tensors (llama.cpp memory-maps
them in their file types: nothing is dequantized) plus its KV cache. Each tensor's size is read from the
tensor table (the distance to the next tensor's data, alignment included: what the file's mapping holds),
never estimated from a dtype. Tensors are grouped as llama.cpp places them: ``token_embd`` (the input
embeddings), one block per ``blk.N`` layer, and the output (``output_norm``, ``output``, anything else).
Each layer block also holds its KV cache for ``kv_tokens`` tokens (llama.cpp's slots x context, K and V
at 16 bits, the server's default), so a plan's bytes are what the llama-server process maps and allocates
for the model, on whichever tier the layer lands.

The block whose weight computes the logits (``output``; ``token_embd`` in a tied-embedding GGUF, whose head
is that tensor) also holds the logits of one micro-batch: llama.cpp reserves its compute buffers for the
worst case, a micro-batch of ``batch_tokens`` tokens that all want logits, ``batch_tokens x n_vocab``
float32 values on the device that runs the head (96 MiB for SmolLM2's 49152 tokens at 512, 250 MiB for a
128k vocabulary). The rest of a device's compute buffer, the layers' intermediate tensors for that
micro-batch (about ``batch_tokens x 2 x feed_forward_length`` floats, reused layer after layer: 6 MiB for
SmolLM2, 112 MiB for a 70B), is not planned: ``placement.reserve`` covers it on a GPU.
``tests/test_llamacpp_compute.py`` checks the sum against llama.cpp's own estimate
(``llama-fit-params --fit-print on``). Reads the metadata only; no torch, no transformers.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..units import format_size
from .gguf import GgufMetadata, gguf_metadata
from .structure import Block, Structure

KV_BYTES = 2  # llama-server's default cache type: f16
LOGIT_BYTES = 4  # float32
# llama.cpp's llama_ftype names of the common file types (general.file_type), for plans people read
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               32: "BF16"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


def tensor_bytes(meta: GgufMetadata, file_size: int) -> dict[str, int]:
    """Bytes of every tensor's data in the file, from the tensor table's offsets."""
    alignment = int(meta.scalars.get("general.alignment", 32))
    data_start = -(-meta.metadata_end // alignment) * alignment
    ordered = sorted(zip(meta.tensor_offsets, meta.tensor_names))
    ends = [offset for offset, _ in ordered[1:]] + [file_size - data_start]
    sizes = {name: end - offset for (offset, name), end in zip(ordered, ends)}
    if any(size < 0 for size in sizes.values()):
        raise CheckpointError("the GGUF tensor table points past the end of the file (truncated?)")
    return sizes


def _arch_value(meta: GgufMetadata, key: str) -> Any:
    return meta.scalars.get(f"{meta.architecture}.{key}")


def kv_bytes_per_token(meta: GgufMetadata) -> int:
    """K and V of one layer for one token: (key length + value length) x key-value heads x 2 bytes."""
    heads = _arch_value(meta, "attention.head_count")
    width = _arch_value(meta, "embedding_length")
    if not isinstance(heads, int) or not isinstance(width, int) or heads <= 0:
        raise CheckpointError("the GGUF metadata names no attention heads or embedding length: its KV cache "
                              "cannot be sized")
    kv_heads = _arch_value(meta, "attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, int) else heads  # a per-layer array: sized as the widest
    key = _arch_value(meta, "attention.key_length") or width // heads
    value = _arch_value(meta, "attention.value_length") or width // heads
    return (int(key) + int(value)) * kv_heads * KV_BYTES


def vocabulary(meta: GgufMetadata) -> int | None:
    """The number of token rows of the input embeddings (ggml's ``ne1``): the logits' width."""
    shape = meta.shape("token_embd.weight")
    return int(shape[1]) if shape is not None and len(shape) == 2 else None


def gguf_blocks(path: Path, *, kv_tokens: int, batch_tokens: int = 0) -> Structure:
    """The structure llama.cpp serves from the GGUF at ``path``, with ``kv_tokens`` of KV cache per layer
    and the logits of a ``batch_tokens`` micro-batch with the head's weight (see above)."""
    meta = gguf_metadata(path)
    sizes = tensor_bytes(meta, Path(path).stat().st_size)
    groups: dict[str, list[str]] = defaultdict(list)
    for name in meta.tensor_names:
        layer = _LAYER.match(name)
        group = f"blk.{layer.group(1)}" if layer else "token_embd" if name.startswith("token_embd.") else "output"
        groups[group].append(name)
    kv = kv_bytes_per_token(meta) * kv_tokens
    layers = sorted((g for g in groups if g.startswith("blk.")), key=lambda g: int(g.split(".")[1]))
    logits = batch_tokens * (vocabulary(meta) or 0) * LOGIT_BYTES
    tied = "output.weight" not in meta.tensor_names
    blocks = []
    if "token_embd" in groups:
        blocks.append(_block("token_embd", "embedding", groups, sizes, extra=logits if tied else 0))
    blocks += [_block(g, "layer", groups, sizes, extra=kv) for g in layers]
    if "output" in groups:
        blocks.append(_block("output", "head", groups, sizes, extra=0 if tied else logits))
    code = meta.scalars.get("general.file_type")
    file_type = _FILE_TYPES.get(code, code) if isinstance(code, int) else code
    return Structure(architecture=f"gguf:{meta.architecture}", model_type=meta.architecture,
                     dtype=f"gguf:{file_type}" if file_type is not None else "gguf", blocks=tuple(blocks),
                     embedding_block=0,
                     notes=(f"llama.cpp: bytes from the GGUF tensor table; each layer includes its KV cache "
                            f"for {kv_tokens} tokens (engine.slots x engine.context); the block that computes "
                            f"the logits ({'token_embd: the head is tied to it' if tied else 'output'}) holds "
                            f"those of a {batch_tokens}-token micro-batch (engine.batch_size), "
                            f"{format_size(logits)}",))


def _block(name: str, kind: Any, groups: dict[str, list[str]], sizes: dict[str, int], *, extra: int = 0) -> Block:
    weights = sum(sizes[t] for t in groups[name])
    return Block(name=name, modules=(name,), kind=kind, weight_bytes=weights + extra, flops_per_token=2 * weights)
