"""decide: desired vs actual -> only the steps that will run, table by table."""

import threading

import pytest

from deploykit.control.revisions.decision import FULL, RELOAD, Actual, Decision, Desired, decide
from deploykit.control.revisions.state import StateStore
from deploykit.errors import ApplyError

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


class RacedByAnApply(StateStore):
    """A state store in which another thread tries to begin a revision of ``m`` (as an apply does, under
    its apply lock, without waiting for it) just as ``interrupt_restarted`` writes."""

    racing = False
    raced: list[str] = []

    def _write(self):  # type: ignore[no-untyped-def]
        if self.racing:
            self.racing = False
            racer = threading.Thread(target=self._begin_elsewhere)
            racer.start()
            racer.join()
        return super()._write()

    def _begin_elsewhere(self) -> None:
        try:
            with self.deployment_lock("m", wait=False):
                self.begin_revision(name="m", manifest_path="m.yaml", manifest_text="", manifest_digest="d",
                                    checkpoint_fingerprint=None, git_commit=None)
                self.raced.append("began")
        except ApplyError:
            self.raced.append("busy")


def test_interrupt_restarted_holds_the_locks_while_it_looks_and_writes(tmp_path):
    """An apply that begins between its check and its write is not recorded as interrupted: the check and
    the write happen under the apply and rollout locks, so such an apply finds them busy."""
    store = RacedByAnApply(tmp_path)
    first = store.begin_revision(name="m", manifest_path="m.yaml", manifest_text="", manifest_digest="d",
                                 checkpoint_fingerprint=None, git_commit=None)
    store.racing = True
    store.interrupt_restarted("m")
    assert store.get("m", first).phase == "Failed"  # a Progressing revision nobody applies any more
    assert store.raced in (["busy"], [])
    assert [r.phase for r in store.history("m")] == ["Failed"], [(r.revision, r.phase) for r in store.history("m")]
