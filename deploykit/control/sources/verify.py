"""Signed commits: a commit is applied only when ``git verify-commit`` finds an SSH signature by a key the
source's allowed_signers file lists, and that key is valid now (``ssh-keygen -Y find-principals`` at the
current time: git judges an allowed_signers line's valid-before/valid-after at the commit's committer date,
which whoever signs writes, so a retired key could sign a commit dated before it retired). Never applies
anything; says why a commit is refused.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
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
    _signer_valid_now(git, mirror, commit, allowed_signers)


def _signer_valid_now(git: GitRunner, mirror: Path, commit: str, allowed_signers: Path) -> None:
    signature = commit_signature(git.run(["cat-file", "commit", commit], git_dir=mirror))
    if signature is None:
        raise UnverifiedCommit(commit, "unsigned")
    now = time.strftime("%Y%m%d%H%M%SZ", time.gmtime())
    git.scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=git.scratch, prefix="signature-") as sig:
        sig.write(signature)
        sig.flush()
        try:
            found = subprocess.run(["ssh-keygen", "-Y", "find-principals", "-f", str(allowed_signers), "-s",
                                    sig.name, f"-Overify-time={now}"], capture_output=True, timeout=30,
                                   stdin=subprocess.DEVNULL, env={"PATH": git.env()["PATH"], "LC_ALL": "C"})
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise UnverifiedCommit(commit, f"ssh-keygen could not check the signer: {exc}") from None
    if found.returncode != 0:
        raise UnverifiedCommit(commit, "its key is not valid now in allowed_signers (expired, or not yet valid)")


def commit_signature(raw: bytes) -> bytes | None:
    """The signature in a commit object's ``gpgsig`` header (its continuation lines unindented), if any."""
    header = raw.split(b"\n\n", 1)[0].split(b"\n")
    for i, line in enumerate(header):
        if line.startswith((b"gpgsig ", b"gpgsig-sha256 ")):
            rest = [line.split(b" ", 1)[1]]
            for more in header[i + 1:]:
                if not more.startswith(b" "):
                    break
                rest.append(more[1:])
            return b"\n".join(rest) + b"\n"
    return None
