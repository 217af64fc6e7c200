"""The supervisor of `deploykit serve` with a real directory, real files and a tiny real model:
one owner per name (a watched file or the control API), an apply of the watched file itself, a reload
worker that survives any exception, one phase for one state, and errors kept under the lock."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from deploykit.control.revisions.report import status_report
from deploykit.control.revisions.state import StateStore
from deploykit.control.live.supervisor import Supervisor
from deploykit.errors import DeploykitError
from deploykit.spec.manifest import load_manifests
from manifests import manifest_text, replace_like_an_editor, write_manifest


def wait_for(predicate, timeout: float = 90.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out {what}"
        time.sleep(0.05)


@pytest.fixture
def watched(model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    supervisor = Supervisor(directory, store=StateStore(tmp_path / "state"), debounce=0.1)
    yield directory, supervisor
    supervisor.close()


def test_a_file_declaring_an_api_owned_name_is_an_error_until_delete_hands_it_over(model, tmp_path, watched):
    directory, supervisor = watched
    supervisor.start()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    [given] = load_manifests(write_manifest(elsewhere, model))
    supervisor.apply_manifest(given)  # deployed through the control API
    assert supervisor.get("tiny") is not None and supervisor.owner("tiny") is None

    file = write_manifest(directory, model, shard="300KiB")  # later, a watched file declares the same name
    dep = supervisor.get("tiny")
    assert dep is not None
    wait_for(lambda: str(file) in (dep.status()["last_error"] or ""), what="for the conflict to show")
    [report] = supervisor.statuses()
    assert str(file) in report["last_error"] and "deploykit delete tiny" in report["last_error"]
    assert report["phase"] == "Failed" and dep.status()["serving"]  # still serving what the API deployed
    supervisor.apply_manifest(given)  # the API still owns the name: not refused

    supervisor.delete("tiny")  # hands the name to the file, which serves it as a new generation
    wait_for(lambda: supervisor.get("tiny") is not None and supervisor.owner("tiny") == file,
             what="for the file to own the name")
    heir = supervisor.get("tiny")
    assert heir is not None and heir is not dep and heir.status()["last_error"] is None
    replace_like_an_editor(file, manifest_text(model, shard="400KiB"))  # and its edits reload it
    wait_for(lambda: heir.generation == 2, what="for the file's edit to reload")
    with pytest.raises(DeploykitError, match="owned by the watched file"):
        supervisor.delete("tiny")


def test_applying_the_watched_file_reconciles_it_now(model, tmp_path, watched):
    directory, supervisor = watched
    file = write_manifest(directory, model)
    supervisor.start()
    store = supervisor.store
    outcome = supervisor.apply_manifest(load_manifests(file)[0])  # as `deploykit apply FILE` sends it
    assert outcome.status == "unchanged"

    replace_like_an_editor(file, manifest_text(model, shard="300KiB"))  # saved (the watcher sees it)...
    outcome = supervisor.apply_manifest(load_manifests(file)[0])  # ...and applied at once
    dep = supervisor.get("tiny")
    assert dep is not None
    wait_for(lambda: dep.generation == 2 and dep.status()["phase"] == "Ready")
    time.sleep(0.5)  # let the watcher's event (debounce 0.1 s) run its reload too
    wait_for(lambda: dep.status()["phase"] == "Ready")
    assert [r.phase for r in store.history("tiny")] == ["Ready", "Ready"]  # exactly one new revision

    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights are 128 wide
    (broken / "config.json").write_text(json.dumps(config))
    replace_like_an_editor(file, manifest_text(broken, shard="300KiB"))
    with pytest.raises(DeploykitError, match="do not match config.json"):  # the real reason
        supervisor.apply_manifest(load_manifests(file)[0])
    assert dep.generation == 2 and dep.status()["serving"]

    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(DeploykitError, match="owned by the watched file"):  # a different file: refused
        supervisor.apply_manifest(load_manifests(write_manifest(other, model))[0])


def test_an_unexpected_exception_fails_the_revision_and_the_worker_lives_on(model, tmp_path, watched):
    directory, supervisor = watched
    file = write_manifest(directory, model)
    supervisor.start()
    dep = supervisor.get("tiny")
    assert dep is not None
    odd = Path(shutil.copytree(model, tmp_path / "odd"))
    (odd / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')  # transformers raises KeyError
    replace_like_an_editor(file, manifest_text(odd, shard="300KiB"))
    wait_for(lambda: dep.status()["last_error"] is not None, what="for the failure")
    status = dep.status()
    assert "KeyError" in status["last_error"] and status["phase"] == "Failed" and status["serving"]
    latest = supervisor.store.latest("tiny")
    assert latest is not None and latest.phase == "Failed" and "KeyError" in (latest.reason or "")
    replace_like_an_editor(file, manifest_text(model, shard="400KiB"))  # the worker is alive: this reloads
    wait_for(lambda: dep.generation == 2 and dep.status()["phase"] == "Ready", what="for the next reload")
    assert dep.status()["last_error"] is None


def test_one_phase_for_a_pending_error_while_the_last_good_generation_serves(model, watched):
    directory, supervisor = watched
    file = write_manifest(directory, model)
    supervisor.start()
    replace_like_an_editor(file, file.read_text().replace("max_shard_size: 200KiB", "max_shard_sze: 1"))
    dep = supervisor.get("tiny")
    assert dep is not None
    wait_for(lambda: dep.status()["last_error"] is not None)
    [ops] = supervisor.statuses()  # ops /status
    cli = status_report(supervisor.store, "tiny")  # `deploykit status` without a server
    assert ops["phase"] == cli["phase"] == dep.status()["phase"] == "Failed"
    assert supervisor.ready() == (True, [])  # ready: the last good generation serves


def test_errors_are_written_under_the_lock_that_readers_hold(model, watched):
    directory, supervisor = watched
    files = [directory / f"broken{i}.yaml" for i in range(64)]
    for f in files:
        f.write_text("kind: [broken\n")
    failures: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                supervisor.ready()
                supervisor.statuses()
            except RuntimeError as exc:  # "dictionary changed size during iteration"
                failures.append(repr(exc))
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(20):
            for f in files:
                supervisor.files.names(f)  # what a file event does: records or clears the file's error
                supervisor.files.file_removed(f, [])
    finally:
        stop.set()
        reader.join()
    assert failures == []


def test_an_api_apply_racing_a_new_file_of_the_same_name_leaves_one_live_deployment(model, tmp_path, watched):
    """The API claims the name before it loads, and the file's load waits for the name's turn: it then finds
    the API's deployment and shows a conflict, where it used to load a second one that displaced the first
    (whose change thread and model were never freed)."""
    directory, supervisor = watched
    earlier = set(threading.enumerate())  # another test's deployment of this name is not this one's
    supervisor.start()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    [given] = load_manifests(write_manifest(elsewhere, model))
    file: list[Path] = []

    def during_the_load(step: str) -> None:
        if not file:  # once, while the API's apply loads: a watched file declaring the same name appears
            file.append(write_manifest(directory, model, shard="300KiB"))
            wait_for(lambda: any(t.name.startswith("deploykit-add") for t in threading.enumerate()),
                     what="for the file's load to start")

    supervisor.apply_manifest(given, on_step=during_the_load)
    wait_for(lambda: not any(t.name.startswith("deploykit-add") for t in threading.enumerate()),
             what="for the file's load to end")
    changing = [t for t in threading.enumerate() if t.name == "deploykit-change-tiny" and t not in earlier]
    assert len(changing) == 1, changing  # one live Deployment of the name
    dep = supervisor.get("tiny")
    assert dep is not None and supervisor.owner("tiny") is None  # the API's, as it claimed first
    wait_for(lambda: str(file[0]) in (dep.status()["last_error"] or ""), what="for the conflict to show")


def test_a_name_two_files_declare_is_the_first_files_in_path_order_and_the_other_is_shown_in_conflict(
        model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    first, second = directory / "a.yaml", directory / "b.yaml"
    first.write_text(manifest_text(model, shard="200KiB"))
    second.write_text(manifest_text(model, shard="300KiB"))  # the same name, "tiny"
    for attempt in range(3):  # not by the order the parallel loads happen to claim it in
        supervisor = Supervisor(directory, store=StateStore(tmp_path / f"state{attempt}"), debounce=0.1)
        try:
            supervisor.start()
            dep = supervisor.get("tiny")
            assert dep is not None and supervisor.owner("tiny") == first.resolve()
            error = dep.status()["last_error"] or ""
            assert str(second.resolve()) in error and str(first.resolve()) in error, error
            assert dep.status()["serving"]
            if attempt == 2:  # the other file stops declaring it: the conflict is over
                replace_like_an_editor(second, manifest_text(model, name="other", shard="300KiB"))
                wait_for(lambda: dep.status()["last_error"] is None, what="for the conflict to clear")
                wait_for(lambda: supervisor.get("other") is not None, what="for the new name to serve")
        finally:
            supervisor.close()


def test_a_prune_waits_for_the_names_turn_and_hands_the_name_to_the_file_in_conflict(model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    first, second = directory / "a.yaml", directory / "b.yaml"
    first.write_text(manifest_text(model, shard="200KiB"))
    second.write_text(manifest_text(model, shard="300KiB"))
    supervisor = Supervisor(directory, store=StateStore(tmp_path / "state"), debounce=0.1, prune=True)
    try:
        supervisor.start()
        dep = supervisor.get("tiny")
        assert dep is not None
        with supervisor.roster.turns.exclusive("tiny", "a change the test holds"):
            first.unlink()
            wait_for(lambda: any(t.name == "deploykit-prune" for t in threading.enumerate()),
                     what="for the prune to start")
            assert supervisor.get("tiny") is dep  # it waits for the turn: nothing is pruned under a change
        wait_for(lambda: supervisor.get("tiny") not in (None, dep), what="for the other file to serve the name")
        assert supervisor.owner("tiny") == second.resolve()
        heir = supervisor.get("tiny")
        assert heir is not None and heir.status()["last_error"] is None
    finally:
        supervisor.close()


def test_a_close_during_the_first_loads_leaves_no_watcher_running(model, tmp_path):
    directory = tmp_path / "manifests"
    directory.mkdir()
    write_manifest(directory, model)
    supervisor = Supervisor(directory, store=StateStore(tmp_path / "state"), debounce=0.1)
    starting = threading.Thread(target=supervisor.start, name="test-start")
    closing = threading.Thread(target=supervisor.close, name="test-close")
    with supervisor.roster.turns.exclusive("tiny", "a change the test holds"):  # the first load waits on it
        starting.start()
        wait_for(lambda: any(t.name.startswith("deploykit-load") for t in threading.enumerate()),
                 what="for the first load to start")
        closing.start()
        wait_for(lambda: supervisor.served.closing, what="for the close to begin")
    starting.join(120)
    closing.join(120)
    assert not starting.is_alive() and not closing.is_alive()
    assert not [t.name for t in threading.enumerate() if t.name == "deploykit-watch"]
