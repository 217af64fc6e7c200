"""The git side of a GitSource, on real repositories: the schema's located errors, the mirror fetched over
file:// and `git daemon` (a force-push followed, a deleted branch said, a corrupt mirror cloned again), a
hung remote killed at the timeout with its process group, and SSH-signed commits verified."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from deploykit.control.sources.gitcmd import Credentials, GitError, GitRunner
from deploykit.control.sources.mirror import Mirror, newest_matching
from deploykit.control.sources.status import DeploymentSync, SyncRecord, phase_of
from deploykit.control.sources.verify import UnverifiedCommit, verify_commit
from deploykit.errors import ManifestError
from deploykit.spec.source import GitRef, parse_source
from gitrepos import (GitDaemon, HttpsGit, SilentListener, allowed_signers, commit_files, git, new_repo,
                      self_signed, ssh_key)

SOURCE = """\
apiVersion: deploykit/v1
kind: GitSource
metadata: {name: models}
spec:
  url: file:///srv/models.git
  ref: {branch: main}
  interval: 30s
"""


def runner(tmp_path: Path, timeout: float = 30.0) -> GitRunner:
    return GitRunner(Credentials(), tmp_path / "scratch", timeout=timeout)


def test_source_errors_name_line_and_field():
    bad = SOURCE.replace("{branch: main}", "{branch: main, tag: v1}").replace("30s", "0.1s") + "  ttl: 3\n"
    with pytest.raises(ManifestError) as caught:
        parse_source(bad.encode(), source="models.yaml")
    text = str(caught.value)
    assert "models.yaml:6:8: spec.ref: give exactly one of branch, tag, semver, commit" in text
    assert "models.yaml:7:13: spec.interval: must be between 1s and 86400s" in text
    assert "models.yaml:8:3: spec.ttl: unknown field 'ttl'" in text


@pytest.mark.parametrize("line, message", [
    ("  url: https://user:secret@example.com/r.git\n", "no credentials in the URL"),
    ("  token_file: /run/token\n", "token_file is for https:// repositories"),
    ("  timeout: 2h\n", "must be between 1s and 3600s"),
])
def test_source_refuses(line, message):
    text = SOURCE.replace("  url: file:///srv/models.git\n", "") if "url:" in line else SOURCE
    with pytest.raises(ManifestError, match=message):
        parse_source((text + line).encode(), source="s.yaml")


def test_semver_picks_the_newest_tag_in_range():
    tags = ["v1.0.0", "v1.4.2", "v1.10.0", "v2.0.0", "latest", "v1.5"]
    assert newest_matching(tags, ">=1.0.0 <2.0.0") == "v1.10.0"
    assert newest_matching(tags, ">=1.4, <1.6") == "v1.5"
    assert newest_matching(tags, ">=3") is None


@pytest.fixture
def upstream(tmp_path) -> Path:
    repo = new_repo(tmp_path / "remote" / "models")
    commit_files(repo, {"hosts/a/one.yaml": "one: 1\n"}, "first")
    return repo


@pytest.mark.parametrize("transport", ["file", "daemon"])
def test_mirror_follows_pushes_and_force_pushes(tmp_path, upstream, transport):
    daemon = GitDaemon(tmp_path / "remote").start() if transport == "daemon" else None
    try:
        url = daemon.url(upstream) if daemon else f"file://{upstream}"
        mirror = Mirror(tmp_path / "mirror.git", url, runner(tmp_path))
        mirror.fetch()
        first = mirror.resolve(GitRef(branch="main"))
        assert first == git(upstream, "rev-parse", "HEAD")
        assert mirror.files(first, "hosts/a") == ["hosts/a/one.yaml"]
        assert mirror.read(first, "hosts/a/one.yaml") == b"one: 1\n"
        second = commit_files(upstream, {"hosts/a/two.yml": "two: 2\n"}, "second")
        mirror.fetch()
        assert mirror.resolve(GitRef(branch="main")) == second
        git(upstream, "reset", "-q", "--hard", first)  # a force-push rewrites history
        rewritten = commit_files(upstream, {"hosts/a/three.yaml": "3\n"}, "rewritten")
        mirror.fetch()
        assert mirror.resolve(GitRef(branch="main")) == rewritten
        assert mirror.files(rewritten, "hosts/a") == ["hosts/a/one.yaml", "hosts/a/three.yaml"]
    finally:
        if daemon:
            daemon.stop()


def test_mirror_says_a_deleted_branch_and_an_unreachable_remote(tmp_path, upstream):
    git(upstream, "branch", "-q", "release")
    mirror = Mirror(tmp_path / "mirror.git", f"file://{upstream}", runner(tmp_path))
    mirror.fetch()
    assert mirror.resolve(GitRef(branch="release"))
    git(upstream, "branch", "-q", "-D", "release")
    mirror.fetch()
    with pytest.raises(GitError, match="branch 'release' is not in the repository"):
        mirror.resolve(GitRef(branch="release"))
    gone = Mirror(tmp_path / "mirror.git", f"file://{tmp_path / 'nowhere'}", runner(tmp_path))
    with pytest.raises(GitError, match="git fetch failed"):
        gone.fetch()
    assert mirror.resolve(GitRef(branch="main"))  # the mirror kept what it had


def test_a_corrupt_mirror_is_cloned_again(tmp_path, upstream):
    mirror = Mirror(tmp_path / "mirror.git", f"file://{upstream}", runner(tmp_path))
    mirror.fetch()
    for obj in (mirror.directory / "objects").rglob("*"):
        if obj.is_file() and obj.parent.name not in ("info", "pack"):
            obj.write_bytes(b"garbage")
    for pack in (mirror.directory / "objects" / "pack").glob("*"):
        pack.write_bytes(b"garbage")
    head = commit_files(upstream, {"hosts/a/four.yaml": "4\n"}, "after the corruption")
    mirror.fetch()
    assert mirror.resolve(GitRef(branch="main")) == head
    assert mirror.read(head, "hosts/a/four.yaml") == b"4\n"


def test_a_hung_remote_is_killed_at_the_timeout(tmp_path):
    listener = SilentListener()
    try:
        mirror = Mirror(tmp_path / "mirror.git", f"git://127.0.0.1:{listener.port}/models",
                        runner(tmp_path, timeout=1.5))
        started = time.monotonic()
        with pytest.raises(GitError, match="timed out after 1.5s"):
            mirror.fetch()
        assert time.monotonic() - started < 10
        assert listener.accepted, "git connected to the hung remote"
    finally:
        listener.close()


def test_only_commits_signed_by_an_allowed_key_verify(tmp_path, upstream):
    good, good_pub = ssh_key(tmp_path / "keys", "good")
    other, _ = ssh_key(tmp_path / "keys", "other")
    signers = allowed_signers(tmp_path / "allowed_signers", good_pub)
    mirror = Mirror(tmp_path / "mirror.git", f"file://{upstream}", runner(tmp_path))
    unsigned = git(upstream, "rev-parse", "HEAD")
    signed = commit_files(upstream, {"hosts/a/s.yaml": "s\n"}, "signed", signing_key=good)
    wrong = commit_files(upstream, {"hosts/a/w.yaml": "w\n"}, "wrongly signed", signing_key=other)
    mirror.fetch()
    verify_commit(mirror.git, mirror.directory, signed, signers)
    with pytest.raises(UnverifiedCommit, match="unsigned"):
        verify_commit(mirror.git, mirror.directory, unsigned, signers)
    with pytest.raises(UnverifiedCommit) as caught:
        verify_commit(mirror.git, mirror.directory, wrong, signers)
    assert caught.value.commit == wrong and "unsigned" not in caught.value.why


def test_a_symlinked_manifest_is_refused_not_followed(tmp_path, upstream):
    (upstream / "hosts" / "a" / "link.yaml").symlink_to("/etc/passwd")
    head = commit_files(upstream, {}, "a link")
    mirror = Mirror(tmp_path / "mirror.git", f"file://{upstream}", runner(tmp_path))
    mirror.fetch()
    with pytest.raises(GitError, match="link.yaml at .* is a symbolic link"):
        mirror.files(head, "hosts/a")


def test_validate_checks_a_source_file(tmp_path):
    from click.testing import CliRunner

    from deploykit.cli import main

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(SOURCE)
    bad.write_text(SOURCE.replace("30s", "25h"))
    assert CliRunner().invoke(main, ["validate", str(good)]).exit_code == 0
    result = CliRunner().invoke(main, ["validate", str(bad)])
    assert result.exit_code == 2 and "bad.yaml:7:13: spec.interval: must be between 1s and 86400s" in result.output


def test_an_https_token_is_sent_only_when_the_server_asks(tmp_path, upstream):
    cert, key = self_signed(tmp_path)
    token = "ghp_" + "k9" * 18
    server = HttpsGit(tmp_path / "remote", token, cert, key)
    try:
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        good = GitRunner(Credentials(token_file=token_file, ca_file=cert), tmp_path / "scratch", timeout=30)
        mirror = Mirror(tmp_path / "mirror.git", server.url(upstream), good)
        mirror.fetch()
        assert mirror.resolve(GitRef(branch="main")) == git(upstream, "rev-parse", "HEAD")
        assert server.seen[0] == "" and server.seen[-1].startswith("Basic ")  # asked first, then sent
        written = "".join(f.read_text() for f in good.scratch.rglob("*") if f.is_file())
        assert token not in json.dumps(good.env()) and token not in written
        wrong_file = tmp_path / "wrong"
        wrong_file.write_text("ghp_wrong\n")
        wrong = GitRunner(Credentials(token_file=wrong_file, ca_file=cert), tmp_path / "scratch2", timeout=30)
        with pytest.raises(GitError, match="git fetch failed") as caught:
            Mirror(tmp_path / "other.git", server.url(upstream), wrong).fetch()
        assert "ghp_wrong" not in str(caught.value)
        untrusted = GitRunner(Credentials(token_file=token_file), tmp_path / "scratch3", timeout=30)
        with pytest.raises(GitError, match="certificate"):  # the system's CAs do not know this server
            Mirror(tmp_path / "third.git", server.url(upstream), untrusted).fetch()
    finally:
        server.close()


def _dep(in_sync: bool = True, progressing: bool = False, error: str | None = None) -> DeploymentSync:
    return DeploymentSync("tiny", in_sync, "c0ffee", 1, progressing, error)


@pytest.mark.parametrize("record, deployments, phase", [
    (SyncRecord(), [_dep()], "Progressing"),  # started: not compared with the remote yet
    (SyncRecord(last_fetch=1.0), [], "Synced"),
    (SyncRecord(last_fetch=1.0), [_dep()], "Synced"),
    (SyncRecord(last_error="git fetch failed"), [_dep()], "Degraded"),
    (SyncRecord(last_fetch=1.0, fetched_commit="b", applied_commit="a"), [_dep()], "Progressing"),  # checking b
    (SyncRecord(last_fetch=1.0, fetched_commit="c", applied_commit="a", error_commit="b", last_error="b is broken"),
     [_dep()], "Progressing"),  # b was refused; c, fetched since, is being checked
    (SyncRecord(last_fetch=1.0, fetched_commit="b", applied_commit="a", error_commit="b", last_error="b is broken"),
     [_dep()], "Degraded"),
    (SyncRecord(last_fetch=1.0, applied_at=1000.0), [_dep(in_sync=False)], "Progressing"),  # just published
    (SyncRecord(last_fetch=1.0, applied_at=0.0), [_dep(in_sync=False, progressing=True)], "Progressing"),
    (SyncRecord(last_fetch=1.0, applied_at=0.0), [_dep(in_sync=False, error="plan infeasible")], "Degraded"),
    (SyncRecord(last_fetch=1.0, applied_at=0.0), [_dep(in_sync=False)], "OutOfSync"),  # rolled back by hand
    (SyncRecord(last_fetch=1.0, applied_at=0.0), [_dep(), _dep(in_sync=False)], "OutOfSync"),
])
def test_a_source_phase_is_decided_by_its_record_and_deployments(record, deployments, phase):
    assert phase_of(record, deployments, now=1001.0).value == phase


def test_with_an_api_key_the_webhook_needs_only_its_signature_and_sources_the_control_token():
    from fastapi.testclient import TestClient

    from deploykit.control.sources.worker import Sources
    from deploykit.serve.app import Deployments, create_app

    client = TestClient(create_app(Deployments([]), api_key="k" * 20, control_token="t" * 20, sources=Sources([])))
    assert client.post("/hooks/sources/models", content=b"{}").status_code == 404  # past the key: no such source
    assert client.get("/sources").status_code == 401
    assert client.get("/sources", headers={"Authorization": "Bearer " + "k" * 20}).status_code == 401
    assert client.get("/sources", headers={"Authorization": "Bearer " + "t" * 20}).json() == []
    assert client.post("/control/v1/sources/models/sync",
                       headers={"Authorization": "Bearer " + "t" * 20}).status_code == 404
