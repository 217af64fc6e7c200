"""The record of what is deployed: revisions, their plans and outcomes, and events. SQLite (stdlib).

Location: ``$DEPLOYKIT_STATE`` (a directory), else ``$XDG_STATE_HOME/deploykit``, else
``~/.local/state/deploykit``; the database is ``state.db`` inside it, in WAL mode. Reads are plain
statements and never wait behind a writer (``/status`` during a long apply answers at once); every
write is one ``BEGIN IMMEDIATE`` transaction. ``open_store`` gives one store per directory per process,
shared by every deployment a server holds. Presentation (status reports, tables) lives in ``report``. A revision is recorded
as Progressing *before* any side effect and gets its outcome after (Ray Serve's order: checkpoint,
then act), so a crash never leaves a half-recorded revision: at worst a Progressing one, which the next
apply marks Failed ("interrupted") and then supersedes.

Applies of one deployment are serialised across processes by ``deployment_lock`` (an ``flock`` on a
per-name file, ``locks``); the lock dies with its process, so ``kill -9`` never leaves it held. The tables
and their migrations are ``schema``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ApplyError
from ...placement.plan import Plan
from .locks import NameLocks, file_lock
from .schema import check_version, setup_database


def default_state_dir() -> Path:
    if os.environ.get("DEPLOYKIT_STATE"):
        return Path(os.environ["DEPLOYKIT_STATE"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "deploykit"


@dataclass(frozen=True)
class Revision:
    name: str
    revision: int
    phase: str
    reason: str | None
    manifest_path: str
    manifest_text: str
    manifest_digest: str
    plan_json: str | None
    plan_digest: str | None
    checkpoint_fingerprint: str | None
    shards_path: str | None
    git_commit: str | None
    created_at: float
    finished_at: float | None
    timings_json: str | None
    checksums_json: str | None = None
    progress_json: str | None = None

    @property
    def progress(self) -> dict[str, Any] | None:
        """A gated rollout's last recorded progress (``set_progress``), None when none was recorded."""
        return json.loads(self.progress_json) if self.progress_json else None

    @property
    def checksums(self) -> dict[str, dict] | None:
        return json.loads(self.checksums_json) if self.checksums_json else None

    @property
    def plan(self) -> Plan | None:
        """The plan this revision was laid out and loaded with (parsed from the record each time)."""
        return Plan.from_dict(json.loads(self.plan_json)) if self.plan_json else None

    @property
    def timings(self) -> dict[str, float]:
        return json.loads(self.timings_json) if self.timings_json else {}


@dataclass(frozen=True)
class Event:
    name: str
    revision: int | None
    at: float
    kind: str
    message: str


def _make_private(directory: Path) -> None:
    """Mode 0700 for the state directory and its ``locks/``, also when an older deploykit (or a person) made
    them readable to others: mkdir's mode applies only to a directory it creates."""
    for path in (directory, directory / "locks"):
        try:
            if path.is_dir() and stat.S_IMODE(path.stat().st_mode) != 0o700:
                path.chmod(0o700)
        except OSError as exc:
            raise ApplyError(f"cannot make the state directory {path} private (mode 0700): {exc.strerror}; it "
                             "holds the control token and every manifest (set DEPLOYKIT_STATE to a directory "
                             "of your own)") from None


