"""One commit's manifests, checked as a unit and then published: every manifest under the source's path
is parsed, admitted (``admission.admit``, the one gate) and checked on this host before any file of the
commit reaches the live directory; one invalid manifest refuses the whole commit. Publishing writes each
file atomically into the directory the live layer follows (``live.files.FollowedFiles``), with the
commit recorded beside them (``revisions.reconciler.COMMIT_MARKER``), so each revision names its commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ...errors import DeploykitError, ManifestError
from ...spec.manifest import LoadedManifest, manifest_files, parse_manifests
from ..admission import Policy, admit
from ..revisions.change import Change
from ..revisions.reconciler import COMMIT_MARKER, CommitMarker
from .mirror import Mirror


class CommitRefused(DeploykitError):
    """A commit none of which is applied: every reason, each with its file:line:field."""

    def __init__(self, commit: str, reasons: list[str]) -> None:
        super().__init__(f"commit {commit[:12]} is not applied: " + "; ".join(reasons))
        self.commit = commit
        self.reasons = reasons


@dataclass(frozen=True)
class CommitManifests:
    commit: str
    files: dict[str, bytes]  # the file's name in the live directory -> its content at the commit
    paths: dict[str, str]  # that name -> its path in the repository


def read_commit(mirror: Mirror, commit: str, path: str) -> CommitManifests:
    files, paths = {}, {}
    for repo_path in mirror.files(commit, path):
        name = PurePosixPath(repo_path).name
        files[name] = mirror.read(commit, repo_path)
        paths[name] = repo_path
    return CommitManifests(commit, files, paths)


def admit_commit(manifests: CommitManifests, *, live: Path, policy: Policy, devices: str | None) -> list[str]:
    """The names the commit declares, once every manifest parsed, passed the admission gate and the host
    checks; ``CommitRefused`` naming every problem (file@commit:line:column: field) otherwise."""
    reasons: list[str] = []
    declared: dict[str, str] = {}
    for loaded in _parsed(manifests, live, reasons):
        if loaded.name in declared:
            reasons.append(f"{loaded.source}: {loaded.name!r} is declared by {declared[loaded.name]} too")
        declared[loaded.name] = loaded.source
        try:
            admit(loaded, policy)
        except DeploykitError as exc:
            reasons.append(f"{loaded.source}: {exc}")
            continue
        reasons.extend(str(i) for i in Change(loaded, devices).issues())
    if reasons:
        raise CommitRefused(manifests.commit, reasons)
    return sorted(declared)


def _parsed(manifests: CommitManifests, live: Path, reasons: list[str]) -> list[LoadedManifest]:
    loaded: list[LoadedManifest] = []
    for name, data in manifests.files.items():
        try:
            loaded += parse_manifests(data, source=f"{manifests.paths[name]}@{manifests.commit[:12]}", base_dir=live)
        except ManifestError as exc:
            reasons.extend(str(i) for i in exc.issues)
    return loaded


def publish(manifests: CommitManifests, live: Path) -> list[str]:
    """Make ``live`` hold exactly the commit's manifests, each written atomically; the names of the files
    removed. The marker (``CommitMarker``) maps the old contents and the new ones to their commits while
    the files are written, and names the commit applied only once all are: a publish cut short (a full
    disk, a kill) leaves the old commit named, so the next sync, after a restart too, publishes it again."""
    live.mkdir(parents=True, exist_ok=True)
    old = CommitMarker.read(live) or CommitMarker(None, {})
    new = {digest: manifests.commit for digest in _digests(manifests, live)}
    _write(live / COMMIT_MARKER, CommitMarker(old.applied, {**old.by_digest, **new}).text())
    for name, data in manifests.files.items():
        target = live / name
        if not target.exists() or target.read_bytes() != data:
            _write(target, data)
    removed = [f.name for f in manifest_files(live) if f.name not in manifests.files]
    for name in removed:
        (live / name).unlink(missing_ok=True)
    _write(live / COMMIT_MARKER, CommitMarker(manifests.commit, new).text())
    return removed


def _digests(manifests: CommitManifests, live: Path) -> list[str]:
    """The digest of each manifest of the commit as the live layer will read it from ``live``."""
    return [loaded.digest for name, data in manifests.files.items()
            for loaded in parse_manifests(data, source=str(live / name), base_dir=live)]


def published_commit(live: Path) -> str | None:
    marker = CommitMarker.read(live)
    return marker.applied if marker is not None else None


def _write(target: Path, data: bytes) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
