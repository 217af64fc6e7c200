"""A deployment's state as one typed value, and the transitions between its values.

Every change of a live ``Deployment`` is an ``Event`` that ``step(state, event)`` turns into the next
``State`` (pure: tested as a table in tests/test_machine.py); ``StateCell`` holds the value and applies
steps under one lock, so a reader always sees a whole state and no two writers interleave. Its owner
(``Deployment``'s worker for changes; the request that loads it on demand) posts the events.

    Pending --start--> Progressing --ok--> Ready --change--> Progressing --ok--> Ready
                           |                                     |
                           +--failed--> Failed (nothing serves)  +--failed--> Failed (last good serves)
    Ready/Failed --load failed--> Failed; --loaded--> Ready;  any --close--> Closed

The phase is Failed while the latest change (or load on demand) failed, even when the last good
generation still serves (``serving`` says so); an ownership conflict (a watched file declares a name the
API deployed) shows as the error too, until it is resolved. docs/concepts.md draws the same graph.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from enum import Enum

from ...names import Phase
from ..revisions.report import phase_of


class Trigger(str, Enum):
    """What the latest transition answered (as Ray Serve's ``DeploymentStatusTrigger``)."""

    CREATED = "created"
    CHANGE_STARTED = "change-started"
    CHANGE_SUCCEEDED = "change-succeeded"
    CHANGE_FAILED = "change-failed"
    LOAD_SUCCEEDED = "load-succeeded"
    LOAD_FAILED = "load-failed"
    CONFLICT = "conflict"
    CLOSED = "closed"

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Event:
    """One thing that happened to a deployment. ``serving``: whether a generation serves (or can be
    loaded on demand) once it happened; ``error``: why it failed, as the user should read it."""

    trigger: Trigger
    serving: bool = False
    error: str | None = None


@dataclass(frozen=True)
class State:
    phase: Phase = Phase.PENDING
    trigger: Trigger = Trigger.CREATED
    serving: bool = False
    error: str | None = None  # the latest change or load on demand failed (a later success clears it)
    failed_by: Trigger | None = None  # which: a load that works clears its own failure, not a change's
    conflict: str | None = None  # a watched file declares this API-owned name (until resolved)

    @property
    def message(self) -> str | None:
        """The one error a reader must see: the conflict first (only ``delete`` resolves it)."""
        return self.conflict or self.error


def _settled(state: State) -> State:
    """The phase a state at rest has: Failed while an error stands, Ready while something serves (the one
    formula, ``report.phase_of``, that the store's records are read with too)."""
    if state.phase == Phase.CLOSED:
        return state
    return replace(state, phase=phase_of(progressing=False, last_error=state.message, current=state.serving))


def step(state: State, event: Event) -> State:
    """The state after ``event``. Closed is final; a change in progress is Progressing until its end."""
    if state.phase == Phase.CLOSED:
        return state
    t = event.trigger
    if t == Trigger.CLOSED:
        return replace(state, phase=Phase.CLOSED, trigger=t, serving=False)
    if t == Trigger.CHANGE_STARTED:
        return replace(state, phase=Phase.PROGRESSING, trigger=t)
    if t == Trigger.CONFLICT:
        return _settled(replace(state, trigger=t, conflict=event.error)) if state.phase != Phase.PROGRESSING \
            else replace(state, trigger=t, conflict=event.error)
    if t in (Trigger.CHANGE_FAILED, Trigger.LOAD_FAILED):
        return _settled(replace(state, trigger=t, serving=event.serving, error=event.error, failed_by=t))
    keep = t == Trigger.LOAD_SUCCEEDED and state.failed_by == Trigger.CHANGE_FAILED  # the change still pends
    error, failed_by = (state.error, state.failed_by) if keep else (None, None)
    return _settled(replace(state, trigger=t, serving=event.serving, error=error, failed_by=failed_by))


class StateCell:
    """The current ``State`` of one deployment; ``move`` applies an event atomically."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = State()

    def get(self) -> State:
        with self._lock:
            return self._state

    def move(self, event: Event) -> State:
        with self._lock:
            self._state = step(self._state, event)
            return self._state
