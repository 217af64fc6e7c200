"""A source's bare mirror under the state directory: fetched with ``git fetch --prune`` (a force-push and a
deleted ref are followed), re-made from nothing when it is corrupt, and read by commit (``git ls-tree``,
``git cat-file``) without a work tree anyone edits.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ...spec.source import GitRef, semver_terms
from .gitcmd import GitError, GitRunner

log = logging.getLogger(__name__)
REFSPECS = ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]
MAX_MANIFEST_BYTES = 1 << 20
MAX_FILES = 500


class Mirror:
    """The bare repository at ``directory`` that mirrors ``url``."""

    def __init__(self, directory: Path, url: str, runner: GitRunner) -> None:
        self.directory = directory
        self.url = url
        self.git = runner

    def _git(self, *args: str) -> bytes:
        return self.git.run(list(args), git_dir=self.directory)

    def fetch(self) -> None:
        """Bring the mirror up to the remote's branches and tags; a corrupt mirror is made again once."""
        if not (self.directory / "HEAD").exists():
            self._init()
        try:
            self._fetch()
        except GitError:
            if self._healthy():
                raise  # the remote's fault (unreachable, timed out): the mirror stays
            log.warning("the mirror %s is corrupt; cloning again", self.directory)
            self._init()
            self._fetch()

    def _init(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self.git.run(["init", "--quiet", "--bare", str(self.directory)])

    def _fetch(self) -> None:
        self._git("fetch", "--quiet", "--prune", "--no-write-fetch-head", "--", self.url, *REFSPECS)

    def _healthy(self) -> bool:
        try:
            self._git("fsck", "--connectivity-only", "--no-dangling", "--no-progress")
            return True
        except GitError:
            return False

    def resolve(self, ref: GitRef) -> str:
        """The commit ``ref`` names in the mirror now; GitError when it names none."""
        if ref.commit is not None:
            return self._commit(ref.commit, f"commit {ref.commit}")
        if ref.branch is not None:
            return self._commit(f"refs/heads/{ref.branch}", f"branch {ref.branch!r}")
        if ref.tag is not None:
            return self._commit(f"refs/tags/{ref.tag}", f"tag {ref.tag!r}")
        assert ref.semver is not None
        tag = newest_matching(self.tags(), ref.semver)
        if tag is None:
            raise GitError(f"no tag matches semver {ref.semver!r}")
        return self._commit(f"refs/tags/{tag}", f"tag {tag!r}")

    def _commit(self, name: str, what: str) -> str:
        try:
            return self._git("rev-parse", "--verify", "--quiet", f"{name}^{{commit}}").decode().strip()
        except GitError:
            raise GitError(f"{what} is not in the repository (deleted, or never pushed)") from None

    def is_ancestor(self, older: str, newer: str) -> bool:
        """Whether ``older`` is in the history of ``newer`` (False too when either is not in the mirror)."""
        try:
            self._git("merge-base", "--is-ancestor", older, newer)
            return True
        except GitError:
            return False

    def tags(self) -> list[str]:
        out = self._git("for-each-ref", "--format=%(refname:strip=2)", "refs/tags")
        return out.decode("utf-8", "replace").split()

    def files(self, commit: str, path: str) -> list[str]:
        """The manifest files (``*.yaml``, ``*.yml``) directly under ``path`` at ``commit``."""
        return sorted(self.blobs(commit, path))

    def blobs(self, commit: str, path: str) -> dict[str, str]:
        """``files``, each with its blob id (what ``blob_id`` of its content is)."""
        tree = commit if path == "." else f"{commit}:{path}"
        try:
            out = self._git("ls-tree", "-z", tree)
        except GitError:
            raise GitError(f"path {path!r} is not in commit {commit[:12]}") from None
        entries = [_entry(e, path, commit) for e in out.split(b"\0") if b"\t" in e]
        found = [name for head, name in entries if head.split()[1] == "blob" and name.endswith((".yaml", ".yml"))]
        ids = {name: head.split()[2] for head, name in entries}
        links = [name for head, name in entries if head.split()[0] == "120000" and name in found]
        if links:  # its content would be a path, not a manifest: said, never followed
            raise GitError(f"{path}/{links[0]} at {commit[:12]} is a symbolic link; a manifest is a regular file")
        if len(found) > MAX_FILES:
            raise GitError(f"more than {MAX_FILES} manifests under {path!r}")
        return {(name if path == "." else f"{path}/{name}"): ids[name] for name in found}

    def read(self, commit: str, name: str) -> bytes:
        size = int(self._git("cat-file", "-s", f"{commit}:{name}").decode().strip())
        if size > MAX_MANIFEST_BYTES:
            raise GitError(f"{name} at {commit[:12]} is {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
        return self._git("cat-file", "blob", f"{commit}:{name}")


def blob_id(data: bytes, like: str) -> str:
    """git's id of a blob holding ``data``, in the object format of the id ``like`` (SHA-1 or SHA-256)."""
    import hashlib

    return hashlib.new("sha1" if len(like) == 40 else "sha256", b"blob %d\0" % len(data) + data).hexdigest()


def _entry(raw: bytes, path: str, commit: str) -> list[str]:
    """An ``ls-tree -z`` entry as [mode type id, name]; a name that is no UTF-8 is said, not mangled (two
    such names would read as one, and neither could be read back by its mangled name)."""
    head, name = raw.split(b"\t", 1)
    try:
        return [head.decode("ascii"), name.decode("utf-8")]
    except UnicodeDecodeError:
        raise GitError(f"{path}/{name.decode('utf-8', 'backslashreplace')} at {commit[:12]}: a file name "
                       "that is not UTF-8; rename it") from None


def newest_matching(tags: list[str], semver: str) -> str | None:
    """The tag with the highest version inside the range (tags that are no plain version are skipped)."""
    terms = semver_terms(semver)
    best: tuple[tuple[int, int, int], str] | None = None
    for tag in tags:
        try:
            [(_, version)] = semver_terms(tag.lstrip("="))
        except ValueError:
            continue
        if tag[:1] in "<>=" or not all(_holds(op, version, bound) for op, bound in terms):
            continue
        if best is None or version > best[0]:
            best = (version, tag)
    return best[1] if best else None


def _holds(op: str, version: tuple[int, int, int], bound: tuple[int, int, int]) -> bool:
    return {">=": version >= bound, ">": version > bound, "<=": version <= bound, "<": version < bound,
            "=": version == bound}[op]
