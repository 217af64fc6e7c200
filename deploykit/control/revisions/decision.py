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
        reason = "the checkpoint changed"
    elif actual.shards_problem is not None:
        reason = (f"the shards of revision {actual.revision} are not intact ({actual.shards_problem}); "
                  "laying them out again from the source")
    elif desired.load:
        reason = f"revision {actual.revision} is current; loading it (health-checked)"
        return Decision(desired.name, tuple(Action(s, reason) for s in RELOAD))
    else:
        return Decision(desired.name, ())
    return Decision(desired.name, tuple(Action(s, reason) for s in FULL))
