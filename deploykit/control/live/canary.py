"""A gated rollout: the new generation held beside the serving one, judged, and given the traffic by steps.

    stage (loaded, checked, no requests) -> golden gates (both generations score the golden references) ->
    step 1 .. n (a share of new requests; that step's traffic gates at its end) -> promote (the old one
    drains and is freed)

Any failed gate, an abort (``deploykit rollback``) or an error ends it the same way: the candidate is
given up (its running requests finish on it, then it is freed), the serving generation takes every new
request again, and the revision is recorded Failed with the reason (``gate max_nll_increase: +0.84 nats >
0.10``). No request fails because of it: a request runs to its end on the generation it started on.
Blue-green with golden gates is the same without steps. Runs on the deployment's worker; the progress it
publishes is what ``status()`` shows, and it is recorded with the revision in the state store as it advances
(``_record``), so that a restart in its middle records where it stood (``StateStore.interrupt_restarted``).
The point of no return is the revision recorded Ready: a failure before it rolls back, and once it is
recorded the candidate is promoted whatever fails after (the store's current revision is what serves).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ...errors import ApplyError, ManifestError
from ...spec.manifest import LoadedManifest, golden_path
from ..revisions.layouts import collect_old_shards
from ..revisions.reconciler import finish_gated
from ..revisions.state import StateStore
from .gates import GateResult, first_failure, golden_gates, traffic_gates
from .pool import Generation, GenerationPool
from .traffic import Tally, TrafficWindow

if TYPE_CHECKING:
    from ...engine.loader import LoadedModel
    from ...engine.scoring import CaseScore
    from ...engine.serving import ServingSpec
    from ...placement.plan import Plan
    from ...spec.schema import Canary, Gates

log = logging.getLogger(__name__)
RECORD_EVERY = 1.0  # seconds between two records of a step's gate values in the state store (``_record``)


class GateFailed(ApplyError):
    """A gate ended the rollout; the serving generation keeps every request."""

    def __init__(self, result: GateResult, where: str = "") -> None:
        super().__init__(result.describe() + where)
        self.result = result


class Aborted(ApplyError):
    """The rollout was aborted (``deploykit rollback`` during a canary)."""


@dataclass(frozen=True)
class CanaryProgress:
    """Where a gated rollout stands: ``status()["rollout"]``."""

    revision: int
    serving_generation: int
    new_generation: int
    steps: tuple[int, ...]  # () for blue-green with golden gates
    step: int = 0  # 1..len(steps) while traffic moves; 0 before
    share: int = 0  # percent of new requests the new generation takes now
    stage: str = "golden"  # "golden" | "traffic" | "promoted" | "rolled-back"
    gates: tuple[GateResult, ...] = ()
    message: str | None = None
    requests: dict[str, int] = field(default_factory=dict)  # per generation, since the rollout started
    step_requests: int = 0  # the new generation's finished requests in this step (its evidence)
    min_requests: int = 0  # what a step needs before it may pass

    def to_dict(self) -> dict[str, object]:
        return {"revision": self.revision, "serving_generation": self.serving_generation,
                "new_generation": self.new_generation, "steps": list(self.steps), "step": self.step,
                "share": self.share, "stage": self.stage, "gates": [g.to_dict() for g in self.gates],
                "message": self.message, "requests": dict(self.requests), "step_requests": self.step_requests,
                "min_requests": self.min_requests}


class AbortSignal:
    """How other threads end the gated rollout a deployment's change thread runs, and how that thread waits.

    The rollout ``arm``s it when it starts, before its candidate loads (with the digest of the manifest it
    rolls out: a change of another one ``supersede``s it), and waits on it between checks (``wait``: an
    abort, a finished request (``poke``) or its deadline, whichever comes first; never a sleep). ``abort``
    (a rollback, a new change) ends the armed rollout at its next check; ``close`` (the deployment or the server stopping) also
    ends every rollout armed later. ``commit`` is the rollout's point of no return (promotion): an abort that
    came first ends it instead, and one that comes after returns False, so a caller of ``abort`` that got True
    knows the candidate will not be promoted.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed = False
        self._reason: str | None = None
        self._closed: str | None = None  # the deployment is closing: every rollout from now on aborts
        self._pokes = 0
        self._digest: str | None = None  # the manifest the armed rollout rolls out
        self._file_before: str | None = None  # what the watched file said when a handed-over change began

    def arm(self, digest: str | None = None) -> None:
        with self._cond:
            self._armed, self._reason, self._digest = True, self._closed, digest

    def disarm(self) -> None:
        with self._cond:
            self._armed, self._reason, self._digest = False, None, None

    def file_before(self, digest: str | None) -> None:
        """The watched file's manifest when the next change began (a change handed over by the control API
        while the file says otherwise); None: the change is the file's own."""
        with self._cond:
            self._file_before = digest

    def supersede(self, digest: str, reason: str) -> bool:
        """``abort`` the armed rollout if it rolls out a manifest other than ``digest``, and ``digest`` is
        newer than the rollout: not what the file already said when it began (a watcher that reports that
        change late, after an API apply began, has nothing newer to say)."""
        with self._cond:
            if not self._armed or digest in (self._digest, self._file_before):
                return False
        return self.abort(reason)

    @property
    def armed(self) -> bool:
        with self._cond:
            return self._armed

    def abort(self, reason: str) -> bool:
        """End the armed rollout at its next check; False when none is armed (or it is past its commit)."""
        with self._cond:
            if not self._armed:
                return False
            self._reason = self._reason or reason
            self._cond.notify_all()
            return True

    def close(self, reason: str) -> None:
        """``abort`` now and every rollout armed from now on (the deployment is closing)."""
        with self._cond:
            self._closed = self._closed or reason
        self.abort(reason)

    @property
    def reason(self) -> str | None:
        with self._cond:
            return self._reason

    def check(self) -> None:
        """Raise ``Aborted`` if the armed rollout was aborted (before its candidate loads)."""
        reason = self.reason
        if reason is not None:
            raise Aborted(f"rollout aborted before its candidate loaded: {reason}")

    def commit(self) -> None:
        """The rollout promotes: raise ``Aborted`` if an abort came first, else refuse aborts from now on."""
        with self._cond:
            if self._reason is not None:
                raise Aborted(f"rollout aborted before its promotion: {self._reason}")
            self._armed = False

    def poke(self) -> None:
        """Something to look at (a request ended): wake the rollout's ``wait``."""
        with self._cond:
            self._pokes += 1
            self._cond.notify_all()

    def token(self) -> int:
        """Taken before reading what ``poke`` announces, passed to ``wait``: no poke in between is lost."""
        with self._cond:
            return self._pokes

    def wait(self, seconds: float, token: int | None = None) -> bool:
        """Wait up to ``seconds`` for an abort (True) or a poke after ``token`` (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._reason is not None or (token is not None and self._pokes != token),
                                timeout=max(0.0, seconds))
            return self._reason is not None


def refuse_thin_golden(loaded: LoadedManifest, gates: Gates | None, serving: Generation | None) -> None:
    """Refuse golden gates whose references hold fewer completion tokens (by the serving model's tokenizer:
    what the gates score) than ``gates.min_golden_tokens``, or fewer than two cases (no interval), before
    anything loads: a ``ManifestError`` at ``spec.rollout.gates.golden`` saying how many there are."""
    path = golden_path(loaded)
    tokenizer = serving.loaded.tokenizer if serving is not None and serving.loaded is not None else None
    if gates is None or path is None or tokenizer is None:
        return
    from ...engine.scoring import reference_tokens
    from ...spec.golden import read_golden

    cases = read_golden(path)
    tokens, needed = reference_tokens(tokenizer, cases), gates.golden_tokens_needed
    if tokens >= needed and len(cases) >= 2:
        return
    short = (f"holds {len(cases)} case; a confidence interval needs at least 2" if len(cases) < 2 else
             f"holds {tokens} reference tokens in {len(cases)} cases (by the serving model's tokenizer), fewer "
             f"than the {needed} the golden gates need to decide on (spec.rollout.gates.min_golden_tokens)")
    raise ManifestError([loaded.issue("spec.rollout.gates.golden", f"{path} {short}",
                                      hint="add references (`deploykit golden NAME --prompts FILE` records "
                                           "them), or lower min_golden_tokens")])


@dataclass(frozen=True)
class GatedPlan:
    """What a gated rollout does: the gates (or None), and the canary's steps (None: blue-green)."""

    gates: Gates | None
    canary: Canary | None