class StateStore(NameLocks):
    """One SQLite database; safe to use from several threads (one connection per call)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_state_dir()
        try:  # it holds the control token (server.json) and every manifest: the owner's alone
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ApplyError(f"cannot create the state directory {self.directory}: {exc.strerror} "
                             "(set DEPLOYKIT_STATE to a writable directory)") from None
        _make_private(self.directory)
        self.path = self.directory / "state.db"
        # Two processes that open a new store at once would race on the switch to WAL, which SQLite
        # answers with "database is locked" at once (its busy handler does not cover it): one at a time.
        with file_lock(self.directory / "state.db.setup-lock"):
            setup_database(self.path)
            with self._write() as db:
                check_version(db, self.path)

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A plain connection: WAL readers see the last committed state and never wait for writers."""
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    # ---- writes -----------------------------------------------------------------------------------

    def begin_revision(self, *, name: str, manifest_path: str, manifest_text: str, manifest_digest: str,
                       checkpoint_fingerprint: str | None, git_commit: str | None) -> int:
        """Record a new revision as Progressing, before anything is done for it. Returns its number."""
        now = time.time()
        with self._write() as db:
            self._interrupt_stale(db, name)
            number = db.execute("SELECT COALESCE(MAX(revision), 0) + 1 FROM revisions WHERE name=?",
                                (name,)).fetchone()[0]
            db.execute("INSERT INTO revisions (name, revision, phase, manifest_path, manifest_text, "
                       "manifest_digest, checkpoint_fingerprint, git_commit, created_at) "
                       "VALUES (?, ?, 'Progressing', ?, ?, ?, ?, ?, ?)",
                       (name, number, manifest_path, manifest_text, manifest_digest, checkpoint_fingerprint,
                        git_commit, now))
            db.execute("INSERT INTO deployments (name, current_revision, manifest_path) VALUES (?, NULL, ?) "
                       "ON CONFLICT(name) DO UPDATE SET manifest_path=excluded.manifest_path",
                       (name, manifest_path))
            self._event(db, name, number, "Progressing", "apply started")
        return number

    def set_plan(self, name: str, revision: int, *, plan_json: str, plan_digest: str,
                 shards_path: str, checksums: dict[str, dict] | None = None) -> None:
        with self._write() as db:
            db.execute("UPDATE revisions SET plan_json=?, plan_digest=?, shards_path=?, checksums_json=? "
                       "WHERE name=? AND revision=?",
                       (plan_json, plan_digest, shards_path, json.dumps(checksums) if checksums else None,
                        name, revision))

    def finish_revision(self, name: str, revision: int, *, ready: bool, reason: str | None = None,
                        timings: dict[str, float] | None = None) -> None:
        """Record the outcome. A Ready revision becomes current; a Failed one changes nothing else."""
        with self._write() as db:
            db.execute("UPDATE revisions SET phase=?, reason=?, finished_at=?, timings_json=? "
                       "WHERE name=? AND revision=?",
                       ("Ready" if ready else "Failed", reason, time.time(),
                        json.dumps(timings) if timings else None, name, revision))
            if ready:
                db.execute("UPDATE deployments SET current_revision=?, pending_error=NULL WHERE name=?",
                           (revision, name))
            self._event(db, name, revision, "Ready" if ready else "Failed", reason or "ready")

    def set_progress(self, name: str, revision: int, progress: dict[str, Any]) -> None:
        """Record where a gated rollout of ``revision`` stands (stage, step, share, gate values so far), so a
        restart in its middle can say what happened to it. Only while the revision is still Progressing."""
        with self._write() as db:
            db.execute("UPDATE revisions SET progress_json=? WHERE name=? AND revision=? AND phase='Progressing'",
                       (json.dumps(progress), name, revision))

    def interrupt_restarted(self, name: str) -> list[int]:
        """A process starts holding ``name`` (``deploykit serve`` started again, a ``Deployment`` created):
        record every Progressing revision that no process applies or rolls out any more as Failed,
        "interrupted by a restart at step k" (what the last gated rollout recorded of itself). Returns them."""
        try:  # both locks held while it looks and writes: no change can begin in between
            with self.deployment_lock(name, wait=False), self.rollout_lock(name, wait=False):
                with self._write() as db:
                    rows = db.execute("SELECT revision, progress_json FROM revisions WHERE name=? AND "
                                      "phase='Progressing'", (name,)).fetchall()
                    for revision, progress in rows:
                        self._fail(db, name, revision, "interrupted by a restart " + _where(progress))
        except ApplyError:  # some process applies it or rolls it out now: its revision is on its way
            return []
        return [r for r, _ in rows]

    def record_event(self, name: str, kind: str, message: str, revision: int | None = None) -> None:
        with self._write() as db:
            self._event(db, name, revision, kind, message)

    def settle(self, name: str) -> None:
        """A no-op apply confirmed the current revision: earlier failures and pending errors are over."""
        with self._write() as db:
            db.execute("UPDATE deployments SET settled_revision=(SELECT MAX(revision) FROM revisions WHERE "
                       "name=?), pending_error=NULL WHERE name=?", (name, name))

    def set_pending_error(self, name: str, message: str | None) -> None:
        """A change that failed before any revision could be recorded (a broken manifest), or None."""
        with self._write() as db:
            db.execute("UPDATE deployments SET pending_error=? WHERE name=?", (message, name))
            if message:
                self._event(db, name, None, "ReloadFailed", message)

    def forget(self, name: str, *, reason: str = "manifest removed; deployment pruned") -> None:
        """Remove a deployment from the current set (its history stays)."""
        with self._write() as db:
            db.execute("DELETE FROM deployments WHERE name=?", (name,))
            self._event(db, name, None, "Deleted", reason)

    @staticmethod
    def _event(db: sqlite3.Connection, name: str, revision: int | None, kind: str, message: str) -> None:
        db.execute("INSERT INTO events (name, revision, at, kind, message) VALUES (?, ?, ?, ?, ?)",
                   (name, revision, time.time(), kind, message))

    @staticmethod
    def _interrupt_stale(db: sqlite3.Connection, name: str) -> None:
        # Called with the deployment lock held: a Progressing revision now belongs to a dead process.
        stale = db.execute("SELECT revision, progress_json FROM revisions WHERE name=? AND phase='Progressing'",
                           (name,)).fetchall()
        for revision, progress in stale:
            reason = ("interrupted: the applying process died" if progress is None
                      else f"interrupted {_where(progress)}: the process running it stopped")
            StateStore._fail(db, name, revision, reason)

    @staticmethod
    def _fail(db: sqlite3.Connection, name: str, revision: int, reason: str) -> None:
        db.execute("UPDATE revisions SET phase='Failed', reason=?, finished_at=? WHERE name=? AND revision=?",
                   (reason, time.time(), name, revision))
        StateStore._event(db, name, revision, "Failed", reason)

    # ---- reads ------------------------------------------------------------------------------------

    def _revision(self, row: tuple | None) -> Revision | None:
        return Revision(*row) if row else None

    _COLUMNS = ("name, revision, phase, reason, manifest_path, manifest_text, manifest_digest, plan_json, "
                "plan_digest, checkpoint_fingerprint, shards_path, git_commit, created_at, finished_at, "
                "timings_json, checksums_json, progress_json")

    def current(self, name: str) -> Revision | None:
        with self._read() as db:
            row = db.execute(f"SELECT {self._COLUMNS} FROM revisions WHERE name=? AND revision=("
                             "SELECT current_revision FROM deployments WHERE name=?)", (name, name)).fetchone()
        return self._revision(row)

    def latest(self, name: str) -> Revision | None:
        with self._read() as db:
            row = db.execute(f"SELECT {self._COLUMNS} FROM revisions WHERE name=? ORDER BY revision DESC "
                             "LIMIT 1", (name,)).fetchone()
        return self._revision(row)

    def get(self, name: str, revision: int) -> Revision | None:
        with self._read() as db:
            row = db.execute(f"SELECT {self._COLUMNS} FROM revisions WHERE name=? AND revision=?",
                             (name, revision)).fetchone()
        return self._revision(row)

    def history(self, name: str) -> list[Revision]:
        with self._read() as db:
            rows = db.execute(f"SELECT {self._COLUMNS} FROM revisions WHERE name=? ORDER BY revision",
                              (name,)).fetchall()
        return [Revision(*r) for r in rows]

    def names(self) -> list[str]:
        with self._read() as db:
            rows = db.execute("SELECT name FROM deployments ORDER BY name").fetchall()
        return [r[0] for r in rows]

    def deployment_manifest(self, name: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT manifest_path FROM deployments WHERE name=?", (name,)).fetchone()
        return row[0] if row else None

    def events(self, name: str, limit: int = 20) -> list[Event]:
        with self._read() as db:
            rows = db.execute("SELECT name, revision, at, kind, message FROM events WHERE name=? "
                              "ORDER BY id DESC LIMIT ?", (name, limit)).fetchall()
        return [Event(*r) for r in reversed(rows)]

    def deployment(self, name: str) -> dict[str, Any] | None:
        """The deployment's row: manifest path, settled revision, pending error."""
        with self._read() as db:
            row = db.execute("SELECT manifest_path, settled_revision, pending_error FROM deployments WHERE name=?",
                             (name,)).fetchone()
        return None if row is None else {"manifest_path": row[0], "settled_revision": row[1],
                                         "pending_error": row[2]}



def _where(progress_json: str | None) -> str:
    """Where a rollout stood, from its recorded progress: "at step 1 of 2 (50% of new requests)"."""
    progress = json.loads(progress_json) if progress_json else None
    if progress is None:
        return "while it was being applied"
    steps, step = progress.get("steps") or [], progress.get("step") or 0
    if step:
        return f"at step {step} of {len(steps)} ({progress.get('share', 0)}% of new requests)"
    return "before its first step (while its golden gates ran)" if steps else "while its golden gates ran"


_STORES: dict[Path, StateStore] = {}
_STORES_LOCK = threading.Lock()


def open_store(directory: Path | None = None) -> StateStore:
    """The process's one store for ``directory`` (default: ``default_state_dir()``)."""
    key = (Path(directory) if directory is not None else default_state_dir()).resolve()
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = StateStore(key)
        return _STORES[key]
