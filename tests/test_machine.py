"""A deployment's states and transitions (``control.machine.step``), as a table."""

from __future__ import annotations

import pytest

from deploykit.control.live.machine import Event, State, StateCell, Trigger, step
from deploykit.names import Phase

T = Trigger
READY = State(Phase.READY, T.CHANGE_SUCCEEDED, serving=True)
BROKEN = State(Phase.FAILED, T.CHANGE_FAILED, serving=True, error="bad yaml", failed_by=T.CHANGE_FAILED)
LOAD_BROKEN = State(Phase.FAILED, T.LOAD_FAILED, serving=True, error="disk gone", failed_by=T.LOAD_FAILED)


@pytest.mark.parametrize("before, event, phase, serving, error", [
    (State(), Event(T.CHANGE_STARTED), Phase.PROGRESSING, False, None),
    (State(Phase.PROGRESSING), Event(T.CHANGE_SUCCEEDED, serving=True), Phase.READY, True, None),
    (State(Phase.PROGRESSING), Event(T.CHANGE_FAILED, error="no fit"), Phase.FAILED, False, "no fit"),
    # the last good generation serves on, and the phase says the newest change failed
    (READY, Event(T.CHANGE_FAILED, serving=True, error="bad yaml"), Phase.FAILED, True, "bad yaml"),
    # a change in progress keeps the error until it ends; its success clears it
    (BROKEN, Event(T.CHANGE_STARTED), Phase.PROGRESSING, True, "bad yaml"),
    (BROKEN, Event(T.CHANGE_SUCCEEDED, serving=True), Phase.READY, True, None),
    # a load that works clears its own failure, never a pending broken change
    (LOAD_BROKEN, Event(T.LOAD_SUCCEEDED, serving=True), Phase.READY, True, None),
    (BROKEN, Event(T.LOAD_SUCCEEDED, serving=True), Phase.FAILED, True, "bad yaml"),
    (READY, Event(T.LOAD_FAILED, serving=True, error="disk gone"), Phase.FAILED, True, "disk gone"),
    # a conflict shows until resolved, over a success
    (READY, Event(T.CONFLICT, error="a.yaml declares it"), Phase.FAILED, True, "a.yaml declares it"),
    (State(Phase.FAILED, T.CONFLICT, True, conflict="x"), Event(T.CONFLICT), Phase.READY, True, None),
    (READY, Event(T.CLOSED), Phase.CLOSED, False, None),
    # closed is final
    (State(Phase.CLOSED, T.CLOSED), Event(T.CHANGE_SUCCEEDED, serving=True), Phase.CLOSED, False, None),
])
def test_step(before, event, phase, serving, error):
    after = step(before, event)
    assert (after.phase, after.serving, after.message) == (phase, serving, error)
    assert after.trigger == (event.trigger if before.phase != Phase.CLOSED else before.trigger)


def test_a_conflict_outlives_a_successful_change():
    conflicted = step(READY, Event(T.CONFLICT, error="a.yaml declares it"))
    after = step(step(conflicted, Event(T.CHANGE_STARTED)), Event(T.CHANGE_SUCCEEDED, serving=True))
    assert after.phase == Phase.FAILED and after.message == "a.yaml declares it"


def test_the_cell_moves_through_events():
    cell = StateCell()
    assert cell.get().phase == Phase.PENDING
    cell.move(Event(T.CHANGE_STARTED))
    assert cell.move(Event(T.CHANGE_SUCCEEDED, serving=True)).phase == Phase.READY
