"""A gated rollout: the new generation held beside the serving one, judged, and given the traffic by steps.

    stage (loaded, checked, no requests) -> golden gates (both generations score the golden references) ->
    step 1 .. n (a share of new requests; that step's traffic gates at its end) -> promote (the old one
    drains and is freed)

Any failed gate, an abort (``deploykit rollback``) or an error ends it the same way: the candidate is
given up (its running requests finish on it, then it is freed), the serving generation takes every new
request again, and the revision is recorded Failed with the reason (``gate max_nll_increase: +0.84 nats >
0.10``). No request fails because of it: a request runs to its end on the generation it started on.
Blue-green with golden gates is the same without steps. Runs on the deployment's worker; the progress it
publishes is what ``status()`` shows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ...errors import ApplyError
from ...spec.manifest import LoadedManifest, golden_path
from ..revisions.reconciler import finish_gated
from ..revisions.state import StateStore
from .gates import GateResult, first_failure, golden_gates, traffic_gates
from .pool import Generation, GenerationPool

if TYPE_CHECKING:
    from ...engine.loader import LoadedModel
    from ...engine.serving import ServingSpec
    from ...placement.plan import Plan
    from ...spec.schema import Canary, Gates

log = logging.getLogger(__name__)


class GateFailed(ApplyError):
    """A gate ended the rollout; the serving generation keeps every request."""

    def __init__(self, result: GateResult) -> None:
        super().__init__(result.describe())
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

    def to_dict(self) -> dict[str, object]:
        return {"revision": self.revision, "serving_generation": self.serving_generation,
                "new_generation": self.new_generation, "steps": list(self.steps), "step": self.step,
                "share": self.share, "stage": self.stage, "gates": [g.to_dict() for g in self.gates],
                "message": self.message, "requests": dict(self.requests)}


class AbortSignal:
    """Set from any thread (a rollback) to end the running gated rollout at its next check."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = reason
        self._event.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    @property
    def is_set(self) -> bool:
        return self._event.is_set()


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

    def run(self, model: LoadedModel, plan: Plan | None, revision: int, serving: ServingSpec) -> Generation:
        """Stage, judge and promote; on any failure give the candidate up, record the revision Failed, raise."""
        serving_gen = self.pool.current
        if serving_gen is None:
            raise ApplyError("a gated rollout needs a serving generation to compare with")
        gen = self.pool.stage(model, plan, revision, "canary" if self.how.canary else "blue-green", serving)
        steps = tuple(self.how.canary.steps) if self.how.canary else ()
        self._show(CanaryProgress(revision, serving_gen.number, gen.number, steps))
        try:
            self._golden(serving_gen, gen)
            if self.how.canary is not None:
                self._steps(serving_gen, gen, self.how.canary)
        except BaseException as exc:
            self._roll_back(revision, exc)
            raise
        finish_gated(self.loaded, self.store, revision, ready=True, reason=self._passed())
        self.pool.promote()
        self._show(self._now(stage="promoted", share=100))
        return gen

    def _golden(self, serving: Generation, new: Generation) -> None:
        gates = self.how.gates
        path = golden_path(self.loaded)
        if gates is None or path is None:
            return
        from ...engine.scoring import compare, score
        from ...spec.golden import read_golden

        cases = read_golden(path)
        scores = []
        for gen in (serving, new):
            if gen.loaded is None:
                raise ApplyError(f"generation {gen.number} was freed before its golden references were scored")
            scores.append(score(gen.loaded, gen.loaded.tokenizer, cases, forward_lock=gen.forward_lock))
        results = golden_gates(gates, compare(*scores))
        self._show(self._now(gates=tuple(results)))
        self._check(results)

    def _steps(self, serving: Generation, new: Generation, canary: Canary) -> None:
        for number, percent in enumerate(canary.steps, start=1):
            started = time.monotonic()
            self.pool.route(percent)
            self._show(self._now(stage="traffic", step=number, share=percent))
            if self.abort.wait(canary.step_seconds):
                raise Aborted(f"canary aborted at step {number} ({percent}%): {self.abort.reason}")
            if self.how.gates is not None and self.how.gates.traffic:
                results = traffic_gates(self.how.gates, new.traffic.window(started))
                kept = tuple(g for g in self._now().gates if g.gate not in {r.gate for r in results})
                self._show(self._now(gates=kept + tuple(results),
                                     requests=self._requests(serving, new)))
                self._check(results)
            else:
                self._show(self._now(requests=self._requests(serving, new)))

    @staticmethod
    def _requests(serving: Generation, new: Generation) -> dict[str, int]:
        return {str(serving.number): serving.traffic.total, str(new.number): new.traffic.total}

    def _check(self, results: list[GateResult]) -> None:
        failed = first_failure(results)
        if failed is not None:
            raise GateFailed(failed)
        if self.abort.is_set:
            raise Aborted(f"rollout aborted: {self.abort.reason}")

    def _roll_back(self, revision: int, exc: BaseException) -> None:
        self.pool.discard()  # first: no new request goes to it from here
        reason = str(exc) or type(exc).__name__
        log.warning("%s: revision %d rolled back; generation %s keeps serving: %s", self.pool.name, revision,
                    self.pool.current.number if self.pool.current else "none", reason)
        finish_gated(self.loaded, self.store, revision, ready=False, reason=reason)
        self._show(self._now(stage="rolled-back", share=0, message=reason))

    def _passed(self) -> str:
        gates = self._now().gates
        return "; ".join(g.describe() for g in gates) if gates else "promoted"

    def _now(self, **changes: object) -> CanaryProgress:
        assert self.progress is not None
        return replace(self.progress, **changes)  # type: ignore[arg-type]

    def _show(self, progress: CanaryProgress) -> None:
        self.progress = progress
        self.publish(progress)
