"""A GGUF file converted, once, into a checkpoint directory deploykit can plan, reshard and load.

Why it exists: llama.cpp and Ollama users hold ``.gguf`` files, whose tensors are usually quantized
(Q4_1, Q8_0, K-quants...). deploykit's loaders, resharder and checksums work on safetensors, so an
apply first *imports* the file: transformers dequantizes it (``from_pretrained(gguf_file=...)`` with
``GgufConfig(dequantize=True)``: without it, transformers >= 5.2x keeps a GGUF quantizer attached
whose ``is_serializable()`` is False, and ``save_pretrained`` refuses), and ``save_pretrained`` writes
it at the manifest's dtype as safetensors shards of at most ``max_shard_size`` with config, generation
config and tokenizer (rebuilt from the GGUF metadata when it carries one).

On disk, each import is content-addressed: ``<root>/<key>`` where ``key`` covers the GGUF fingerprint
(``model.gguf``: size, mtime, metadata bytes), the dtype and the shard size. It is built in a temp
sibling (``.<key>.tmp-<pid>``), fsynced, and renamed into place in one step, so a reader sees a whole
import or none. ``deploykit.gguf.json`` in it records the source, its fingerprint and every file's
size and XXH3-128 (``verify.checksums``); a reused import is verified against it (sizes always,
contents when asked) and converted again if anything differs. Running again with unchanged inputs
converts nothing.

This module must never write into an existing import (it is replaced whole), never import torch or
transformers before a conversion is actually needed, and never read the GGUF's tensors except to convert.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..model.checkpoint import GGUF_RECORD
from ..model.gguf import gguf_fingerprint, gguf_metadata, has_tokenizer
from ..model.hf import quiet_transformers
from ..model.structure_cache import transformers_version
from .fsutil import discard_dir, fsync_dir, write_atomic
from .verify import checksums, recorded_problem

log = logging.getLogger(__name__)
RECORD_VERSION = 1
Say = Callable[[str], None]


def source_fingerprint(gguf_file: Path, *, dtype: str, max_shard_size: int, quantization: str = "none") -> str:
    """What an import of ``gguf_file`` at ``dtype``/``max_shard_size`` (and ``quantization``) holds: the
    checkpoint fingerprint a revision records for a GGUF source. Reads only the GGUF's metadata."""
    parts: dict[str, Any] = {"gguf": gguf_fingerprint(gguf_file), "dtype": dtype,
                             "max_shard_size": int(max_shard_size), "version": RECORD_VERSION}
    if quantization != "none":  # imported quantized (gguf_quantized); unquantized imports keep their key
        parts["quantization"] = quantization
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def import_dir(dest_root: Path, fingerprint: str) -> Path:
    """The directory an import with ``source_fingerprint`` ``fingerprint`` lives in (it may not exist)."""
    return Path(dest_root) / fingerprint.removeprefix("sha256:")[:16]


