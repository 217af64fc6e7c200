"""The safetensors file layout, read and written at the byte level.

safetensors (the library) reads tensors and writes whole state dicts held in memory; it has no way to
copy a tensor's bytes from one file to another without decoding them, nor a streaming writer. Resharding
a checkpoint with bounded memory needs both, so this module owns the format and nothing else:

    8 bytes   little-endian u64: N, the length of the JSON header
    N bytes   JSON: {"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}}
    ...       the tensor data; offsets are relative to the end of the header

Every header is validated as strictly as safetensors itself does (offsets contiguous, sizes matching
dtype x shape, file long enough), so a corrupt or truncated file is refused with a clear error instead of
being copied. Tests read every file written here with safetensors' own reader.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..names import DTYPE_SIZES

MAX_HEADER = 100 * 2**20  # safetensors' own limit
_ALIGN = 8


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: tuple[TensorEntry, ...]  # in data order
    metadata: dict[str, str]
    data_start: int
    file_size: int


def read_header(path: Path) -> Header:
    """Parse and validate the header of a safetensors file. Reads only the header."""
    try:
        with open(path, "rb") as fh:
            file_size = fh.seek(0, 2)
            fh.seek(0)
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({file_size} bytes, no header)")
            (length,) = struct.unpack("<Q", raw_len)
            if length > MAX_HEADER or 8 + length > file_size:
                raise CheckpointError(f"{path}: corrupt safetensors header (header length {length} "
                                      f"for a file of {file_size} bytes)")
            raw = fh.read(length)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = data.pop("__metadata__", None) or {}
    data_start = 8 + length
    entries = [_entry(path, name, info, data_start) for name, info in data.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    position = data_start
    for e in entries:
        if e.begin != position:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {e.name!r} starts at "
                                  f"{e.begin - data_start}, expected {position - data_start})")
        position = e.end
    if position > file_size:
        missing = position - file_size
        raise CheckpointError(f"{path}: truncated: the header describes {position} bytes, the file has "
                              f"{file_size} ({missing} bytes of tensor data missing)")
    return Header(path, tuple(entries), dict(metadata), data_start, file_size)


def _entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{path}: corrupt safetensors header (bad entry for {name!r})")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{path}: corrupt safetensors header (bad shape/offsets for {name!r})")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} "
                              f"{dtype}; expected {math.prod(shape) * DTYPE_SIZES[dtype]}")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def encode_header(tensors: list[tuple[str, str, tuple[int, ...], int]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length and JSON header for tensors (name, dtype, shape, nbytes) stored in order.

    The header is padded with spaces to a multiple of 8 bytes, as safetensors does, so tensor data
    stays aligned.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw
