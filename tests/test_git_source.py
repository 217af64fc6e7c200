"""A git source followed by a real supervisor, with the tiny model: a push is applied and the revision
records its commit; a commit with one broken manifest is refused whole while the last good one serves;
a deleted manifest is pruned only with prune: true; an unsigned commit is not applied when commits must be
verified; a restart serves the last applied commit without fetching."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploykit.spec.manifest import load_manifests
from gitrepos import Followed, GitDaemon, allowed_signers, commit_files, new_repo, ssh_key
from helpers import wait_until
from manifests import manifest_text

BROKEN = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {name: broken}
spec:
  model: {path: /nowhere, task: causal-lm}
  sharding: {max_shard_sise: 1GiB}
"""


def source_text(url: str, **spec: str) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in spec.items())
    return (f"apiVersion: deploykit/v1\nkind: GitSource\nmetadata: {{name: models}}\nspec:\n  url: {url}\n"
            f"  ref: {{branch: main}}\n  path: hosts/a\n  interval: 1h\n  timeout: 20s\n{extra}")


@pytest.fixture
def model_text(model) -> str:
    return manifest_text(model)


@pytest.fixture
def followed(tmp_path) -> Iterator[list[Followed]]:
    made: list[Followed] = []
    yield made
    for f in made:
        f.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith(("deploykit-source", "deploykit-watch"))]
    assert not left, f"threads left after close: {left}"


def follow(made: list[Followed], state: Path, text: str) -> Followed:
    made.append(Followed(state, text))
    return made[-1]


def test_a_push_applies_and_a_broken_commit_is_refused_whole(tmp_path, model_text, followed):
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"hosts/a/tiny.yaml": model_text, "hosts/b/other.yaml": BROKEN}, "tiny")
    f = follow(followed, tmp_path / "state", source_text(f"file://{repo}"))
    wait_until(lambda: f.phase() == "Synced" and f.commit_of("tiny") == first, 120, "the first commit serves")
    revision = f.store.current("tiny").revision

    broken = commit_files(repo, {"hosts/a/tiny.yaml": model_text.replace("200KiB", "100KiB"),
                                 "hosts/a/broken.yaml": BROKEN}, "a change and a broken manifest")
    f.sync.sync_now()
    record = wait_until(lambda: f.sync.record() if f.sync.record().error_commit == broken else None, 30,
                        "the broken commit is refused")
    assert "hosts/a/broken.yaml@" in record.last_error and ":6:" in record.last_error
    assert "spec.sharding.max_shard_sise" in record.last_error
    assert f.phase() == "Degraded" and record.applied_commit == first
    assert f.store.current("tiny").revision == revision  # nothing of the commit applied, tiny's change neither
    assert f.commit_of("tiny") == first and f.supervisor.get("tiny").state().serving

    fixed = commit_files(repo, {"hosts/a/broken.yaml": None}, "drop the broken manifest")
    f.sync.sync_now()
    wait_until(lambda: f.phase() == "Synced" and f.commit_of("tiny") == fixed, 120, "the fixed commit serves")
    assert f.store.current("tiny").revision == revision + 1
    status = f.sync.status().to_dict()
    assert status["applied_commit"] == status["fetched_commit"] == fixed
    assert status["deployments"][0]["serving_commit"] == fixed and status["last_error"] is None


@pytest.mark.parametrize("prune", [False, True])
def test_a_deleted_manifest_is_pruned_only_with_prune(tmp_path, model_text, followed, prune, caplog):
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"hosts/a/tiny.yaml": model_text, "hosts/a/keep.txt": "x"}, "tiny")
    f = follow(followed, tmp_path / "state", source_text(f"file://{repo}", prune=str(prune).lower()))
    wait_until(lambda: f.commit_of("tiny") == first and f.phase() == "Synced", 120, "the first commit serves")
    caplog.set_level(logging.WARNING, logger="deploykit")
    commit_files(repo, {"hosts/a/tiny.yaml": None}, "remove tiny")
    f.sync.sync_now()
    if prune:
        wait_until(lambda: f.supervisor.get("tiny") is None and "tiny" not in f.store.names(), 60, "tiny is pruned")
    else:
        wait_until(lambda: "keeps serving" in caplog.text, 60, "the removal is seen and tiny kept")
        assert f.supervisor.get("tiny").state().serving


def test_an_unsigned_commit_is_not_applied(tmp_path, model_text, followed):
    key, public = ssh_key(tmp_path / "keys", "release")
    signers = allowed_signers(tmp_path / "allowed_signers", public)
    repo = new_repo(tmp_path / "upstream")
    signed = commit_files(repo, {"hosts/a/tiny.yaml": model_text}, "signed", signing_key=key)
    f = follow(followed, tmp_path / "state",
               source_text(f"file://{repo}", verify=f"{{mode: head, allowed_signers: {signers}}}"))
    wait_until(lambda: f.commit_of("tiny") == signed and f.phase() == "Synced", 120, "the signed commit serves")
    assert f.sync.record().verified == {"status": True, "commit": signed, "reason": None}

    unsigned = commit_files(repo, {"hosts/a/tiny.yaml": model_text.replace("200KiB", "100KiB")}, "unsigned")
    f.sync.sync_now()
    wait_until(lambda: f.sync.record().error_commit == unsigned, 30, "the unsigned commit is refused")
    assert f.sync.record().verified == {"status": False, "commit": unsigned, "reason": "unsigned"}
    assert f.phase() == "Degraded" and f.commit_of("tiny") == signed


def test_a_restart_serves_the_last_applied_commit_without_fetching(tmp_path, model_text, followed):
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"hosts/a/tiny.yaml": model_text}, "tiny")
    f = follow(followed, tmp_path / "state", source_text(f"file://{repo}"))
    wait_until(lambda: f.commit_of("tiny") == first and f.phase() == "Synced", 120, "the first commit serves")
    followed.remove(f)
    f.close()
    moved = repo.rename(tmp_path / "gone")  # the remote is unreachable now
    again = follow(followed, tmp_path / "state", source_text(f"file://{repo}"))
    wait_until(lambda: again.supervisor.get("tiny") is not None and again.supervisor.get("tiny").state().serving,
               120, "the last applied commit serves again")
    wait_until(lambda: again.sync.record().last_error, 30, "the fetch fails")
    assert again.sync.record().applied_commit == first and again.phase() == "Degraded"
    moved.rename(repo)  # the remote is back: the next retry (backoff) fetches
    wait_until(lambda: again.phase() == "Synced", 30, "the source is synced again")


@pytest.mark.parametrize("self_heal", [False, True])
def test_a_rollback_shows_out_of_sync_and_self_heal_applies_the_commit_again(tmp_path, model_text, followed,
                                                                              self_heal):
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"hosts/a/tiny.yaml": model_text}, "tiny")
    f = follow(followed, tmp_path / "state", source_text(f"file://{repo}", self_heal=str(self_heal).lower()))
    wait_until(lambda: f.commit_of("tiny") == first and f.phase() == "Synced", 120, "the first commit serves")
    second = commit_files(repo, {"hosts/a/tiny.yaml": model_text.replace("200KiB", "100KiB")}, "smaller shards")
    f.sync.sync_now()
    wait_until(lambda: f.commit_of("tiny") == second and f.phase() == "Synced", 120, "the second commit serves")

    target, _ = f.supervisor.rollback("tiny")  # the emergency brake: the first commit's content serves
    assert f.store.current("tiny").git_commit == first == target.git_commit
    if not self_heal:
        wait_until(lambda: f.phase() == "OutOfSync", 30, "the source shows the drift")
        drift = f.sync.status().to_dict()
        assert drift["out_of_sync"] == ["tiny"]
        assert {"field": "spec.sharding.max_shard_size", "serving": 200 << 10, "commit": 100 << 10} in \
            drift["deployments"][0]["differs"]
    else:
        wait_until(lambda: f.commit_of("tiny") == second and f.phase() == "Synced", 60, "self-heal applies the commit")
        assert f.store.current("tiny").manifest_digest != target.manifest_digest

    elsewhere = tmp_path / "elsewhere.yaml"  # an API apply of the name, from a file the source does not own
    elsewhere.write_text(model_text.replace("200KiB", "300KiB"))
    applied = f.supervisor.apply_manifest(load_manifests(elsewhere)[0])
    assert applied.status == "applied"
    if not self_heal:
        wait_until(lambda: f.phase() == "OutOfSync" and {"field": "spec.sharding.max_shard_size", "serving": 300 << 10,
                                                         "commit": 100 << 10}
                   in f.sync.status().to_dict()["deployments"][0]["differs"], 30, "the apply shows as drift")
        return
    wait_until(lambda: (f.store.current("tiny").revision > applied.revision and f.commit_of("tiny") == second
                        and f.phase() == "Synced"), 60, "self-heal applies the commit over the API apply")


def test_a_remote_stopped_then_started_again_is_retried_with_backoff(tmp_path, model_text, followed):
    repo = new_repo(tmp_path / "remote" / "models")
    first = commit_files(repo, {"hosts/a/tiny.yaml": model_text}, "tiny")
    daemon = GitDaemon(tmp_path / "remote").start()
    try:
        f = follow(followed, tmp_path / "state", source_text(daemon.url(repo)))
        wait_until(lambda: f.commit_of("tiny") == first and f.phase() == "Synced", 120, "the first commit serves")
        daemon.stop()
        second = commit_files(repo, {"hosts/a/tiny.yaml": model_text.replace("200KiB", "100KiB")}, "while down")
        f.sync.sync_now()
        record = wait_until(lambda: f.sync.record() if f.sync.record().failures >= 2 else None, 30,
                            "the fetch fails and is retried")
        assert "git fetch failed" in record.last_error and f.phase() == "Degraded"
        assert record.next_fetch - time.time() < 60  # backoff, not the 1h interval
        assert f.supervisor.get("tiny").state().serving and f.commit_of("tiny") == first
        daemon.start()  # no sync asked: the retry finds it
        wait_until(lambda: f.commit_of("tiny") == second and f.phase() == "Synced", 120, "the push serves")
        assert f.sync.record().failures == 0
    finally:
        daemon.stop()