def read_record(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / GGUF_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == RECORD_VERSION else None


def import_problem(directory: Path, fingerprint: str, *, hashes: bool) -> str | None:
    """Why ``directory`` is not an intact import with ``fingerprint`` (None: it is). ``hashes`` reads every
    byte and compares checksums; without it only presence and sizes are checked."""
    if not directory.is_dir():
        return f"{directory}: missing"
    record = read_record(directory)
    if record is None:
        return f"{directory / GGUF_RECORD}: missing or unreadable"
    if record.get("fingerprint") != fingerprint:
        return f"{directory / GGUF_RECORD}: records another source"
    files: dict[str, dict] = record["files"]
    if not hashes:
        files = {f: {**e, "hash": None} for f, e in files.items()}
    return recorded_problem(directory, files)


def import_gguf(gguf_file: Path, dest_root: Path, *, dtype: str, max_shard_size: int,
                progress: Say | None = None, verify: bool = True, quantization: str = "none") -> Path:
    """The checkpoint directory holding ``gguf_file`` at ``dtype`` in shards of ``max_shard_size``:
    an existing import if it is intact (contents checked unless ``verify`` is False), else a new
    conversion. ``progress`` receives one line per stage (they are logged at INFO too). With
    ``quantization``, the linear weights of the layers are imported quantized, one tensor at a time
    (``gguf_quantized``): no full-precision copy is made."""
    gguf_file = Path(gguf_file).resolve()
    say = _sayer(progress)
    fingerprint = source_fingerprint(gguf_file, dtype=dtype, max_shard_size=max_shard_size,
                                     quantization=quantization)
    dest = import_dir(Path(dest_root), fingerprint)
    if dest.is_dir():
        problem = import_problem(dest, fingerprint, hashes=verify)
        if problem is None:
            return dest
        say(f"{problem}; converting {gguf_file.name} again")
        discard_dir(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{os.getpid()}-", dir=dest.parent))
    try:
        if quantization == "none":
            _convert(gguf_file, tmp, dtype=dtype, max_shard_size=max_shard_size, say=say)
        else:
            _convert_quantized(gguf_file, tmp, dtype=dtype, max_shard_size=max_shard_size, scheme=quantization,
                               say=say)
        if source_fingerprint(gguf_file, dtype=dtype, max_shard_size=max_shard_size,
                              quantization=quantization) != fingerprint:
            raise CheckpointError(f"{gguf_file}: changed while it was being converted; apply again")
        _write_record(tmp, gguf_file, fingerprint, dtype=dtype, max_shard_size=max_shard_size)
        return _publish(tmp, dest, fingerprint)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _sayer(progress: Say | None) -> Say:
    def say(line: str) -> None:
        log.info("%s", line)
        if progress is not None:
            progress(line)

    return say


def _remove_dead_temps(dest: Path) -> None:
    """Temp siblings of ``dest`` left by a process that died mid-conversion (its pid is in the name)."""
    for tmp in dest.parent.glob(f".{dest.name}.tmp-*"):
        try:
            pid = int(tmp.name.removeprefix(f".{dest.name}.tmp-").split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue  # not ours, or a live process of another user: leave it


def _convert(gguf_file: Path, out: Path, *, dtype: str, max_shard_size: int, say: Say) -> None:
    """Dequantize ``gguf_file`` and save it into ``out`` (an empty directory)."""
    meta = gguf_metadata(gguf_file)  # a located error for a broken file before transformers' messages
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    started = time.perf_counter()
    say(f"importing {gguf_file.name} ({meta.architecture}, {meta.tensor_count} tensors): dequantizing "
        f"to {dtype}")
    src, name = str(gguf_file.parent), gguf_file.name
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=getattr(torch, dtype),
                                                         quantization_config=GgufConfig(dequantize=True))
    except (ValueError, KeyError, OSError, NotImplementedError, RuntimeError) as exc:
        raise CheckpointError(f"{gguf_file}: transformers cannot convert this GGUF file: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    say(f"writing {gguf_file.name} as safetensors shards of at most {max_shard_size} bytes")
    with quiet_transformers():
        model.save_pretrained(out, max_shard_size=max_shard_size, safe_serialization=True)
    del model  # the dequantized model is the bulk of the peak memory: gone before the tokenizer
    if has_tokenizer(meta):
        _save_tokenizer(gguf_file, out)
    else:
        say(f"{gguf_file.name} carries no tokenizer: the model serves token ids only")
    if not any(out.glob("*.safetensors")) or not (out / "config.json").is_file():
        raise CheckpointError(f"{gguf_file}: the conversion wrote no safetensors weights or config.json")
    say(f"converted {gguf_file.name} in {time.perf_counter() - started:.1f}s")


def _convert_quantized(gguf_file: Path, out: Path, *, dtype: str, max_shard_size: int, scheme: str,
                       say: Say) -> None:
    from ..model.gguf import load_gguf_config
    from .gguf_quantized import convert_quantized

    meta = gguf_metadata(gguf_file)
    started = time.perf_counter()
    try:
        convert_quantized(gguf_file, out, dtype=dtype, max_shard_size=max_shard_size, scheme=scheme,
                          config=load_gguf_config(gguf_file), say=say)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise CheckpointError(f"{gguf_file}: cannot import this GGUF file quantized: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if has_tokenizer(meta):
        _save_tokenizer(gguf_file, out)
    say(f"imported {gguf_file.name} as {scheme} in {time.perf_counter() - started:.1f}s")


def _save_tokenizer(gguf_file: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        raise CheckpointError(f"{gguf_file}: transformers cannot rebuild this GGUF file's tokenizer: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    tokenizer.save_pretrained(out)


def _write_record(directory: Path, gguf_file: Path, fingerprint: str, *, dtype: str, max_shard_size: int) -> None:
    """Fsync every file, then record them with their checksums (the record is written last)."""
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    for f in files:
        with open(directory / f, "rb") as fh:
            os.fsync(fh.fileno())
    record = {"version": RECORD_VERSION, "fingerprint": fingerprint,
              "source": {"path": str(gguf_file), "gguf_fingerprint": gguf_fingerprint(gguf_file)},
              "dtype": dtype, "max_shard_size": int(max_shard_size), "transformers": transformers_version(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "files": checksums(directory, files)}
    write_atomic(directory / GGUF_RECORD, (json.dumps(record, indent=1) + "\n").encode())


def _publish(tmp: Path, dest: Path, fingerprint: str) -> Path:
    """Rename the finished import into place; if another process published the same import first,
    keep theirs when it is intact."""
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; an import is read like any checkpoint directory
    try:
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir() or import_problem(dest, fingerprint, hashes=False) is not None:
            raise
        return dest
    fsync_dir(dest.parent)
    return dest
