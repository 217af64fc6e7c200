"""What the llama.cpp tests share: the real SmolLM2 GGUF, a usable llama-server (skipped, with the reason,
only when none is found), and manifests for the llama.cpp engine."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
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


class FrozenLoop:
    """``with FrozenLoop(pid):`` stops only llama-server's decode loop (its main thread, ``ptrace``'s
    ``PTRACE_INTERRUPT``) while its HTTP threads run on: ``/health`` answers, no token is ever produced (a stuck
    decode). This process is then the loop's tracer: a thread of its own collects the engine's stops and its
    end (so that its parent can reap it); leaving the block kills the engine if it still runs and joins it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._reaper: threading.Thread | None = None

    def __enter__(self) -> FrozenLoop:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        for request in (_PTRACE_SEIZE, _PTRACE_INTERRUPT):
            if libc.ptrace(request, self.pid, None, None) != 0:
                pytest.skip(f"ptrace is not allowed here (errno {ctypes.get_errno()})")
        self._reaper = threading.Thread(target=self._reap, name="test-frozen-loop-reaper")
        self._reaper.start()
        return self

    def _reap(self) -> None:
        while True:
            try:
                _, status = os.waitpid(self.pid, _WALL)
            except ChildProcessError:
                return
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                return

    def __exit__(self, *exc: object) -> None:
        if alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
        assert self._reaper is not None
        self._reaper.join(30)
        assert not self._reaper.is_alive()


_PTRACE_SEIZE, _PTRACE_INTERRUPT, _WALL = 0x4206, 0x4207, 0x40000000

