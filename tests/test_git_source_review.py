"""A git source under hostile review, on real repositories (made with `git`, commits signed with ssh-keygen
keys): a publish that fails half-way (disk full, a kill) is completed after a restart and never makes a
revision record a commit whose content it does not have; a published file edited by hand is published over;
a force-push back to an older signed commit, or a commit signed by a retired key however it is dated, is not
applied; an empty webhook secret opens nothing; ssh never trusts an unknown host; a password in any URL is
refused; a manifest renamed in git keeps its deployment serving; a file name that is not UTF-8 and a path
written "./a" are handled; a repository's own config and hooks run nothing."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from deploykit.control.live.supervisor import Supervisor
from deploykit.control.revisions.reconciler import git_commit
from deploykit.control.revisions.state import StateStore
from deploykit.control.sources.gitcmd import Credentials, GitRunner
from deploykit.control.sources.worker import SourceSync, live_directory, source_root
from deploykit.spec.manifest import load_manifests
from deploykit.spec.source import parse_source
from gitrepos import allowed_signers, commit_files, git, new_repo, ssh_key
from helpers import wait_until
from manifests import manifest_text


def source_text(url: str, **spec: str) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in spec.items())
    return (f"apiVersion: deploykit/v1\nkind: GitSource\nmetadata: {{name: models}}\nspec:\n  url: {url}\n"
            f"  ref: {{branch: main}}\n  path: hosts/a\n  interval: 1h\n  timeout: 20s\n{extra}")


def idle_sync(state: Path, text: str) -> SourceSync:
    """A source whose thread is not started and whose supervisor follows nothing yet: ``sync_once`` by hand."""
    source = parse_source(text.encode(), source="source.yaml")
    root = source_root(state, source.name)
    live_directory(root).mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(live_directory(root), store=StateStore(state))
    return SourceSync(source, root=root, supervisor=supervisor)


def two_manifests(model: Path, shard: str) -> dict[str, str | None]:
    return {"hosts/a/a.yaml": manifest_text(model, name="one", shard=shard),
            "hosts/a/b.yaml": manifest_text(model, name="two", shard=shard)}


def publish_fails_at_b(tmp_path: Path, model: Path) -> tuple[Path, SourceSync, str, str]:
    """Commit A applied; commit B's publish fails after a.yaml was written, before b.yaml (as a full disk or
    a kill would leave it). The repository, the sync, A and B."""
    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, two_manifests(model, "200KiB"), "two")
    sync = idle_sync(tmp_path / "state", source_text(f"file://{repo}"))
    sync.sync_once()
    assert sync.record().applied_commit == first
    second = commit_files(repo, two_manifests(model, "100KiB"), "smaller shards")
    obstacle = sync.live / ".b.yaml.tmp"
    obstacle.mkdir()  # b.yaml cannot be written
    with pytest.raises(OSError):
        sync.sync_once()
    obstacle.rmdir()
    assert b"100KiB" in (sync.live / "a.yaml").read_bytes() and b"200KiB" in (sync.live / "b.yaml").read_bytes()
    return repo, sync, first, second


def test_a_publish_cut_short_is_completed_after_a_restart(tmp_path, model):
    _, sync, _, second = publish_fails_at_b(tmp_path, model)
    restarted = idle_sync(tmp_path / "state", source_text(sync.source.spec.url))
    restarted.sync_once()  # the server restarted: the commit is fetched and published whole
    assert b"100KiB" in (restarted.live / "b.yaml").read_bytes(), "b.yaml still holds the old commit"
    assert restarted.record().applied_commit == second


def test_a_revision_never_records_a_commit_whose_content_its_file_does_not_hold(tmp_path, model):
    _, sync, first, second = publish_fails_at_b(tmp_path, model)
    a, b = (load_manifests(sync.live / n)[0] for n in ("a.yaml", "b.yaml"))
    assert git_commit(Path(a.source).resolve(), a.digest) == second  # a.yaml holds the second commit's content
    assert git_commit(Path(b.source).resolve(), b.digest) == first  # b.yaml still the first's
    sync.sync_once()  # the retry publishes the rest
    b = load_manifests(sync.live / "b.yaml")[0]
    assert git_commit(Path(b.source).resolve(), b.digest) == second


def test_a_force_push_back_to_an_older_signed_commit_is_not_applied(tmp_path, model):
    key, public = ssh_key(tmp_path / "keys", "release")
    signers = allowed_signers(tmp_path / "allowed_signers", public)
    repo = new_repo(tmp_path / "upstream")
    old = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model)}, "old", signing_key=key)
    new = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model, shard="100KiB")}, "fix", signing_key=key)
    sync = idle_sync(tmp_path / "state", source_text(f"file://{repo}",
                                                     verify=f"{{mode: head, allowed_signers: {signers}}}"))
    sync.sync_once()
    assert sync.record().applied_commit == new
    git(repo, "reset", "-q", "--hard", old)  # someone who may push, not sign, replays an old signed commit
    with pytest.raises(Exception, match="older than the applied commit"):
        sync.sync_once()
    assert sync.record().applied_commit == new and b"100KiB" in (sync.live / "tiny.yaml").read_bytes()
    newer = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model, shard="150KiB")}, "after", signing_key=key)
    sync.sync_once()  # a new commit on the old one (history rewritten forward, and signed): applied
    assert sync.record().applied_commit == newer
    pinned = idle_sync(tmp_path / "state", source_text(f"file://{repo}", verify=f"{{allowed_signers: {signers}}}")
                       .replace("{branch: main}", f"{{commit: {old}}}"))
    pinned.sync_once()  # the operator pins the old commit in the source file: that is no replay
    assert pinned.record().applied_commit == old


@pytest.mark.parametrize("secret", ["", "  \n"])
def test_an_empty_webhook_secret_accepts_no_request(tmp_path, secret):
    from fastapi.testclient import TestClient

    from deploykit.control.sources.worker import Sources
    from deploykit.serve.app import Deployments, create_app

    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    sync = idle_sync(tmp_path / "state", source_text(f"file://{tmp_path}/none",
                                                     webhook=f"{{secret_file: {secret_file}}}"))
    client = TestClient(create_app(Deployments([]), sources=Sources([sync])))
    import hashlib
    import hmac
    signature = "sha256=" + hmac.new(b"", b"{}", hashlib.sha256).hexdigest()  # anyone can make it
    for headers in ({"X-Gitlab-Token": ""}, {"X-Hub-Signature-256": signature}):
        answer = client.post("/hooks/sources/models", content=b"{}", headers=headers)
        assert answer.status_code == 503, answer.text
    assert not sync._wake.is_set()


def test_ssh_without_a_key_file_still_refuses_an_unknown_host_and_never_prompts(tmp_path):
    runner = GitRunner(Credentials(), tmp_path / "scratch", timeout=5)
    command = runner.env().get("GIT_SSH_COMMAND", "")
    assert "StrictHostKeyChecking=yes" in command and "BatchMode=yes" in command


@pytest.mark.parametrize("prune", ["true", "false"])
def test_a_manifest_renamed_in_git_keeps_its_deployment_serving(tmp_path, model, prune):
    from gitrepos import Followed
    from test_git_source import source_text as followed_text

    repo = new_repo(tmp_path / "upstream")
    first = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model)}, "tiny")
    f = Followed(tmp_path / "state", followed_text(f"file://{repo}", prune=prune))
    try:
        wait_until(lambda: f.commit_of("tiny") == first and f.phase() == "Synced", 120, "the first commit serves")
        renamed = commit_files(repo, {"hosts/a/tiny.yaml": None, "hosts/a/chat.yaml": manifest_text(model)},
                               "rename")
        f.sync.sync_now()
        wait_until(lambda: f.sync.record().applied_commit == renamed, 30, "the rename is published")
        changed = commit_files(repo, {"hosts/a/chat.yaml": manifest_text(model, shard="100KiB")}, "a change")
        f.sync.sync_now()
        wait_until(lambda: f.commit_of("tiny") == changed or f.supervisor.get("tiny") is None, 60,
                   "the renamed file's change serves, or tiny is pruned")
        assert f.supervisor.get("tiny") is not None and f.commit_of("tiny") == changed
    finally:
        f.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("deploykit-source")]


def test_a_commit_signed_by_an_expired_key_is_not_verified_however_it_is_dated(tmp_path):
    from deploykit.control.sources.mirror import Mirror
    from deploykit.control.sources.verify import UnverifiedCommit, verify_commit

    key, public = ssh_key(tmp_path / "keys", "retired")
    signers = tmp_path / "allowed_signers"
    signers.write_text(f'ci@example.com valid-before="20200101" {public}\n')  # retired in 2020
    repo = new_repo(tmp_path / "upstream")
    (repo / "a.yaml").write_text("a: 1\n")
    git(repo, "add", "-A")
    dated = subprocess.run(["git", "-C", str(repo), "-c", "user.name=ci", "-c", "user.email=ci@example.com",
                            "-c", "gpg.format=ssh", "-c", f"user.signingkey={key}", "commit", "-S", "-qm", "old"],
                           env={**os.environ, "GIT_COMMITTER_DATE": "2019-06-01T00:00:00Z",
                                "GIT_AUTHOR_DATE": "2019-06-01T00:00:00Z"}, capture_output=True, check=True)
    assert dated.returncode == 0
    commit = git(repo, "rev-parse", "HEAD")
    mirror = Mirror(tmp_path / "mirror.git", f"file://{repo}", GitRunner(Credentials(), tmp_path / "s", timeout=20))
    mirror.fetch()
    with pytest.raises(UnverifiedCommit, match="not valid now"):  # signed with a key retired, dated before
        verify_commit(mirror.git, mirror.directory, commit, signers)


@pytest.mark.parametrize("url", ["ssh://git:hunter2@git.example.com/models.git",
                                 "git://ci:hunter2@git.example.com/models.git"])
def test_a_password_in_any_url_is_refused_not_shown_in_the_status(url):
    from deploykit.errors import ManifestError

    with pytest.raises(ManifestError, match="no credentials in the URL"):
        parse_source(source_text(url).encode(), source="s.yaml")


def test_a_manifest_name_that_is_not_utf8_is_said_by_name(tmp_path):
    from deploykit.control.sources.commit import read_commit
    from deploykit.control.sources.gitcmd import GitError
    from deploykit.control.sources.mirror import Mirror
    from deploykit.spec.source import GitRef

    repo = new_repo(tmp_path / "upstream")
    (repo / "hosts" / "a").mkdir(parents=True)
    for raw in (b"\xff.yaml", b"\xfe.yaml"):  # two names one lossy decoding makes alike
        (repo / "hosts" / "a").joinpath(os.fsdecode(raw)).write_text("a: 1\n")
    commit_files(repo, {"hosts/a/ok.yaml": "b: 2\n"}, "odd names")
    mirror = Mirror(tmp_path / "mirror.git", f"file://{repo}", GitRunner(Credentials(), tmp_path / "s", timeout=20))
    mirror.fetch()
    with pytest.raises(GitError, match=r"hosts/a/\\xfe.yaml at [0-9a-f]{12}: a file name that is not UTF-8"):
        read_commit(mirror, mirror.resolve(GitRef(branch="main")), "hosts/a")


def test_a_published_manifest_edited_by_hand_is_published_again_and_never_credited_to_the_commit(tmp_path, model):
    repo = new_repo(tmp_path / "upstream")
    commit = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model)}, "tiny")
    sync = idle_sync(tmp_path / "state", source_text(f"file://{repo}"))
    sync.sync_once()
    published = (sync.live / "tiny.yaml").read_bytes()
    (sync.live / "tiny.yaml").write_text(manifest_text(model, shard="100KiB"))  # not in git
    (sync.live / "extra.yaml").write_text(manifest_text(model, name="extra"))
    edited = load_manifests(sync.live / "tiny.yaml")[0]
    assert git_commit(Path(edited.source).resolve(), edited.digest) is None  # no commit holds this content
    sync.sync_once()  # the same commit: what git says is published again
    assert (sync.live / "tiny.yaml").read_bytes() == published and not (sync.live / "extra.yaml").exists()
    assert sync.record().applied_commit == commit


@pytest.mark.parametrize("path", ["./hosts/a", "hosts//a/", "hosts/./a/."])
def test_a_path_written_with_dot_or_double_slashes_names_the_same_directory(tmp_path, model, path):
    repo = new_repo(tmp_path / "upstream")
    commit = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model)}, "tiny")
    sync = idle_sync(tmp_path / "state", source_text(f"file://{repo}").replace("path: hosts/a", f"path: '{path}'"))
    assert sync.source.spec.path == "hosts/a"
    sync.sync_once()
    assert sync.record().applied_commit == commit and (sync.live / "tiny.yaml").exists()


def test_a_repository_configured_to_run_commands_runs_none_when_fetched(tmp_path, model):
    repo = new_repo(tmp_path / "upstream")
    commit = commit_files(repo, {"hosts/a/tiny.yaml": manifest_text(model)}, "tiny")
    ran = tmp_path / "ran"
    command = f"touch {ran}; false"
    for key in ("core.fsmonitor", "uploadpack.packObjectsHook", "core.sshCommand", "core.hooksPath"):
        git(repo, "config", key, command)
    for hook in ("post-checkout", "pre-upload-pack", "reference-transaction"):
        script = repo / ".git" / "hooks" / hook
        script.write_text(f"#!/bin/sh\n{command}\n")
        script.chmod(0o755)
    sync = idle_sync(tmp_path / "state", source_text(f"file://{repo}"))
    sync.sync_once()
    assert sync.record().applied_commit == commit
    assert not ran.exists(), "fetching the repository ran a command its config names"


def test_a_key_allowed_only_for_another_namespace_does_not_verify_a_commit(tmp_path):
    from deploykit.control.sources.mirror import Mirror
    from deploykit.control.sources.verify import UnverifiedCommit, verify_commit

    key, public = ssh_key(tmp_path / "keys", "files-only")
    signers = tmp_path / "allowed_signers"
    signers.write_text(f'ci@example.com namespaces="file" {public}\n')  # may sign files, not commits
    repo = new_repo(tmp_path / "upstream")
    commit = commit_files(repo, {"a.yaml": "a: 1\n"}, "signed", signing_key=key)
    mirror = Mirror(tmp_path / "mirror.git", f"file://{repo}", GitRunner(Credentials(), tmp_path / "s", timeout=20))
    mirror.fetch()
    with pytest.raises(UnverifiedCommit):
        verify_commit(mirror.git, mirror.directory, commit, signers)
