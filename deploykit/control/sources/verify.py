"""Signed commits: a commit is applied only when ``git verify-commit`` finds an SSH signature by a key the
source's allowed_signers file lists. Never applies anything; says why a commit is refused.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import DeploykitError
from .gitcmd import GitError, GitRunner


class UnverifiedCommit(DeploykitError):
    """The commit is unsigned, or signed by a key allowed_signers does not list."""

    def __init__(self, commit: str, why: str) -> None:
        super().__init__(f"commit {commit[:12]} is not verified: {why}")
        self.commit = commit
        self.why = why


def verify_commit(git: GitRunner, mirror: Path, commit: str, allowed_signers: Path) -> None:
    """Raise ``UnverifiedCommit`` unless ``commit`` carries a good signature by an allowed signer."""
    if not allowed_signers.is_file():
        raise UnverifiedCommit(commit, f"the allowed_signers file {allowed_signers} is missing")
    try:
        git.run(["-c", f"gpg.ssh.allowedSignersFile={allowed_signers}", "verify-commit", commit], git_dir=mirror)
    except GitError as exc:
        message = str(exc).removeprefix("git -c failed: ")
        # an unsigned commit: git says nothing (or "no signature found") and fails
        why = "unsigned" if message in ("no message", "") or "no signature found" in message else message
        raise UnverifiedCommit(commit, why) from None
