"""What the llama.cpp tests share: the real SmolLM2 GGUF, a usable llama-server (skipped, with the reason,
only when none is found), and manifests for the llama.cpp engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploykit.engine.llamacpp.binary import Binary, BinaryError, find_binary


def llama_server() -> Binary:
    """The llama-server deploykit would run (skip, saying why, when there is none: `make test` installs
    one through the deploykit[llamacpp] extra)."""
    try:
        return find_binary(None)
    except BinaryError as exc:
        pytest.skip(f"no usable llama-server ({exc})")


def manifest(gguf: Path, *, name: str = "smol", engine: str = "", serving: str = "", extra: str = "") -> str:
    return (f"apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {{name: {name}}}\nspec:\n"
            f"  model: {{path: {gguf}}}\n"
            f"  engine: {{name: llama.cpp, slots: 2, context: 512{engine}}}\n"
            f"  serving: {{max_tokens: 64, default_max_tokens: 16{serving}}}\n" + extra)


def engine_pids(parent: int) -> list[int]:
    """The llama-server processes ``parent`` (a deploykit serve) started, from /proc."""
    found = []
    for task in Path(f"/proc/{parent}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"llama-server" in cmdline.split(b"\0")[0]:
                found.append(child)
    return sorted(found)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
