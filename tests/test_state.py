"""The SQLite state store: revisions, outcomes, events, locks, status."""

from __future__ import annotations

import threading
import time

import pytest

from deploykit.errors import ApplyError
from deploykit.control.revisions.report import status_report
from deploykit.control.revisions.state import StateStore


def begin(store: StateStore, name: str = "m") -> int:
    return store.begin_revision(name=name, manifest_path="/x/m.yaml", manifest_text="a: 1\n",
                                manifest_digest="sha256:m", checkpoint_fingerprint="sha256:c", git_commit=None)


def test_revision_lifecycle(tmp_path):
    store = StateStore(tmp_path)
    assert status_report(store, "m")["phase"] == "Pending"
    r1 = begin(store)
    assert store.current("m") is None and store.latest("m").phase == "Progressing"
    store.finish_revision("m", r1, ready=True, reason="ok", timings={"load": 1.5})
    assert store.current("m").revision == 1 and store.current("m").timings == {"load": 1.5}
    r2 = begin(store)
    store.finish_revision("m", r2, ready=False, reason="health check failed")
    assert store.current("m").revision == 1  # the failure changed nothing
    status = status_report(store, "m")
    assert status["phase"] == "Failed" and status["revision"] == 1
    assert "health check failed" in status["last_error"]
    assert [e.kind for e in store.events("m")] == ["Progressing", "Ready", "Progressing", "Failed"]
    assert [r.revision for r in store.history("m")] == [1, 2]


def test_a_dead_applier_is_reported_and_superseded(tmp_path):
    store = StateStore(tmp_path)
    begin(store)  # a process recorded Progressing, then died: no lock is held
    status = status_report(store, "m")
    assert status["phase"] == "Failed" and "interrupted" in status["last_error"]
    with store.deployment_lock("m"):
        r2 = begin(store)
    assert store.get("m", 1).phase == "Failed" and "interrupted" in store.get("m", 1).reason
    assert r2 == 2


def test_running_apply_is_progressing(tmp_path):
    store = StateStore(tmp_path)
    with store.deployment_lock("m"):
        begin(store)
        assert status_report(StateStore(tmp_path), "m")["phase"] == "Progressing"


def test_a_canary_in_its_steps_is_progressing_and_a_restart_records_where_it_stood(tmp_path):
    """A canary's steps hold the rollout lock, not the apply lock: while it is held the revision runs (for
    `deploykit status` without a server too); once its process is gone, the next start records it Failed
    at the step its progress names."""
    store = StateStore(tmp_path)
    store.finish_revision("m", begin(store), ready=True)
    with store.rollout_lock("m"):
        r2 = begin(store)
        store.set_progress("m", r2, {"stage": "traffic", "steps": [50, 100], "step": 1, "share": 50})
        assert status_report(StateStore(tmp_path), "m")["phase"] == "Progressing"
        assert store.interrupt_restarted("m") == []  # it runs: nothing to record
    assert store.interrupt_restarted("m") == [2]
    revision = store.get("m", 2)
    assert (revision.phase, revision.reason) == ("Failed", "interrupted by a restart at step 1 of 2 (50% of new "
                                                           "requests)")
    assert revision.progress == {"stage": "traffic", "steps": [50, 100], "step": 1, "share": 50}
    status = status_report(store, "m")
    assert status["phase"] == "Failed" and status["revision"] == 1
    assert status["last_error"].startswith("interrupted by a restart at step 1"), status
    assert store.interrupt_restarted("m") == []
    begin(store)  # an apply that died while loading (no progress recorded)
    store.interrupt_restarted("m")
    assert store.get("m", 3).reason == "interrupted by a restart while it was being applied"


def test_lock_serialises_and_non_blocking_refuses(tmp_path):
    store = StateStore(tmp_path)
    order = []

    def worker(tag: str) -> None:
        with store.deployment_lock("m"):
            order.append(f"{tag}-in")
            time.sleep(0.1)
            order.append(f"{tag}-out")

    threads = [threading.Thread(target=worker, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order in (["a-in", "a-out", "b-in", "b-out"], ["b-in", "b-out", "a-in", "a-out"])
    with store.deployment_lock("m"):
        with pytest.raises(ApplyError, match="another apply"):
            with store.deployment_lock("m", wait=False):
                pass


def test_unwritable_state_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ApplyError, match="DEPLOYKIT_STATE"):
        StateStore(blocker / "state")


def test_processes_opening_a_new_store_at_once_all_open_it(tmp_path):
    """The switch of a new database to WAL is taken one process at a time (SQLite would answer the second
    with "database is locked" at once), and every one of them records or reads the same schema version."""
    import subprocess
    import sys

    code = ("import sys; from deploykit.control.revisions.state import StateStore; "
            "StateStore(sys.argv[1]).record_event('m', 'opened', 'hello')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "state")], stderr=subprocess.PIPE,
                              text=True) for _ in range(6)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, errors
    store = StateStore(tmp_path / "state")
    assert [e.kind for e in store.events("m")] == ["opened"] * 6
    with store._read() as db:
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchall() == [("2",)]
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_database_of_a_newer_deploykit_is_refused_naming_it(tmp_path):
    store = StateStore(tmp_path)
    with store._write() as db:
        db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(ApplyError, match=r"state\.db was written by a newer deploykit \(schema 99\)"):
        StateStore(tmp_path)
