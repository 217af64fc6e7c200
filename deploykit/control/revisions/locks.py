"""Which process applies a deployment, or runs its gated rollout, now: ``flock`` on a file per name in the
state directory's ``locks/``. A lock dies with its process, so ``kill -9`` never leaves one held."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ...errors import ApplyError


class NameLocks:
    """The per-name locks of the state directory ``self.directory`` (``state.StateStore`` has them)."""

    directory: Path

    def apply_running(self, name: str) -> bool:
        """Whether some process holds the deployment's apply lock right now."""
        try:
            with self.deployment_lock(name, wait=False):
                return False
        except ApplyError:
            return True

    def change_running(self, name: str) -> bool:
        """Whether some process applies ``name`` or runs a gated rollout of it (whose steps hold no apply
        lock) right now: a Progressing revision is then still on its way, not interrupted."""
        if self.apply_running(name):
            return True
        try:
            with self.rollout_lock(name, wait=False):
                return False
        except ApplyError:
            return True

    @contextlib.contextmanager
    def deployment_lock(self, name: str, *, wait: bool = True) -> Iterator[None]:
        """Serialise applies of ``name`` across threads and processes."""
        locks = self.directory / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        with file_lock(locks / f"{name}.lock", busy=None if wait else f"another apply of {name!r} is running"):
            yield

    @contextlib.contextmanager
    def rollout_lock(self, name: str, *, wait: bool = True) -> Iterator[None]:
        """Held by the process that runs a gated rollout of ``name``, from its apply to its outcome: while
        it is held, the rollout's Progressing revision is alive (``change_running``); it dies with its
        process, so a ``kill -9`` in a canary's step leaves it free for ``interrupt_restarted``."""
        locks = self.directory / "locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        with file_lock(locks / f"{name}.rollout.lock",
                        busy=None if wait else f"a rollout of {name!r} is running"):
            yield


@contextlib.contextmanager
def file_lock(path: Path, *, busy: str | None = None) -> Iterator[None]:
    """An ``flock`` on ``path``, waited for; with ``busy``, not waited for: ApplyError(busy) when it is
    held. It dies with its process, so ``kill -9`` never leaves it held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if busy is None else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ApplyError(busy or "locked") from None
        yield
    finally:
        os.close(fd)  # closing releases the flock
