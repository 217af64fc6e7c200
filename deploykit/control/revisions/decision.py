"""The decision of an apply: desired (a manifest) against actual (the current revision) -> the steps to run.

``decide(desired, actual)`` is a plain function over small values and returns only the steps that will
run, so a table of cases tests it. Pure: no I/O, no clock; ``reconciler`` observes and acts.
"""

from __future__ import annotations

from dataclasses import dataclass

FULL = ("plan", "reshard", "load", "health-check", "record")
RELOAD = ("load", "health-check")


@dataclass(frozen=True)
class Desired:
    name: str
    manifest_digest: str
    checkpoint_fingerprint: str
    load: bool = False  # the caller needs the model in memory (a process starting)


@dataclass(frozen=True)
class Actual:
    revision: int | None  # the current (last Ready) revision
    manifest_digest: str | None = None
    checkpoint_fingerprint: str | None = None
    shards_problem: str | None = "no shards recorded"  # None: the recorded shards are intact


@dataclass(frozen=True)
class Action:
    step: str
    reason: str


@dataclass(frozen=True)
class Decision:
    name: str
    actions: tuple[Action, ...]  # only the steps that will run; empty: nothing to do

    @property
    def steps(self) -> tuple[str, ...]:
        return tuple(a.step for a in self.actions)

    @property
    def new_revision(self) -> bool:
        return "record" in self.steps


def decide(desired: Desired, actual: Actual, *, force: bool = False) -> Decision:
    """The steps that bring ``actual`` to ``desired``. Pure: no I/O, no clock."""
    if actual.revision is None:
        reason = "no revision is deployed yet"
    elif force:
        reason = "forced"
    elif actual.manifest_digest != desired.manifest_digest:
        reason = "the manifest changed"
    elif actual.checkpoint_fingerprint != desired.checkpoint_fingerprint:
        reason = source_change(actual.checkpoint_fingerprint, desired.checkpoint_fingerprint)
    elif actual.shards_problem is not None:
        reason = (f"the shards of revision {actual.revision} are not intact ({actual.shards_problem}); "
                  "laying them out again from the source")
    elif desired.load:
        reason = f"revision {actual.revision} is current; loading it (health-checked)"
        return Decision(desired.name, tuple(Action(s, reason) for s in RELOAD))
    else:
        return Decision(desired.name, ())
    return Decision(desired.name, tuple(Action(s, reason) for s in FULL))


ADAPTERS = " adapters:"  # a recorded fingerprint: the checkpoint's, then each adapter's (``layouts.with_adapters``)


def checkpoint_part(fingerprint: str | None) -> str | None:
    """The checkpoint's part of a recorded fingerprint."""
    return fingerprint.split(ADAPTERS)[0] if fingerprint else fingerprint


def adapter_parts(fingerprint: str | None) -> dict[str, str]:
    """Each adapter's fingerprint in a recorded one (``name=fingerprint;...``; empty for a record that holds
    one fingerprint over all of them, as revisions recorded before did)."""
    _, _, tail = (fingerprint or "").partition(ADAPTERS)
    return dict(item.split("=", 1) for item in tail.split(";") if "=" in item)


def source_change(old: str | None, new: str) -> str:
    """Why two recorded fingerprints differ, in words: the checkpoint, or which adapter's files."""
    if checkpoint_part(old) != checkpoint_part(new):
        return "the checkpoint changed"
    before, after = adapter_parts(old), adapter_parts(new)
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    if not changed:
        return "the adapters changed"
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return f"adapter {changed[0]!r} changed{more}"
