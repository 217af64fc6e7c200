"""The driver's side of a tensor-parallel generation: N rank processes that deploykit starts itself
(``multiprocessing`` spawn, a free port on 127.0.0.1 for the rendezvous; no ``torchrun``), one pipe per
rank, and the step / release / close calls the batching engine drives them with.

Every call goes to all ranks (they run each forward together, in lockstep, since their collectives
wait for one another) and waits for all answers while watching every rank's process: a rank that dies
fails the call at once with ``RankFailed`` naming it, and the group is then broken for good (its other
ranks are stopped), so that generation fails its health check and is never served again. ``close``
stops every rank (asked, then terminated, then killed), and ranks are daemonic children that also exit
when the driver's pipe closes: no rank outlives its driver.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
from multiprocessing.connection import Connection, wait
from typing import Any

from ...errors import ApplyError
from .rank import RankSpec, main

log = logging.getLogger(__name__)


class RankFailed(ApplyError):
    """A rank process died or failed a call: its generation cannot serve."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    """N started ranks. Thread-safe: one call at a time goes to the ranks."""

    def __init__(self, processes: list[Any], conns: list[Connection]) -> None:
        self.processes, self.conns = processes, conns
        self.infos: list[dict[str, Any]] = []
        self.broken: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def start(cls, specs: list[RankSpec], *, timeout: float = 600.0) -> RankGroup:
        """Spawn one process per spec and wait until every rank has built its share (or one failed)."""
        ctx = multiprocessing.get_context("spawn")
        processes, conns = [], []
        for spec in specs:
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=main, args=(spec, theirs, os.getpid()), daemon=True,
                            name=f"deploykit-rank-{spec.rank}")
            p.start()
            theirs.close()
            processes.append(p)
            conns.append(ours)
        group = cls(processes, conns)
        try:
            group.infos = group._gather(timeout)
        except BaseException:
            group.close()
            raise
        return group

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self.processes if p.pid is not None]

    def step(self, group: str, ids: Any, mask: Any, positions: Any, *, timeout: float | None = None) -> Any:
        """One forward of request group ``group`` on every rank; rank 0's last-position logits."""
        return self.call(("step", group, ids, mask, positions), timeout=timeout)[0]

    def release(self, group: str) -> None:
        if self.broken is None:
            self.call(("release", group))

    def info(self) -> list[dict[str, Any]]:
        return self.call(("info",))

    def call(self, message: tuple[Any, ...], *, timeout: float | None = None) -> list[Any]:
        with self._lock:
            if self.broken is not None:
                raise RankFailed(self.broken)
            try:
                for conn in self.conns:
                    conn.send(message)
                return self._gather(timeout)
            except RankFailed as exc:
                self.broken = str(exc)
                self._stop()
                raise
            except (OSError, EOFError) as exc:
                self.broken = f"lost a rank's pipe: {exc}"
                self._stop()
                raise RankFailed(self.broken) from None

    def _gather(self, timeout: float | None) -> list[Any]:
        """One answer per rank, in rank order; RankFailed as soon as a rank dies or reports an error."""
        answers: dict[int, Any] = {}
        pending = {conn: r for r, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        while pending:
            ready = wait([*pending, *sentinels], timeout)
            if not ready:
                raise RankFailed(f"ranks {sorted(pending.values())} did not answer within {timeout:.0f}s")
            for item in ready:
                if item in pending:
                    rank = pending.pop(item)
                    try:
                        status, value = item.recv()
                    except (EOFError, OSError):
                        raise RankFailed(self._death(rank)) from None
                    if status != "ok":
                        raise RankFailed(self._cause(rank, value))
                    answers[rank] = value
            for item in ready:
                if item in sentinels and sentinels[item] in pending.values():
                    raise RankFailed(self._death(sentinels[item]))
        return [answers[r] for r in range(len(self.conns))]

    def _cause(self, rank: int, error: str) -> str:
        """What to report for ``rank``'s error: a dead peer first (its collectives fail because of it)."""
        others = [(r, p) for r, p in enumerate(self.processes) if r != rank]
        wait([p.sentinel for _, p in others], 1.0)
        dead = [r for r, p in others if not p.is_alive()]
        if dead:
            return f"{self._death(dead[0])} (rank {rank} then failed: {error})"
        return f"rank {rank} failed: {error}"

    def _death(self, rank: int) -> str:
        p = self.processes[rank]
        p.join(1.0)
        return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"

    def alive(self) -> bool:
        return self.broken is None and all(p.is_alive() for p in self.processes)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every rank: asked to close, then terminated, then killed."""
        if self.broken is None:  # not under the lock: a stuck call ends when its ranks are stopped
            self.broken = "the rank group is closed"
        self._stop(timeout)

    def _stop(self, timeout: float = 10.0) -> None:
        for conn, p in zip(self.conns, self.processes):
            if p.is_alive():
                try:
                    conn.send(("close",))
                except (OSError, EOFError, ValueError):
                    pass
        for p in self.processes:
            p.join(timeout / 2)
            if p.is_alive():
                p.terminate()
                p.join(timeout / 2)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
