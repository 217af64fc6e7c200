"""The state database's tables, the columns added since its first version, and opening it for the first time.
``state.StateStore`` reads and writes it."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from ...errors import ApplyError

SCHEMA_VERSION = 2
# Columns added after schema 1, for databases created before them.
_MIGRATIONS = (("revisions", "checksums_json", "TEXT"), ("deployments", "settled_revision", "INTEGER"),
               ("deployments", "pending_error", "TEXT"), ("revisions", "progress_json", "TEXT"))
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revisions (
    name TEXT NOT NULL,
    revision INTEGER NOT NULL,
    phase TEXT NOT NULL,               -- Progressing | Ready | Failed
    reason TEXT,
    manifest_path TEXT NOT NULL,
    manifest_text TEXT NOT NULL,
    manifest_digest TEXT NOT NULL,
    plan_json TEXT,
    plan_digest TEXT,
    checkpoint_fingerprint TEXT,
    shards_path TEXT,
    git_commit TEXT,
    created_at REAL NOT NULL,
    finished_at REAL,
    timings_json TEXT,
    checksums_json TEXT,               -- size and hash of each weight file when used in place
    progress_json TEXT,                -- a gated rollout's progress (stage, step, share, gates so far)
    PRIMARY KEY (name, revision)
);
CREATE TABLE IF NOT EXISTS deployments (
    name TEXT PRIMARY KEY,
    current_revision INTEGER,          -- the last Ready revision: what serves
    manifest_path TEXT NOT NULL,
    settled_revision INTEGER,          -- latest revision when a no-op apply confirmed the current one
    pending_error TEXT                 -- a change that could not even be recorded (broken manifest)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    revision INTEGER,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_name ON events (name, id);
"""


def setup_database(path: Path) -> None:
    """Create ``path`` (mode 0600) with the tables, in WAL mode, adding the columns it lacks; idempotent. The
    caller holds the directory's setup lock: two processes switching a new database to WAL at once would
    get "database is locked" at once (SQLite's busy handler does not cover it)."""
    if not path.exists():  # created 0600, not with the umask's mode (SQLite's WAL files follow it)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    setup = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        setup.execute("PRAGMA journal_mode=WAL")
        setup.executescript(_SCHEMA)  # idempotent (IF NOT EXISTS); executescript commits itself
        for table, column, kind in _MIGRATIONS:
            have = {row[1] for row in setup.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                setup.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    finally:
        setup.close()


def check_version(db: sqlite3.Connection, path: Path) -> None:
    """Record the schema version in a new database; refuse one written by a newer deploykit."""
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    elif int(row[0]) > SCHEMA_VERSION:
        raise ApplyError(f"{path} was written by a newer deploykit (schema {row[0]})")
