"""An on-disk cache of model structures, so a warm ``deploykit plan`` needs neither torch nor transformers.

Building a structure means importing torch and transformers and building a meta model: seconds, almost
all of it imports. The result depends only on what the key covers, so it is stored once per key as a
small JSON file and read back in milliseconds. The key is a SHA-256 over:

- the bytes of ``config.json`` (any edit, even whitespace, is a new key); for a GGUF file, which has
  no config.json, its fingerprint instead (``model.gguf``: size, mtime in ns, and the header and
  metadata bytes, so a rewritten file is a new key);
- the task, the dtype, the quantization (only when not ``none``) and ``trust_remote_code``; with ``trust_remote_code``, also the bytes of every
  ``*.py`` file in the model directory (remote code on the Hub, outside the directory, is not covered);
- ``structure.FORMAT_VERSION``, bumped whenever the rules that cut a model into blocks change;
- the installed transformers *distribution* version, read from its ``.dist-info`` directory name
  (never by importing transformers): a new transformers release may rename or add modules, which
  would make a cached device_map stale. Where it cannot be found the key says ``unknown``.

Location: ``$DEPLOYKIT_CACHE`` if set, else ``$XDG_CACHE_HOME/deploykit/structures``, else
``~/.cache/deploykit/structures``; one ``<key>.json`` per key, written atomically (temp file in the same
directory, then ``os.replace``), so a reader sees a whole file or none.

This module must never import torch or transformers (it is the point of it), and must never raise: a
missing, unreadable or corrupt file is a miss (the caller rebuilds and rewrites it), and a directory that
cannot be written just means no caching. Both are logged at debug level only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

ENV_VAR = "DEPLOYKIT_CACHE"
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where structure files live (not created here). Empty variables count as unset."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deploykit" / "structures"


@functools.cache
def transformers_version() -> str:
    """The installed transformers version, from its dist-info directory name; no import of it."""
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return "unknown"
    if spec is None or spec.origin is None:
        return "unknown"
    site = Path(spec.origin).parent.parent
    found = sorted(p.name for p in site.glob("transformers-*.dist-info"))
    return found[-1].removeprefix("transformers-").removesuffix(".dist-info") if found else "unknown"


def _remote_code(model_dir: Path) -> list[str]:
    """name:sha256 of each ``*.py`` in the model directory (what ``trust_remote_code`` may run)."""
    return [f"{p.name}:{_file_digest(p)}" for p in sorted(model_dir.glob("*.py"))]


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return "unreadable"  # the key changes again once it can be read


def structure_key(config_json: bytes, *, model_dir: Path, task: str, dtype: str, trust_remote_code: bool,
                  format_version: int, gguf_fingerprint: str | None = None, quantization: str = "none") -> str:
    """The cache key (hex SHA-256) of one structure. See the module docstring for what it covers.
    For a GGUF file (``gguf_fingerprint`` given), ``config_json`` is empty and the fingerprint stands
    for it."""
    parts: dict[str, Any] = {
        "config": hashlib.sha256(config_json).hexdigest(),
        "task": task,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        "format": format_version,
        "transformers": transformers_version(),
    }
    if gguf_fingerprint is not None:
        parts["gguf"] = gguf_fingerprint
    if quantization != "none":  # sizes change with it; unquantized keys stay as they were
        parts["quantization"] = quantization
    if trust_remote_code:
        parts["remote_code"] = _remote_code(Path(model_dir))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(key: str) -> Path:
    return cache_dir() / f"{key}.json"


def load(key: str) -> dict[str, Any] | None:
    """The payload stored under ``key``, or None if there is none or it cannot be read as one."""
    path = _path(key)
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.debug("structure cache: ignoring unreadable %s: %s", path, exc)
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("payload"), dict):
        log.debug("structure cache: ignoring malformed %s", path)
        return None
    payload: dict[str, Any] = data["payload"]
    return payload


def store(key: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` under ``key`` atomically; on any failure, log at debug level and go on."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    except OSError as exc:
        log.debug("structure cache: not writable (%s): %s", directory, exc)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"key": key, "payload": payload}, fh, separators=(",", ":"))
        os.replace(tmp, _path(key))
    except (OSError, TypeError, ValueError) as exc:
        log.debug("structure cache: cannot write %s: %s", _path(key), exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
