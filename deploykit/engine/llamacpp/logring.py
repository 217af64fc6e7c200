"""A llama-server's output, kept as a bounded ring of its last lines (never a file that grows).

llama-server logs every request; a process that serves for weeks would fill an unbounded temporary file
(and its disk). One reader thread per process drains its stdout/stderr pipe (so the process never blocks
on a full pipe), keeps the newest ``limit`` bytes of lines for error messages (``tail``), and passes each
line to deploykit's logger at DEBUG. The thread ends when the pipe closes (the process ended) and is
joined by ``close``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

log = logging.getLogger(__name__)
RING_BYTES = 64 * 1024
LINE_BYTES = 4096  # a longer line is cut: one line never takes the whole ring


class LogRing:
    """Reads ``fd`` (the read end of the process's output pipe, owned from now on) on a thread of its own."""

    def __init__(self, fd: int, *, name: str, limit: int = RING_BYTES) -> None:
        self.limit = limit
        self._lines: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()
        self._file = os.fdopen(fd, "rb")
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with self._file:
            for line in iter(lambda: self._file.readline(LINE_BYTES), b""):  # b"": the writer (the process) has ended
                self._keep(line.rstrip(b"\n"))

    def _keep(self, line: bytes) -> None:
        log.debug("llama-server: %s", line.decode(errors="replace"))
        with self._lock:
            self._lines.append(line)
            self._size += len(line) + 1
            while self._size > self.limit and len(self._lines) > 1:
                self._size -= len(self._lines.popleft()) + 1

    def size(self) -> int:
        """Bytes held now (at most ``limit`` plus one line)."""
        with self._lock:
            return self._size

    def tail(self, limit: int = 4000) -> str:
        """The end of what the process wrote, at most ``limit`` characters."""
        with self._lock:
            text = b"\n".join(self._lines).decode(errors="replace")
        return text.strip()[-limit:]

    def close(self, timeout: float = 5.0) -> None:
        """Join the reader (the process has ended: its pipe is at its end, or soon will be)."""
        self._thread.join(timeout)
