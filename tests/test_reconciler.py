"""reconcile_once: desired vs actual -> steps, table by table."""

import pytest

from deploykit.reconciler import STEPS, Actual, Desired, reconcile_once

D = Desired("m", "sha256:manifest-a", "sha256:ckpt-a")


@pytest.mark.parametrize("actual,force,reason", [
    (Actual(None), False, "no revision is deployed yet"),
    (Actual(3, "sha256:manifest-b", "sha256:ckpt-a", True), False, "the manifest changed"),
    (Actual(3, "sha256:manifest-a", "sha256:ckpt-b", True), False, "the checkpoint changed"),
    (Actual(3, "sha256:manifest-a", "sha256:ckpt-a", False), False, "missing or incomplete"),
    (Actual(3, "sha256:manifest-a", "sha256:ckpt-a", True), True, "forced"),
])
def test_steps_and_reason(actual, force, reason):
    actions = reconcile_once(D, actual, force=force)
    assert tuple(a.step for a in actions) == STEPS
    assert all(reason in a.reason for a in actions)


def test_unchanged_is_a_no_op():
    assert reconcile_once(D, Actual(3, "sha256:manifest-a", "sha256:ckpt-a", True)) == ()
