"""Reading a file a manifest names, bounded: a regular file only, at most a given size.

A manifest (or a control-API request carrying one) may name any path: ``/dev/zero`` read whole grows the
server until it fails, a FIFO blocks the reading thread forever, a multi-gigabyte file is read into memory.
Every file deploykit reads from a manifest-named path (golden references, config.json beside a model,
adapter configs) is read here: opened without blocking (a FIFO opens at once), checked to be a regular
file, refused past ``limit`` bytes, then read with the limit as a cap (a file that grows while read is
refused too). Nothing here may import above ``errors``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is a few KiB
MAX_INDEX_BYTES = 64 << 20  # a safetensors index names every tensor: a few MiB for the largest models


class FileRefused(OSError):
    """A file that is not a regular file, or larger than what may be read of it (an ``OSError``: callers
    that report an unreadable file report this one the same way)."""


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them. Raises ``FileRefused`` for a
    device, FIFO, socket or directory, or a file over ``limit`` bytes; ``OSError`` when it cannot be opened
    (``FileNotFoundError`` when it does not exist)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO opens without a writer
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(f"{str(path)!r} is not a regular file ({_kind(info.st_mode)})")
        if info.st_size > limit:
            raise FileRefused(f"{str(path)!r} is {info.st_size} bytes; at most {limit} are read")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise FileRefused(f"{str(path)!r} grew past {limit} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
