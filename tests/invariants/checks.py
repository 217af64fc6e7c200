"""Invariants that need nothing of deploykit's: files it must not touch (I7), threads and processes it must
not leave behind (I6), the shape of an OpenAI error (I1)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class Files:
    """The files under ``roots`` (size and mtime), apart from those below ``ignored`` (what deploykit lays
    out, what the test itself rewrites): ``changed()`` lists every one removed or rewritten since."""

    def __init__(self, roots: Iterable[Path], ignored: Iterable[Path] = ()) -> None:
        self.roots, self.ignored = list(roots), [p.resolve() for p in ignored]
        self.before = self._scan()

    def _scan(self) -> dict[str, tuple[int, int]]:
        out = {}
        for root in self.roots:
            for directory, dirs, files in os.walk(root):
                here = Path(directory).resolve()
                dirs[:] = [d for d in dirs if here / d not in self.ignored]
                for f in files:
                    if here / f in self.ignored:
                        continue
                    st = os.stat(here / f)
                    out[str(here / f)] = (st.st_size, st.st_mtime_ns)
        return out

    def changed(self) -> list[str]:
        now = self._scan()
        return sorted([f"removed {p}" for p in self.before if p not in now]
                      + [f"rewritten {p}" for p in self.before if p in now and now[p] != self.before[p]])


def note(text: str) -> None:
    """hypothesis' ``note`` (printed with a failing sequence); nothing when a sequence is replayed by hand."""
    from hypothesis import note as hypothesis_note
    from hypothesis.errors import InvalidArgument

    try:
        hypothesis_note(text)
    except InvalidArgument:  # outside a hypothesis test
        pass


def deploykit_threads() -> set[threading.Thread]:
    """Threads deploykit started (all of them name themselves deploykit-*), alive now."""
    return {t for t in threading.enumerate() if t.name.startswith("deploykit")}


def leaked_threads(before: set[threading.Thread], grace: float = 5.0) -> list[str]:
    """deploykit threads alive now that were not before (waiting ``grace`` for ones being joined)."""
    deadline = time.monotonic() + grace
    while True:
        left = deploykit_threads() - before
        if not left or time.monotonic() > deadline:
            return sorted(t.name for t in left)
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def openai_error(body: Any) -> str | None:
    """Why ``body`` is not an OpenAI error object (None when it is one)."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return f"not an OpenAI error object: {body!r}"[:300]
    error = body["error"]
    missing = [k for k in ("message", "type", "param", "code") if k not in error]
    return f"an error without {missing}: {body!r}"[:300] if missing else None