class GatedRollout:
    """One gated rollout of ``pool`` to a loaded, checked revision (left Progressing by its apply)."""

    def __init__(self, pool: GenerationPool, store: StateStore, loaded: LoadedManifest, how: GatedPlan, *,
                 abort: AbortSignal, publish: Callable[[CanaryProgress | None], None]) -> None:
        self.pool, self.store, self.loaded, self.how = pool, store, loaded, how
        self.abort, self.publish = abort, publish
        self.progress: CanaryProgress | None = None
        self._recorded: tuple[object, ...] | None = None  # what the store last got (``_record``)
        self._recorded_at = 0.0
        self._whole: tuple[Tally, Tally] | None = None  # (serving, new) since the first step began

    def run(self, model: LoadedModel, plan: Plan | None, revision: int, serving: ServingSpec) -> Generation:
        """Stage, judge and promote; on any failure give the candidate up, record the revision Failed, raise.
        Everything after the candidate exists is inside the ``try``: it is promoted or freed, never left."""
        serving_gen = self.pool.current
        if serving_gen is None:
            raise ApplyError("a gated rollout needs a serving generation to compare with")
        steps = tuple(self.how.canary.steps) if self.how.canary else ()
        try:  # armed by the caller before the candidate loaded (``Rollout._gated``); disarmed by it
            gen = self.pool.stage(model, plan, revision, "canary" if self.how.canary else "blue-green", serving)
            self._show(CanaryProgress(revision, serving_gen.number, gen.number, steps))
            self._check([])  # an abort while the candidate loaded ends it now
            self._golden(serving_gen, gen)
            if self.how.canary is not None:
                self._steps(serving_gen, gen, self.how.canary)
            self.abort.commit()  # from here an abort comes too late: the candidate is promoted
            self.store.finish_revision(self.loaded.name, revision, ready=True, reason=self._passed())
        except BaseException as exc:
            self._roll_back(revision, exc)
            raise
        # Recorded Ready (the store's current revision): it serves from here, whatever fails after
        self.pool.promote()
        self._show(self._now(stage="promoted", share=100))
        self._collect_old_shards()
        return gen

    def _collect_old_shards(self) -> None:
        """Remove the shards no revision needs any more; a failure leaves them (the next promotion tries
        again) and never undoes the promotion."""
        try:
            collect_old_shards(self.loaded, self.store)
        except Exception:
            log.exception("%s: removing old shards after promoting failed; they stay on disk", self.pool.name)

    def _golden(self, serving: Generation, new: Generation) -> None:
        gates = self.how.gates
        path = golden_path(self.loaded)
        if gates is None or path is None:
            return
        from ...engine.scoring import compare, score
        from ...spec.golden import read_golden

        cases = read_golden(path)
        scores: list[list[CaseScore]] = [[], []]
        for case in cases:  # case by case, both generations: an abort is heard between two forwards
            for scored, gen in zip(scores, (serving, new)):
                self._check([])
                if gen.loaded is None:
                    raise ApplyError(f"generation {gen.number} was freed before its golden references were scored")
                scored += score(gen.loaded, gen.loaded.tokenizer, [case], forward_lock=gen.forward_lock)
        results = golden_gates(gates, compare(*scores))
        self._show(self._now(gates=tuple(results)))
        self._check(results)

    def _steps(self, serving: Generation, new: Generation, canary: Canary) -> None:
        new.traffic.watch = serving.traffic.watch = self.abort.poke  # a finished request wakes the step
        whole = self._whole = (serving.traffic.tally(), new.traffic.tally())  # since the first step began
        try:
            for number, percent in enumerate(canary.steps, start=1):
                step = (serving.traffic.tally(), new.traffic.tally())
                try:
                    self._step(step, canary, number, percent)
                finally:
                    for tally in step:
                        tally.close()
        finally:
            new.traffic.watch = serving.traffic.watch = None
            for tally in whole:
                tally.close()

    def _step(self, tallies: tuple[Tally, Tally], canary: Canary, number: int, percent: int) -> None:
        """One step: ``percent`` of new requests to ``new`` until ``step_seconds`` passed and it finished
        ``min_requests`` (the step extends for them up to ``step_limit``, then fails). Its traffic gates are
        checked each time a request ends, once the evidence is in (from running tallies: nothing is scanned);
        an abort ends it at once."""
        serving_step, new_step = tallies
        started = time.monotonic()
        deadline, limit = started + canary.step_seconds, started + canary.step_limit
        self.pool.route(percent)
        self._show(self._now(stage="traffic", step=number, share=percent, min_requests=canary.min_requests,
                             step_requests=0))
        while True:
            token = self.abort.token()
            window = new_step.window()
            enough = window.requests >= canary.min_requests
            results = traffic_gates(self.how.gates, window, self._baseline(serving_step.window(), percent),
                                    min_baseline=canary.min_requests) \
                if enough and self.how.gates is not None else []
            self._show_step(window.requests, results)
            self._check(results, f"at step {number} ({percent}%)")
            now = time.monotonic()
            if enough and now >= deadline:
                return
            if now >= limit:
                raise GateFailed(GateResult("min_requests", float(window.requests), canary.min_requests, False),
                                 f" at step {number} ({percent}%) after {now - started:.0f}s")
            if self.abort.wait((deadline if now < deadline else limit) - now, token):
                self._check([], f"at step {number} ({percent}%)")

    def _baseline(self, step: TrafficWindow, percent: int) -> TrafficWindow:
        """What the relative gates compare with: the serving generation's requests over the step's window;
        in the last step (100%: it takes no new request, only those that started before end in it) those of
        the whole canary so far. With ``steps: [100]`` that is only such stragglers: fewer than the step's
        ``min_requests``, and the relative gates fail with "no baseline"."""
        assert self._whole is not None
        return self._whole[0].window() if percent >= 100 else step

    def _show_step(self, step_requests: int, results: list[GateResult]) -> None:
        kept = tuple(g for g in self._now().gates if g.gate not in {r.gate for r in results})
        self._show(self._now(gates=kept + tuple(results), requests=self._requests(), step_requests=step_requests))

    def _requests(self) -> dict[str, int]:
        """Each generation's finished requests since the first step began."""
        progress = self._now()
        assert self._whole is not None
        serving, new = self._whole
        return {str(progress.serving_generation): serving.window().requests,
                str(progress.new_generation): new.window().requests}

    def _check(self, results: list[GateResult], where: str = "") -> None:
        failed = first_failure(results)
        if failed is not None:
            raise GateFailed(failed)
        reason = self.abort.reason
        if reason is not None:
            what = "canary" if self.how.canary is not None and where else "rollout"
            raise Aborted(f"{what} aborted{' ' + where if where else ''}: {reason}")

    def _roll_back(self, revision: int, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        try:
            self.pool.discard()  # first: no new request goes to it from here (the staged one, if it was staged)
        finally:  # even if freeing it failed: the revision is recorded Failed, the progress says so
            log.warning("%s: revision %d rolled back; generation %s keeps serving: %s", self.pool.name, revision,
                        self.pool.current.number if self.pool.current else "none", reason)
            finish_gated(self.loaded, self.store, revision, ready=False, reason=reason)
            self._show(self._now(stage="rolled-back", share=0, message=reason))

    def _passed(self) -> str:
        gates = self._now().gates
        return "; ".join(g.describe() for g in gates) if gates else "promoted"

    def _now(self, **changes: object) -> CanaryProgress:
        if self.progress is None:  # failed before it was staged: nothing to show but the failure
            return CanaryProgress(0, 0, 0, (), **changes)  # type: ignore[arg-type]
        return replace(self.progress, **changes)  # type: ignore[arg-type]

    def _show(self, progress: CanaryProgress) -> None:
        self.progress = progress
        self.publish(progress)
        self._record(progress)

    def _record(self, progress: CanaryProgress) -> None:
        """Keep the progress in the state store as the rollout advances, so that a restart in its middle
        records where it stood (``StateStore.interrupt_restarted``): every new stage, step and share at once,
        new gate values at most once a second (each is a durable write, and requests end often)."""
        if progress.revision == 0 or progress.stage not in ("golden", "traffic"):
            return  # not staged yet, or ended: its outcome is recorded by ``finish_gated``
        where = (progress.stage, progress.step, progress.share)
        values = tuple((g.gate, g.value, g.passed) for g in progress.gates)
        now = time.monotonic()
        if self._recorded is not None and self._recorded[0] == where and (
                self._recorded[1] == values or now - self._recorded_at < RECORD_EVERY):
            return
        self.store.set_progress(self.pool.name, progress.revision, progress.to_dict())
        self._recorded, self._recorded_at = (where, values), now
