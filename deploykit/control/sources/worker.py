"""One git source followed by one thread of its own (``SourceSync``): fetch into the mirror, resolve the
ref, verify the commit, check all its manifests, publish them to the directory the supervisor follows.
It wakes at the source's interval, at once on ``sync_now`` (the control API, a webhook), and after a
failure with a backoff that doubles up to the interval. A failure at any step publishes nothing: the last
applied commit keeps serving, and the record says what failed and for which commit. ``close`` kills a git
command under way (its process group) and joins the thread.

At start nothing is fetched before serving: the supervisor serves the last published commit from disk.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ...errors import DeploykitError
from ...spec.manifest import manifest_files
from ...spec.source import GitSource
from .commit import CommitRefused, admit_commit, publish, published_commit, read_commit
from .gitcmd import Credentials, GitRunner
from .mirror import Mirror, blob_id
from .status import SourceStatus, SyncRecord, deployments_of, phase_of
from .verify import UnverifiedCommit, verify_commit

if TYPE_CHECKING:
    from ..live.supervisor import Supervisor

log = logging.getLogger(__name__)
HEAL_PERIOD = 2.0  # seconds between looks for drift with self_heal
FIRST_RETRY = 1.0  # seconds before the first retry after a failure; doubled on each one after


def source_root(state_directory: Path, name: str) -> Path:
    """Where the source ``name`` keeps its mirror and published manifests."""
    return state_directory / "sources" / name


def live_directory(root: Path) -> Path:
    """Where a source rooted at ``root`` publishes its applied commit's manifests (the supervisor's path)."""
    return root / "manifests"


class SourceSync:
    """Follows ``source`` into ``root`` (``<state>/sources/<name>``) for ``supervisor``."""

    def __init__(self, source: GitSource, *, root: Path, supervisor: Supervisor) -> None:
        spec = source.spec
        self.source = source
        self.root = root
        self.live = live_directory(root)
        self.live.mkdir(parents=True, exist_ok=True)
        self.supervisor = supervisor
        credentials = Credentials(spec.ssh_key_file, spec.known_hosts_file, spec.token_file, spec.ca_file)
        self.git = GitRunner(credentials, root / "scratch", timeout=spec.timeout)
        self.mirror = Mirror(root / "mirror.git", spec.url, self.git)
        self._lock = threading.Lock()
        self._record = SyncRecord(applied_commit=published_commit(self.live))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"deploykit-source-{source.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.source.name

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.git.stop()  # a fetch under way is killed now, not at its timeout
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def sync_now(self) -> None:
        """Fetch and apply now rather than at the next interval (returns at once)."""
        self._wake.set()

    def record(self) -> SyncRecord:
        with self._lock:
            return replace(self._record)

    def status(self) -> SourceStatus:
        record = self.record()
        deployments = deployments_of(self.live, self.supervisor)
        spec = self.source.spec
        return SourceStatus(self.name, spec.url, spec.ref.describe(), spec.path, phase_of(record, deployments),
                            record, deployments)

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._record = replace(self._record, **changes)

    def _loop(self) -> None:
        while not self._stop.is_set():
            deadline = time.time() + self._attempt()
            self._update(next_fetch=deadline)
            self._wait_until(deadline)
            self._wake.clear()

    def _wait_until(self, deadline: float) -> None:
        """Sleep until ``deadline`` or a wake; with ``self_heal``, look for drift every ``HEAL_PERIOD``."""
        heal = self.source.spec.self_heal
        while not self._wake.is_set() and (left := deadline - time.time()) > 0:
            if self._wake.wait(min(left, HEAL_PERIOD) if heal else left) or not heal:
                return
            self._heal()

    def _heal(self) -> None:
        """Apply the published commit again to each deployment that serves something else (a rollback),
        unless it is loading or failed (a failed change is said, not retried in a loop)."""
        for drift in deployments_of(self.live, self.supervisor):
            dep = self.supervisor.get(drift.name)
            if drift.in_sync or drift.progressing or drift.error or dep is None:
                continue
            log.warning("source %s: %s drifted from commit %s (%s); applying the commit again", self.name,
                        drift.name, (self.record().applied_commit or "?")[:12],
                        ", ".join(d["field"] for d in drift.differs) or "another revision")
            dep.request_reload()

    def _attempt(self) -> float:
        """One sync; the seconds until the next."""
        try:
            self.sync_once()
        except Exception as exc:
            if self._stop.is_set():
                return 0.0
            failures = self.record().failures + 1
            commit = getattr(exc, "commit", None)
            self._update(last_error=str(exc), error_commit=commit, failures=failures,
                         errors=self.record().errors + 1)
            if not isinstance(exc, DeploykitError):
                log.exception("source %s: sync failed", self.name)
            else:
                log.warning("source %s: %s; the last applied commit keeps serving", self.name, exc)
            return min(self.source.spec.interval, FIRST_RETRY * 2 ** min(failures - 1, 16))
        self._update(last_error=None, error_commit=None, failures=0, syncs=self.record().syncs + 1)
        return self.source.spec.interval

    def sync_once(self) -> None:
        """Fetch, and apply the ref's commit unless it is applied already. Raises what failed."""
        spec = self.source.spec
        self.mirror.fetch()
        commit = self.mirror.resolve(spec.ref)
        self._update(fetched_commit=commit, last_fetch=time.time())
        if commit == self.record().applied_commit and self._published_whole(commit):
            if spec.self_heal:
                self._heal()
            return
        if spec.verify is not None and spec.ref.commit is None:  # a pinned commit is the operator's choice
            self._refuse_rewind(commit)
            self._verify(commit, spec.verify.allowed_signers)
        manifests = read_commit(self.mirror, commit, spec.path)
        admit_commit(manifests, live=self.live, policy=self.supervisor.policy, devices=self.supervisor.devices)
        removed = publish(manifests, self.live)
        self._update(applied_commit=commit, applied_at=time.time())
        log.info("source %s: applied commit %s (%d manifests%s)", self.name, commit[:12], len(manifests.files),
                 f"; removed {', '.join(removed)}" if removed else "")

    def _published_whole(self, commit: str) -> bool:
        """Whether the published directory holds exactly the commit's manifests: a file edited, added or
        removed there by hand is drift the next sync publishes the commit over."""
        blobs = {PurePosixPath(p).name: i for p, i in self.mirror.blobs(commit, self.source.spec.path).items()}
        live = {f.name: f for f in manifest_files(self.live)}
        if live.keys() != blobs.keys():
            return False
        try:
            return all(blob_id(f.read_bytes(), blobs[n]) == blobs[n] for n, f in live.items())
        except OSError:
            return False

    def _refuse_rewind(self, commit: str) -> None:
        """A signature says who made a commit, not that it is the newest: with ``verify``, a ref moved back to
        an older commit of the applied one's history (a replay of an old signed commit by a force-push)
        is refused; a revert, a new commit, is how git goes back."""
        applied = self.record().applied_commit
        if applied is not None and commit != applied and self.mirror.is_ancestor(commit, applied):
            raise CommitRefused(commit, [f"it is older than the applied commit {applied[:12]} (the ref was moved "
                                         "back in history); revert in git to go back"])

    def _verify(self, commit: str, allowed_signers: Path) -> None:
        try:
            verify_commit(self.git, self.mirror.directory, commit, allowed_signers)
        except UnverifiedCommit as exc:
            self._update(verified={"status": False, "commit": commit, "reason": exc.why})
            raise
        self._update(verified={"status": True, "commit": commit, "reason": None})


class Sources:
    """The sources a server follows, by name (each closed and joined with ``close``)."""

    def __init__(self, syncs: list[SourceSync]) -> None:
        self._by_name = {s.name: s for s in syncs}

    def get(self, name: str) -> SourceSync | None:
        return self._by_name.get(name)

    def all(self) -> list[SourceSync]:
        return list(self._by_name.values())

    def start(self) -> None:
        for sync in self.all():
            sync.start()

    def close(self) -> None:
        for sync in self.all():
            sync.close()

    def statuses(self) -> list[dict[str, Any]]:
        return [s.status().to_dict() for s in self.all()]
