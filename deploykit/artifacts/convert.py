"""Dtype conversion of tensor data on its way into a shard: a chunk at a time, memory flat.

The only part of resharding that decodes tensor bytes (and so the only one that imports torch, lazily):
used when a layout asks for another floating dtype. ``Converter.raw`` is also the read buffer the
quantizing path reuses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..model.checkpoint import Tensor
from ..names import DTYPE_SIZES, TORCH_NAMES

CONVERT_CHUNK = 16 * 2**20  # bytes decoded at a time for a dtype change


def torch_dtype(name: str) -> Any:
    """The torch dtype of safetensors dtype ``name``."""
    import torch

    return getattr(torch, TORCH_NAMES[name])


class Converter:
    """Converts tensor data between dtypes a chunk at a time through two buffers allocated once, so
    memory stays flat (fresh buffers per chunk grow the heap by hundreds of MiB)."""

    def __init__(self) -> None:
        self.raw = bytearray(CONVERT_CHUNK)
        self.out: dict[Any, Any] = {}

    def _out(self, dtype: Any, n: int) -> Any:
        import torch

        if dtype not in self.out:
            self.out[dtype] = torch.empty(CONVERT_CHUNK // 2, dtype=dtype)  # 2 bytes: smallest float
        return self.out[dtype][:n] if n <= self.out[dtype].numel() else torch.empty(n, dtype=dtype)

    def write(self, flat: Any, target: Any, dst: int, dst_off: int, advance: Callable[[int], None]) -> int:
        """Write the 1-D tensor ``flat`` converted to ``target``. Returns the bytes written."""
        import torch

        step = CONVERT_CHUNK // 4
        written = 0
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            out = self._out(target, piece.numel())
            out.copy_(piece)
            view = memoryview(out.view(torch.uint8).numpy())
            while view:
                n = os.pwrite(dst, view, dst_off + written)
                written += n
                view = view[n:]
            advance(piece.numel() * out.element_size())
        return written

    def write_from_file(self, src: int, t: Tensor, target: Any, dst: int, dst_off: int,
                        advance: Callable[[int], None]) -> int:
        """Write tensor ``t`` of source file ``src`` converted to ``target``, never decoding it whole."""
        import torch

        size = DTYPE_SIZES[t.dtype]
        step = CONVERT_CHUNK // size * size
        written = 0
        for start in range(0, t.nbytes, step):
            n = os.preadv(src, [memoryview(self.raw)[: min(step, t.nbytes - start)]], t.begin + start)
            flat = torch.frombuffer(self.raw, dtype=torch_dtype(t.dtype), count=n // size)
            written += self.write(flat, target, dst, dst_off + written, advance)
        return written
