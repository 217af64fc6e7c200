"""What ``deploykit status`` and ``history`` show, shaped from the state store's records (a live
deployment's own status is ``live.status``).

Kept apart from the store: the store records facts; this module decides what they mean for a reader
(phase, conditions, the error that still matters).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ...errors import DeploykitError
from ...names import Phase
from ...placement.plan import Plan
from .state import Revision, StateStore


def phase_of(*, progressing: bool, last_error: str | None, current: bool) -> Phase:
    """A deployment's one phase (docs/concepts.md), whoever shows it (ops ``/status``, ``deploykit
    status``, the library's ``status()``): Progressing while a change runs; Failed while the latest
    change failed, even when the last good revision still serves; else Ready once something is current."""
    if progressing:
        return Phase.PROGRESSING
    if last_error:
        return Phase.FAILED
    return Phase.READY if current else Phase.PENDING


@dataclass(frozen=True)
class LiveFacts:
    """What the process that holds a deployment knows of it now, which the store can only guess: whether a
    change runs (a canary's steps hold no apply lock, yet run), the error its live state shows, and what the
    change in progress is doing (e.g. "canary step 1 of 2: 50% of new requests")."""

    progressing: bool
    error: str | None
    activity: str | None = None
    serving: bool = False  # it serves, or loads at its next request (an on-demand one with nothing recorded yet)
    conflict: bool = False  # ``error`` is an ownership conflict (a watched file declares an API-owned name)


def _open_failure(store: StateStore, name: str, latest: Revision | None, running: bool) -> str | None:
    """The error a reader still needs to see: a pending (unrecordable) change, or the latest revision's
    failure unless a later no-op apply settled it."""
    row = store.deployment(name) or {}
    if row.get("pending_error"):
        return str(row["pending_error"])
    if latest is None or latest.phase == Phase.READY or running:
        return None
    if row.get("settled_revision") is not None and latest.revision <= row["settled_revision"]:
        return None
    if latest.phase == Phase.PROGRESSING:
        return "interrupted: the applying process died (the next apply finishes the job)"
    return latest.reason or "failed"


def _plan_summary(plan: Plan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    summary: dict[str, Any] = {"digest": plan.digest, "bottleneck_factor": plan.bottleneck_factor,
                               "devices": [{"device": d.device, "blocks": list(d.blocks), "bytes": d.bytes}
                                           for d in plan.devices if d.blocks]}
    if plan.draft is not None:  # spec.speculative's draft model (llama.cpp): only where there is one
        summary["draft"] = {"path": plan.draft.path, "device": plan.draft.device, "bytes": plan.draft.bytes}
    return summary


def status_report(store: StateStore, name: str, held: LiveFacts | None = None) -> dict[str, Any]:
    """Phase (Pending | Progressing | Ready | Failed), conditions with reasons, the serving revision's
    plan summary and the error that still matters: the shape of `deploykit status -o json`. ``held``: the
    live state of the process that holds it, which decides whether a change runs and its error (the store
    alone must guess from the apply lock whether a Progressing revision still runs)."""
    current, latest = store.current(name), store.latest(name)
    if held is None:
        running = latest is not None and latest.phase == Phase.PROGRESSING and store.change_running(name)
        last_error = _open_failure(store, name, latest, running)
    else:
        running = held.progressing
        last_error = held.error if running else held.error or _open_failure(store, name, latest, running)
    serves = held.serving if held is not None else current is not None  # the process that holds it knows
    phase = phase_of(progressing=running, last_error=last_error, current=serves)
    conflict = held is not None and held.conflict and last_error is not None
    failed = (latest.revision if last_error and not conflict and latest is not None and latest.phase != Phase.READY
              else None)
    subject = f"revision {failed}" if failed else "the last change"
    conditions = [
        _ready_condition(current, serves),
        {"type": "Progressing", "status": running,
         "reason": "ApplyRunning" if running else "Idle",
         "message": _progressing_message(latest, running, held)},
        {"type": "Failed", "status": last_error is not None,
         "reason": ("OwnershipConflict" if conflict else f"Revision{failed}Failed" if failed
                    else "ChangeRejected" if last_error else "None"),
         "message": ("" if last_error is None else last_error if conflict else f"{subject} failed: {last_error}"
                     + (f"; revision {current.revision} stays current" if current else ""))},
    ]
    row = store.deployment(name) or {}
    return {
        "name": name,
        "revision": current.revision if current else None,
        "phase": phase.value,
        "conditions": conditions,
        "plan": _plan_summary(current.plan if current else None),
        "shards": current.shards_path if current else None,
        "git_commit": current.git_commit if current else None,
        "last_error": last_error,
        "manifest": row.get("manifest_path"),
    }


def _ready_condition(current: Revision | None, serves: bool) -> dict[str, Any]:
    """Ready as the phase sees it: what the holding process serves, or (no process holds it) the store's
    current revision; an on-demand deployment with nothing recorded yet is ready (it loads when asked)."""
    if current is not None and serves:
        return {"type": "Ready", "status": True, "reason": f"Revision{current.revision}Ready",
                "message": f"revision {current.revision} is deployed"}
    if serves:
        return {"type": "Ready", "status": True, "reason": "LoadsOnDemand",
                "message": "validated and planned; its first request applies and loads it"}
    return {"type": "Ready", "status": False, "reason": "NotServing" if current else "NoReadyRevision",
            "message": (f"revision {current.revision} is recorded but nothing serves it" if current
                        else "nothing deployed yet")}


def _progressing_message(latest: Revision | None, running: bool, held: LiveFacts | None) -> str:
    if not running:
        return ""
    what = f"revision {latest.revision}" if latest is not None else "a change"
    if held is not None and held.activity:
        return f"{what}: {held.activity}"
    return f"{what} is being applied"


def history_rows(store: StateStore, name: str) -> list[dict[str, Any]]:
    """Every revision of ``name`` with its outcome, oldest first."""
    revisions = store.history(name)
    if not revisions:
        raise DeploykitError(f"no deployment named {name!r}")
    current = store.current(name)
    return [{"revision": r.revision, "phase": r.phase,
             "current": current is not None and r.revision == current.revision,
             "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_at)),
             "created_at": r.created_at, "manifest_digest": r.manifest_digest, "plan_digest": r.plan_digest,
             "git_commit": r.git_commit, "reason": r.reason} for r in revisions]
