"""decide: desired vs actual -> only the steps that will run, table by table."""

import pytest

from deploykit.control.revisions.decision import FULL, RELOAD, Actual, Decision, Desired, decide

D = Desired("m", "sha256:manifest-a", "sha256:ckpt-a")
INTACT = Actual(3, "sha256:manifest-a", "sha256:ckpt-a", None)


@pytest.mark.parametrize("desired, actual, force, steps, reason", [
    (D, Actual(None), False, FULL, "no revision is deployed yet"),
    (D, INTACT, True, FULL, "forced"),
    (D, Actual(3, "sha256:manifest-b", "sha256:ckpt-a", None), False, FULL, "the manifest changed"),
    (D, Actual(3, "sha256:manifest-a", "sha256:ckpt-b", None), False, FULL, "the checkpoint changed"),
    (Desired("m", "sha256:manifest-a", "sha256:ckpt-a adapters:one=sha256:1;two=sha256:2b"),
     Actual(3, "sha256:manifest-a", "sha256:ckpt-a adapters:one=sha256:1;two=sha256:2a", None), False, FULL,
     "adapter 'two' changed"),
    (Desired("m", "sha256:manifest-a", "sha256:ckpt-b adapters:one=sha256:1"),
     Actual(3, "sha256:manifest-a", "sha256:ckpt-a adapters:one=sha256:1", None), False, FULL,
     "the checkpoint changed"),
    (D, Actual(3, "sha256:manifest-a", "sha256:ckpt-a", "/s/model-1.safetensors: missing"), False, FULL,
     "the shards of revision 3 are not intact (/s/model-1.safetensors: missing)"),
    (Desired("m", "sha256:manifest-a", "sha256:ckpt-a", load=True), INTACT, False, RELOAD,
     "revision 3 is current; loading it"),
    (Desired("m", "sha256:manifest-a", "sha256:ckpt-a", load=True),
     Actual(3, "sha256:manifest-a", "sha256:ckpt-a", "/s/model-1.safetensors: content differs"), False, FULL,
     "not intact"),
])
def test_decide(desired, actual, force, steps, reason):
    decision = decide(desired, actual, force=force)
    assert decision.steps == steps
    assert all(reason in a.reason for a in decision.actions)
    assert decision.new_revision == ("record" in steps)


def test_nothing_to_do_returns_no_steps():
    assert decide(D, INTACT) == Decision("m", ())
    assert not decide(D, INTACT).new_revision


def test_a_restart_loads_without_a_new_revision():
    decision = decide(Desired("m", "sha256:manifest-a", "sha256:ckpt-a", load=True), INTACT)
    assert decision.steps == ("load", "health-check")
    assert not decision.new_revision
