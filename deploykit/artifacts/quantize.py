"""Quantizing linear weights while the reshard streams them: a few rows at a time, never a whole tensor.

The reshard reads each source tensor in bounded pieces and writes shard files; for a weight this module
covers (``Quantize.covers``: the linear layers ``model.structure.quantized_linears`` lists), it turns each
piece of rows into its quantized form (``model.quantization`` documents the on-disk format) and writes it
in place. Per-channel int8 and group-wise int4 both work row by row, so the peak is one piece (at most
``_PIECE`` bytes of float32), whatever the model size: the apply process never holds the full-precision
model (loading it first and quantizing afterwards is what makes vLLM and SGLang run out of memory).

Written here rather than with torchao or bitsandbytes: those quantize a model already loaded in memory,
which is what this must avoid; the arithmetic is a few lines of torch.

This module must never load a model; it imports torch only when a tensor is quantized.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..model.checkpoint import Tensor
from ..model.quantization import GROUP_SIZE, quantized_tensors
from ..names import DTYPE_SIZES, FLOAT_DTYPES, TORCH_NAMES

_PIECE = 16 * 2**20  # float32 bytes of source rows quantized at a time
FORMAT = 1  # of the quantized tensors on disk; part of the layout digest


@dataclass(frozen=True)
class Quantize:
    """What the reshard quantizes: ``scheme`` ("int8" | "int4") for the linear ``weights`` (model names,
    ``<module>.weight``), scales and zeros at ``dtype`` (torch's name)."""

    scheme: str
    dtype: str
    weights: frozenset[str]

    def covers(self, t: Tensor) -> bool:
        """Whether checkpoint tensor ``t`` is one of the weights, by its name or without a leading
        component (a checkpoint saved from a task model: ``bert.encoder...`` for ``encoder...``)."""
        if len(t.shape) != 2 or t.dtype not in _FLOATING:
            return False
        return t.name in self.weights or ("." in t.name and t.name.split(".", 1)[1] in self.weights)

    def entries(self, t: Tensor) -> list[tuple[str, str, tuple[int, ...], int]]:
        """(name, safetensors dtype, shape, nbytes) of what ``t`` is stored as, in file order."""
        return [(name, dtype, shape, _count(shape) * DTYPE_SIZES[dtype])
                for name, dtype, shape in quantized_tensors(t.name, t.shape, self.scheme, self.dtype)]

    def digest_part(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "group_size": GROUP_SIZE, "format": FORMAT,
                "weights": sorted(self.weights)}


_FLOATING = FLOAT_DTYPES | {"float16", "bfloat16", "float32", "float64"}  # safetensors' and pickles' names


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def quantize_rows(rows: Any, scheme: str, dtype: Any) -> list[Any]:
    """The stored tensors (weight, scale[, zero]) of float32 ``rows`` [r, in]. Scales and zeros are
    rounded to ``dtype`` first and the weights quantized against the rounded values, so what is loaded
    dequantizes to the nearest representable weights."""
    import torch

    if scheme == "int8":
        scale = (rows.abs().amax(dim=1) / 127).to(dtype)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(rows / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return [q, scale]
    groups = rows.reshape(rows.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    scale = ((high - low) / 15).to(dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = (low + 8 * scale.float()).to(dtype)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp_(0, 15)
    q = q.to(torch.uint8).reshape(rows.shape[0], -1)
    return [q[:, 0::2] | (q[:, 1::2] << 4), scale, zero]


def write_quantized(t: Tensor, quantize: Quantize, read_rows: Callable[[int, int], Any], dst: int, offset: int,
                    advance: Callable[[int], None]) -> int:
    """Write the quantized form of ``t`` at ``offset`` of file ``dst``, a piece of rows at a time;
    ``read_rows(start, stop)`` gives those rows as float32. Returns the bytes written."""
    import torch

    out, inputs = t.shape
    entries = quantize.entries(t)
    starts = [offset]
    for _, _, _, nbytes in entries[:-1]:
        starts.append(starts[-1] + nbytes)
    row_bytes = [nbytes // out for _, _, _, nbytes in entries]
    dtype = getattr(torch, quantize.dtype)
    step = max(1, _PIECE // (4 * inputs))
    for first in range(0, out, step):
        last = min(out, first + step)
        pieces = quantize_rows(read_rows(first, last), quantize.scheme, dtype)
        for piece, start, size in zip(pieces, starts, row_bytes):
            pwrite_all(dst, memoryview(piece.contiguous().view(torch.uint8).numpy()).cast("B"),
                        start + first * size)
            advance(piece.numel() * piece.element_size())
    return sum(nbytes for _, _, _, nbytes in entries)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def file_rows(fd: int, t: Tensor, buffer: bytearray) -> Callable[[int, int], Any]:
    """``read_rows`` for a tensor stored in a safetensors file: preads the rows into ``buffer`` (grown
    only when a piece does not fit) and decodes them to float32."""
    import torch

    size = DTYPE_SIZES[t.dtype]
    row = t.shape[1] * size
    source_dtype = getattr(torch, TORCH_NAMES[t.dtype])

    def read(first: int, last: int) -> Any:
        n = (last - first) * row
        if len(buffer) < n:
            buffer.extend(bytes(n - len(buffer)))
        got = os.preadv(fd, [memoryview(buffer)[:n]], t.begin + first * row)
        if got != n:
            raise OSError(f"short read of {t.name} in {t.file}")
        return torch.frombuffer(buffer, dtype=source_dtype, count=n // size).reshape(last - first, -1).float()

    return read


def tensor_rows(tensor: Any) -> Callable[[int, int], Any]:
    """``read_rows`` for a tensor already in memory (a memory-mapped pickle)."""
    return lambda first, last: tensor[first:last].float()


def quantize_for(checkpoint_dir: Any, *, scheme: str, dtype: str, task: str,
                 trust_remote_code: bool = False) -> Quantize | None:
    """What to quantize when laying out the checkpoint at ``checkpoint_dir`` under ``scheme`` (None for
    "none"): its linear layers, found on a meta model built from its config.json (no weights read)."""
    if scheme == "none":
        return None
    from ..model.structure import build_meta_model, load_config, quantized_linears

    model = build_meta_model(load_config(checkpoint_dir, trust_remote_code=trust_remote_code),
                             task=task, trust_remote_code=trust_remote_code)
    return Quantize(scheme, dtype, frozenset(f"{m}.weight" for m in quantized_linears(model, scheme)))
