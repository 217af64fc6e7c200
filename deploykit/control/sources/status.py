"""What a source is doing, as every view shows it (``/status``, ``deploykit sources``, metrics): the sync
thread's record (``SyncRecord``, written only by that thread) joined with what the deployments of the
applied commit serve. Reads only; decides nothing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import DeploykitError
from ...spec.manifest import load_manifests, manifest_files
from ..revisions.differ import field_changes

if TYPE_CHECKING:
    from ..live.supervisor import Supervisor

SETTLE = 3.0  # seconds after a publish the watcher may take to start the reloads (debounce and more)


class SourcePhase(str, Enum):
    SYNCED = "Synced"  # every deployment of the applied commit serves it
    PROGRESSING = "Progressing"  # a commit was applied; its deployments are loading
    OUT_OF_SYNC = "OutOfSync"  # a deployment serves something else than the applied commit says
    DEGRADED = "Degraded"  # the last fetch or commit failed, or a deployment of the commit failed to load


@dataclass
class SyncRecord:
    """The sync thread's last results (replaced whole under its lock; readers copy it)."""

    fetched_commit: str | None = None
    applied_commit: str | None = None
    applied_at: float | None = None
    last_fetch: float | None = None
    next_fetch: float | None = None
    last_error: str | None = None
    error_commit: str | None = None  # the commit the error is about, when it is about one
    verified: dict[str, Any] | None = None  # {"status": bool, "commit", "reason"} when verification is on
    failures: int = 0  # in a row
    syncs: int = 0
    errors: int = 0


@dataclass(frozen=True)
class DeploymentSync:
    name: str
    in_sync: bool
    serving_commit: str | None
    serving_revision: int | None
    progressing: bool
    error: str | None
    differs: list[dict[str, Any]] = field(default_factory=list)  # {"field", "serving", "commit"} when not in sync


@dataclass
class SourceStatus:
    name: str
    url: str
    ref: str
    path: str
    phase: SourcePhase
    record: SyncRecord
    deployments: list[DeploymentSync] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "url": self.url, "ref": self.ref, "path": self.path, "phase": self.phase.value,
               **asdict(self.record), "deployments": [asdict(d) for d in self.deployments]}
        out["out_of_sync"] = [d.name for d in self.deployments if not d.in_sync]
        verified = self.record.verified
        out["conditions"] = [] if verified is None else [{
            "type": "SourceVerified", "status": verified["status"], "commit": verified["commit"],
            "message": verified["reason"] or "signed by an allowed key"}]
        return out


def deployments_of(live: Path, supervisor: Supervisor) -> list[DeploymentSync]:
    """Each deployment the published manifests declare, against what serves it."""
    out = []
    for file in manifest_files(live):
        try:
            manifests = load_manifests(file)
        except DeploykitError:
            continue  # a file written meanwhile: the next look reads it whole
        for loaded in manifests:
            out.append(_one(loaded.name, loaded.digest, loaded.text, supervisor))
    return out


def _one(name: str, digest: str, text: str, supervisor: Supervisor) -> DeploymentSync:
    current = supervisor.store.current(name)
    dep = supervisor.get(name)
    live = dep.state() if dep is not None else None
    progressing = name in supervisor.loading_names() or (live is not None and live.phase.value == "Progressing")
    in_sync = current is not None and current.manifest_digest == digest
    differs = [] if in_sync or current is None else [
        {"field": f, "serving": old, "commit": new} for f, old, new in field_changes(current.manifest_text, text)]
    return DeploymentSync(name, in_sync, current.git_commit if current else None, live.revision if live else None,
                          progressing, live.last_error if live else supervisor.why_not_served(name), differs)


def phase_of(record: SyncRecord, deployments: list[DeploymentSync], now: float | None = None) -> SourcePhase:
    if record.last_error is not None and record.fetched_commit in (None, record.applied_commit,
                                                                   record.error_commit):
        return SourcePhase.DEGRADED
    if record.last_fetch is None or record.fetched_commit not in (record.applied_commit, record.error_commit):
        return SourcePhase.PROGRESSING  # not compared with the remote yet (a start), or a fetched commit is
        #                                 being checked and applied: neither Synced to it nor refused
    if all(d.in_sync and not d.progressing for d in deployments):
        return SourcePhase.SYNCED
    settling = record.applied_at is not None and (now or time.time()) - record.applied_at < SETTLE
    if settling or any(d.progressing for d in deployments):
        return SourcePhase.PROGRESSING
    if any(d.error for d in deployments if not d.in_sync):
        return SourcePhase.DEGRADED
    return SourcePhase.OUT_OF_SYNC
