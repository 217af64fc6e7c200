"""A GGUF file (llama.cpp, Ollama) as a model source: recognising one, fingerprinting it, and reading its
transformers config, all without reading or dequantizing a single weight.

Why it exists: planning (``deploykit plan``/``validate``/``diff``) and the no-op ``apply`` must stay cheap
for a GGUF manifest, so they need the model's config and an identity for the file, not its tensors.

- ``is_gguf`` reads 4 bytes (the magic ``GGUF``).
- ``gguf_metadata`` walks the header, the key/value metadata and the tensor infos in pure Python
  (no numpy, no torch, no ``gguf`` package): ~tens of ms even for a 49k-token vocabulary, where
  ``gguf.GGUFReader`` builds numpy views of every array element (~2 s on SmolLM2).
- ``gguf_fingerprint`` is a SHA-256 over the size, the modification time (ns) and those metadata bytes:
  like ``checkpoint.fingerprint``, it changes when the file is rewritten, without reading the weights.
- ``load_gguf_config`` is the one place that asks transformers (``AutoConfig`` with ``gguf_file``, which
  parses the metadata itself, ~5 s on SmolLM2): callers cache its result (the structure cache).

This module must never import torch or transformers at module level, and never dequantize: the
conversion to a checkpoint directory is ``artifacts.gguf``'s job.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .hf import quiet_transformers

MAGIC = b"GGUF"
SUFFIX = ".gguf"
# GGUF value types -> size in bytes of fixed-size scalars (8: string and 9: array are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                   11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class GgufMetadata:
    version: int
    tensor_count: int
    metadata_end: int  # offset of the first byte after the tensor infos (the header, fingerprinted)
    scalars: dict[str, Any]  # scalar and string values; arrays are skipped (only their keys are kept)
    keys: tuple[str, ...]
    tensor_names: tuple[str, ...]
    tensor_offsets: tuple[int, ...] = ()  # of each tensor's data, from the start of the data section
    tensor_shapes: tuple[tuple[int, ...], ...] = ()  # ggml's order: ne0 (the row length) first
    array_spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (start, end) of its bytes

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The dims of tensor ``name`` (ggml's order), None if the file has no such tensor."""
        try:
            return self.tensor_shapes[self.tensor_names.index(name)]
        except (ValueError, IndexError):
            return None

    @property
    def architecture(self) -> str:
        return str(self.scalars.get("general.architecture", ""))


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


class _Cursor:
    """Little-endian reads over a memory map, with every overrun reported as a CheckpointError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: GGUF metadata is truncated or corrupt (at byte {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("<Q")  # read before adding: ``pos += unpack()`` would add to the old pos
        self.pos += n
        if self.pos > len(self.buf):
            raise CheckpointError(f"{self.path}: GGUF metadata is truncated or corrupt (at byte {self.pos})")

    def value(self, kind: int) -> Any:
        """The value of type ``kind``; arrays are skipped and returned as None."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[item])
            else:
                for _ in range(count):
                    self.skip_string() if item == _STRING else self.value(item)
            return None
        if kind not in _SCALAR_FORMATS:
            raise CheckpointError(f"{self.path}: GGUF metadata has an unknown value type {kind}")
        return self.unpack(_SCALAR_FORMATS[kind])


def gguf_metadata(path: Path) -> GgufMetadata:
    """The header, metadata and tensor infos of a GGUF file (v2 and v3). Raises CheckpointError."""
    path = Path(path)
    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf, path))
    except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise CheckpointError(f"{path}: cannot read as GGUF: {exc}") from None


def _parse(cur: _Cursor) -> GgufMetadata:
    if cur.take(4) != MAGIC:
        raise CheckpointError(f"{cur.path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise CheckpointError(f"{cur.path}: GGUF version {version} is not supported (2 and 3 are)")
    tensor_count, kv_count = cur.unpack("<Q"), cur.unpack("<Q")
    scalars: dict[str, Any] = {}
    keys = []
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(kv_count):
        key = cur.string()
        kind = cur.unpack("<I")
        start = cur.pos
        value = cur.value(kind)
        keys.append(key)
        if value is not None:
            scalars[key] = value
        elif kind == _ARRAY:
            spans[key] = (start, cur.pos)
    names, offsets, shapes = [], [], []
    for _ in range(tensor_count):
        names.append(cur.string())
        dims = cur.unpack("<I")
        if dims > _MAX_DIMS:
            raise CheckpointError(f"{cur.path}: tensor {names[-1]!r} has {dims} dimensions; ggml has at most "
                                  f"{_MAX_DIMS} (a damaged file?)")
        shapes.append(struct.unpack(f"<{dims}Q", cur.take(8 * dims)))
        cur.take(4)  # ggml type
        offsets.append(cur.unpack("<Q"))
    return GgufMetadata(version, tensor_count, cur.pos, scalars, tuple(keys), tuple(names), tuple(offsets),
                        tuple(shapes), spans)


def gguf_fingerprint(path: Path) -> str:
    """Identity of a GGUF file's content: size, mtime (ns) and the metadata bytes (no weights read)."""
    path = Path(path)
    meta = gguf_metadata(path)
    st = path.stat()
    h = hashlib.sha256(f"gguf\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(meta.metadata_end))
    return "sha256:" + h.hexdigest()


VOCABULARY_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens")


def vocabulary_digest(path: Path) -> str | None:
    """An identity of a GGUF file's vocabulary: its tokenizer model and the bytes of its token list (each
    token's text, in id order), hashed without decoding them; None when the file carries no token list. Two
    files with the same digest map every text to the same ids (what a draft model of speculative decoding
    needs: the serving model checks the draft's token ids as its own)."""
    path = Path(path)
    meta = gguf_metadata(path)
    span = meta.array_spans.get("tokenizer.ggml.tokens")
    if span is None:
        return None
    h = hashlib.sha256()
    for key in VOCABULARY_KEYS[:2]:
        h.update(f"{key}={meta.scalars.get(key)!s}\0".encode())
    with open(path, "rb") as fh:
        fh.seek(span[0])
        h.update(fh.read(span[1] - span[0]))
    return "sha256:" + h.hexdigest()


def vocabulary_size(meta: GgufMetadata, path: Path) -> int | None:
    """The number of tokens in a GGUF file's token list (its array header), None without one."""
    span = meta.array_spans.get("tokenizer.ggml.tokens")
    if span is None:
        return None
    with open(path, "rb") as fh:
        fh.seek(span[0] + 4)  # the item type, then the count
        return int(struct.unpack("<Q", fh.read(8))[0])


def has_tokenizer(meta: GgufMetadata) -> bool:
    """Whether the GGUF carries a tokenizer transformers can rebuild (``tokenizer.ggml.model``)."""
    return "tokenizer.ggml.model" in meta.scalars


def load_gguf_config(path: Path) -> Any:
    """The transformers config a GGUF file describes (metadata only; no tensor is dequantized)."""
    path = Path(path)
    gguf_metadata(path)  # a located error for a broken file, before transformers' own messages
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError, ImportError, NotImplementedError) as exc:
        raise CheckpointError(f"{path}: transformers cannot read this GGUF file's config: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
