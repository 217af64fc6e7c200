"""Crash-safe file-system steps: fsync'd writes, atomic replacement, atomic directory exchange.

Every file deploykit writes goes to a temporary name, is fsynced, and is renamed into place; the
directory is fsynced after. Directories are replaced whole (``exchange_dirs``) or set aside before
removal (``discard_dir``), so no reader ever sees a half-written or half-removed tree.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old file or the new one. The
    temporary file has an unpredictable name and is created new (``O_EXCL``), never through a link
    (``O_NOFOLLOW``): a link planted at a guessable name cannot redirect the write."""
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def copy_file_synced(src: Path, dst: Path) -> None:
    """Copy a small file with its metadata and fsync it (no rename: the caller stages it)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    with open(dst, "rb") as fh:
        os.fsync(fh.fileno())


def _renameat2_exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or file system without RENAME_EXCHANGE: the caller falls back
    raise OSError(err, os.strerror(err), str(a))


def exchange_dirs(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE). False if unsupported."""
    if not _renameat2_exchange(a, b):
        return False
    fsync_dir(a.parent)
    if b.parent != a.parent:
        fsync_dir(b.parent)
    return True


def discard_dir(path: Path) -> None:
    """Rename ``path`` aside at once (its name is free for a new copy), then remove it. A process that
    still maps its files keeps their pages until it lets go."""
    aside = path.with_name(f".{path.name}.discarded-{os.getpid()}-{id(path)}")
    path.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)
