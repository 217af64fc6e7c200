"""Writing one shard of a layout: its header, then each tensor's bytes, then making it durable.

Bytes move from file to file in the kernel (``copy_file_range``) unless the layout changes their
dtype (``convert``) or quantizes them (``quantize``). ``write_shard`` leaves ``<file>.partial``;
``finalize_shard`` hashes it, fsyncs it and gives it its final name.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..model.checkpoint import Tensor, load_pickle
from ..model.safetensors_io import encode_header
from .convert import Converter, torch_dtype
from .layout import Layout, ShardSpec, output_dtype, output_entries
from .quantize import Quantize, file_rows, tensor_rows, write_quantized
from .verify import file_hash

_COPY_CHUNK = 64 * 2**20  # progress granularity for kernel copies


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, count: int,
                advance: Callable[[int], None]) -> None:
    while count > 0:
        step = min(count, _COPY_CHUNK)
        try:
            copied = os.copy_file_range(src, dst, step, src_off, dst_off)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            data = os.pread(src, step, src_off)
            copied = os.pwrite(dst, data, dst_off)
        if copied <= 0:
            raise CheckpointError(f"unexpected end of data while copying ({count} bytes left)")
        src_off, dst_off, count = src_off + copied, dst_off + copied, count - copied
        advance(copied)


class Sources:
    """Open source files once; pickles are loaded (memory-mapped) on first use."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}
        self.pickles: dict[Path, dict] = {}
        self._converter: Converter | None = None

    @property
    def converter(self) -> Converter:
        if self._converter is None:
            self._converter = Converter()
        return self._converter

    def fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def pickle_tensor(self, t: Tensor) -> Any:
        if t.file not in self.pickles:
            self.pickles[t.file] = load_pickle(t.file)
        return self.pickles[t.file][t.name]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.pickles.clear()


def _write_tensor(t: Tensor, out_dtype: str, sources: Sources, dst: int, offset: int,
                  advance: Callable[[int], None], quantize: Quantize | None = None) -> int:
    if quantize is not None and quantize.covers(t):
        rows = (file_rows(sources.fd(t.file), t, sources.converter.raw) if t.begin >= 0
                else tensor_rows(sources.pickle_tensor(t)))
        return write_quantized(t, quantize, rows, dst, offset, advance)
    if t.begin >= 0 and out_dtype == t.dtype:  # same bytes: copy them in the kernel, no decoding
        _copy_range(sources.fd(t.file), t.begin, dst, offset, t.nbytes, advance)
        return t.nbytes
    target = torch_dtype(out_dtype)
    if t.begin >= 0:  # decode a chunk at a time straight from the file, never the whole tensor
        return sources.converter.write_from_file(sources.fd(t.file), t, target, dst, offset, advance)
    return sources.converter.write(sources.pickle_tensor(t).reshape(-1), target, dst, offset, advance)


def write_shard(spec: ShardSpec, by_name: dict[str, Tensor], layout: Layout, staging: Path,
                sources: Sources, advance: Callable[[int], None]) -> Path:
    """Write one shard as ``<file>.partial`` (not yet durable: ``finalize_shard`` makes it so)."""
    partial = staging / (spec.file + ".partial")
    tensors = [by_name[n] for n in spec.tensors]
    dtype = layout.dtype
    header = encode_header([e for t in tensors for e in output_entries(t, dtype, layout.quantize)])
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        offset = len(header)
        for t in tensors:
            offset += _write_tensor(t, output_dtype(t, dtype), sources, fd, offset, advance, layout.quantize)
    finally:
        os.close(fd)
    return partial


def finalize_shard(partial: Path) -> str:
    """Hash the shard, make it durable, give it its final name. Runs beside the next shard's copy."""
    digest = file_hash(partial)
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, partial.with_suffix(""))
    return digest
