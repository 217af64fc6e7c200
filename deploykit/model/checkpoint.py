"""A checkpoint directory on disk: its weight files, tensors and other files, read without loading
weights.

Understands Hugging Face layouts: one ``model.safetensors``, sharded safetensors with
``model.safetensors.index.json``, and (only when explicitly allowed, because unpickling runs code) pickle
files (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``, ``*.pkl``), which must be unpickled to list their
tensors (``torch.load(weights_only=True, mmap=True)``). Every problem is a ``CheckpointError`` that
names the file.

The fingerprint identifies the checkpoint's content cheaply: every weight file's header, size and
modification time, and every other file's bytes. It changes when any file is rewritten (a fine-tune
saved in place keeps headers and sizes but not mtimes), without reading gigabytes of weights. Bytes
changed in place with the size and mtime kept are not seen here: the shard checksums
(``artifacts.verify``) catch those before a load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import CheckpointError
from ..files import MAX_INDEX_BYTES, read_regular_file
from ..names import FROM_TORCH
from .safetensors_io import MAX_HEADER, TensorEntry, read_header

INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
LOCK = "deploykit.lock.json"
LAID_OUT = "deploykit.laid-out.json"  # which state directory laid shards out: only it collects them
GGUF_RECORD = "deploykit.gguf.json"  # what ``artifacts.gguf`` converted a directory from: not model content
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_NOT_COPIED = {INDEX, PICKLE_INDEX, LOCK, GGUF_RECORD, LAID_OUT}


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors dtype name (F16, BF16, F32, I64, ...); for pickles, torch's name
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    begin: int = -1  # absolute byte range in a safetensors file; -1 for pickles
    end: int = -1


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    format: Literal["safetensors", "pickle"]
    tensors: tuple[Tensor, ...]  # in source order: by file, then by position in the file
    weight_files: tuple[Path, ...]
    other_files: tuple[Path, ...]  # relative to path: config, tokenizer, ... copied alongside
    fingerprint: str

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _is_weight(path: Path) -> bool:
    return path.suffix == ".safetensors" or path.suffix in PICKLE_SUFFIXES or path.name in _NOT_COPIED


def _other_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        if p.is_file() and not _is_weight(p):
            out.append(rel)
    return out


def _read_index(path: Path) -> dict[str, str]:
    try:
        data = json.loads(read_regular_file(path, MAX_INDEX_BYTES).decode("utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the index: {exc}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a valid index (expected JSON with a 'weight_map')") from None
    return {str(k): str(v) for k, v in weight_map.items()}


def _safetensors_files(root: Path) -> list[Path]:
    index = root / INDEX
    if not index.exists():
        return sorted(root.glob("*.safetensors"))
    weight_map = _read_index(index)
    files = list(dict.fromkeys(weight_map.values()))
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise CheckpointError(f"{index}: names shard file(s) that do not exist: {', '.join(missing)}")
    return [root / f for f in files]


def _check_index_matches(root: Path, tensors: list[Tensor]) -> None:
    index = root / INDEX
    if not index.exists():
        return
    weight_map = _read_index(index)
    actual = {t.name: t.file.name for t in tensors}
    missing = sorted(n for n, f in weight_map.items() if actual.get(n) != f)
    extra = sorted(n for n in actual if n not in weight_map)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) in the index are not in their shard "
                         f"(first: {missing[0]!r})")
        if extra:
            parts.append(f"{len(extra)} tensor(s) in the shards are not in the index (first: {extra[0]!r})")
        raise CheckpointError(f"{index}: does not match the shard files: " + "; ".join(parts))


def _pickle_files(root: Path) -> list[Path]:
    index = root / PICKLE_INDEX
    if index.exists():
        return [root / f for f in dict.fromkeys(_read_index(index).values())]
    return sorted(p for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())


def load_pickle(path: Path) -> dict:
    """A pickle checkpoint's state dict, memory-mapped, with only tensors allowed (no code runs)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path}: cannot load as a weights-only, memory-mappable torch file "
                              f"({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # weights_only refuses arbitrary objects with an UnpicklingError
        raise CheckpointError(f"{path}: refused: {str(exc).splitlines()[0]}") from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: does not hold a state dict")
    return state




def _pickle_tensors(files: list[Path]) -> list[Tensor]:
    out = []
    for file in files:
        for name, t in load_pickle(file).items():
            dtype = FROM_TORCH.get(str(t.dtype).removeprefix("torch."))
            if dtype is None:
                raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {t.dtype}")
            out.append(Tensor(name, dtype, tuple(t.shape), t.numel() * t.element_size(), file))
    return out


def fingerprint(root: Path, weight_files: list[Path], other_files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in weight_files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                raw = fh.read(8)
                h.update(raw + fh.read(min(int.from_bytes(raw, "little"), MAX_HEADER)))
    for rel in other_files:
        h.update(f"{rel}\0".encode())
        h.update((root / rel).read_bytes())
    return "sha256:" + h.hexdigest()


def open_checkpoint(path: str | Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Read a checkpoint directory's structure (headers only). Raises CheckpointError."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    files = _safetensors_files(root)
    tensors: list[Tensor] = []
    fmt: Literal["safetensors", "pickle"] = "safetensors"
    if files:
        seen: dict[str, Path] = {}
        for file in files:
            for e in read_header(file).tensors:
                if e.name in seen:
                    raise CheckpointError(f"{file}: tensor {e.name!r} also appears in {seen[e.name].name}")
                seen[e.name] = file
                tensors.append(_from_entry(e, file))
        _check_index_matches(root, tensors)
    else:
        files = _pickle_files(root)
        if not files:
            raise CheckpointError(f"{root}: no weights found (expected model.safetensors, sharded "
                                  f"safetensors with {INDEX}, or pickle files)")
        if not allow_pickle:
            names = ", ".join(f.name for f in files[:3])
            raise CheckpointError(f"{root}: holds pickle weights ({names}); unpickling can run arbitrary "
                                  "code, so deploykit refuses them unless --allow-pickle is given "
                                  "(they are then read with torch.load(weights_only=True))")
        fmt = "pickle"
        tensors = _pickle_tensors(files)
    others = _other_files(root)
    return Checkpoint(root, fmt, tuple(tensors), tuple(files), tuple(others),
                      fingerprint(root, files, others))


def _from_entry(e: TensorEntry, file: Path) -> Tensor:
    return Tensor(e.name, e.dtype, e.shape, e.nbytes, file, e.begin, e.end)
