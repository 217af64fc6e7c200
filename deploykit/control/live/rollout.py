"""How a changed manifest replaces the generation that serves: blue-green, recreate, or auto.

- ``blue-green``: the new generation is planned around the memory the old one still holds, loaded
  and health-checked beside it, then swapped in; callers never wait.
- ``recreate``: new pins wait (up to the deployment's ``acquire_timeout``), in-flight calls drain,
  the old generation is freed, then the new one is loaded. If that fails, the last Ready revision is
  loaded again (health-checked), so something serves.
- ``auto``: blue-green when the plan fits beside the old generation, else recreate.
- ``canary``: loaded and checked beside the old generation like blue-green, then judged by its gates and
  given new requests step by step (``canary.GatedRollout``); it never falls back to recreate. Blue-green
  with ``rollout.gates`` runs the golden gates the same way before its swap.

The strategy is decided before anything is recorded (``choose_strategy``, pure): a fallback from
blue-green to recreate is a decision, never a Failed revision.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from ...artifacts.reshard import ProgressSink
from ...errors import PlanInfeasible
from ...names import Strategy
from ...placement.inventory import Gpu, Inventory
from ...spec.manifest import LoadedManifest
from ..revisions.change import Change
from ..revisions.loading import load_revision, recorded_manifest, serving_of
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from ..revisions.state import StateStore
from .adapters import apply_live, live_adapter_diff
from .held import inventory_freed
from .canary import AbortSignal, CanaryProgress, GatedPlan, GatedRollout, refuse_thin_golden
from .commit import serve_applied
from .pool import Generation, GenerationPool

log = logging.getLogger(__name__)


def choose_strategy(requested: str, *, fits_beside: bool) -> Strategy | None:
    """The strategy a rollout runs: None when blue-green or canary was asked for and does not fit (a canary
    never falls back to recreate: it needs both generations)."""
    if requested == Strategy.RECREATE:
        return Strategy.RECREATE
    if requested == Strategy.CANARY:
        return Strategy.CANARY if fits_beside else None
    if fits_beside:
        return Strategy.BLUE_GREEN
    return Strategy.RECREATE if requested == Strategy.AUTO else None


def inventory_beside(inventory: Inventory, gen: Generation | None) -> Inventory:
    """The inventory minus what the serving generation holds, for planning a blue-green load."""
    if gen is None or gen.plan is None or not inventory.simulated:
        return inventory  # a probed host already reports the old generation's memory as used
    held = {d.device: d.bytes for d in gen.plan.devices}
    gpus = tuple(Gpu(g.index, max(0, g.memory - held.get(g.index, 0)), g.name) for g in inventory.gpus)
    held_cpu = sum(d.bytes for d in gen.plan.devices if d.tier == "cpu")  # "cpu", or tensor-parallel "cpu:R"
    cpu = None if inventory.cpu is None else max(0, inventory.cpu - held_cpu)
    return replace(inventory, gpus=gpus, cpu=cpu)


@dataclass(frozen=True)
class RolloutResult:
    swapped: bool  # a new generation serves
    strategy: str  # "blue-green" | "recreate" | "live" (spec.adapters alone, adapters.py) | "none"
    outcome: ApplyOutcome | None = None  # what the apply did (revision, timings, plan, health)


@dataclass(frozen=True)
class _How:
    """What a rollout passes to its apply: force, where progress goes, and the change it is."""

    force: bool
    progress: ProgressSink | None
    on_step: Callable[[str], None] | None
    change: Change


class Rollout:
    """Rolls a deployment's pool forward to a manifest. One rollout at a time per deployment (the
    caller serialises)."""

    def __init__(self, pool: GenerationPool, store: StateStore, *, devices: str | None,
                 acquire_timeout: float, abort: AbortSignal | None = None,
                 publish: Callable[[CanaryProgress | None], None] | None = None) -> None:
        self.pool = pool
        self.store = store
        self.devices = devices
        self.acquire_timeout = acquire_timeout
        self.abort = abort or AbortSignal()  # set by a rollback during a gated rollout
        self.publish = publish or (lambda progress: None)  # where a gated rollout's progress goes

    def run(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
            on_step: Callable[[str], None] | None = None, strategy: str | None = None,
            change: Change | None = None) -> RolloutResult:
        """``force``, ``progress`` and ``on_step`` are passed to the apply (the control API streams them).
        ``strategy`` overrides the manifest's (the host budget's decision: recreate when two generations
        do not fit in it). ``change``: the change this rollout is (planned once for all its steps)."""
        change = change if change is not None else Change(loaded, self.devices)
        live = None if force else live_adapter_diff(self.store, self.pool.current, loaded)
        if live is not None and self.pool.current is not None:  # spec.adapters alone: no new generation
            return RolloutResult(False, "live", apply_live(self.store, self.pool.current, change, live))
        requested = strategy or loaded.manifest.spec.rollout.strategy
        beside = inventory_beside(change.inventory(), self.pool.current)
        infeasible: PlanInfeasible | None = None
        if requested != Strategy.RECREATE:
            try:
                change.plan(beside)
            except PlanInfeasible as exc:
                infeasible = exc
        chosen = choose_strategy(requested, fits_beside=infeasible is None)
        if chosen is None:
            assert infeasible is not None
            if requested == Strategy.CANARY:
                raise PlanInfeasible(f"canary needs the new generation loaded beside the serving one, and it does "
                                     f"not fit: {infeasible}", shortfall=infeasible.shortfall)
            raise infeasible
        how = _How(force, progress, on_step, change)
        rollout = loaded.manifest.spec.rollout
        if self.pool.current is not None and (chosen == Strategy.CANARY or (
                chosen == Strategy.BLUE_GREEN and rollout.gates is not None)):
            canary = rollout.steps if chosen == Strategy.CANARY else None
            return self._gated(loaded, beside, how, GatedPlan(rollout.gates, canary))
        if chosen in (Strategy.BLUE_GREEN, Strategy.CANARY):  # nothing serves yet: nothing to compare with
            return self._blue_green(loaded, beside, how)
        return self._recreate(loaded, how)

    def _blue_green(self, loaded: LoadedManifest, beside: Inventory, how: _How) -> RolloutResult:
        # armed before the load, as a gated rollout is: a rollback, a newer change or SIGTERM while the
        # candidate is laid out or loads ends it (before its weights load, or before it is swapped in)
        self.abort.arm(loaded.digest)
        try:
            with self.store.rollout_lock(loaded.name):  # Progressing from its apply until it serves
                outcome = apply(loaded, store=self.store, options=ApplyOptions(
                    inventory=beside, keep_model=True, force=how.force, gated=True, interrupted=self.abort.check),
                                progress=how.progress, on_step=how.on_step, change=how.change)
                if outcome.status == "unchanged" or outcome.loaded is None:
                    return RolloutResult(False, "none", outcome)
                serve_applied(self.pool, self.store, loaded, outcome, "blue-green", serving_of(loaded),
                              commit=self.abort.commit)
        finally:
            self.abort.disarm()
        return RolloutResult(True, "blue-green", outcome)

    def _gated(self, loaded: LoadedManifest, beside: Inventory, how: _How, gated: GatedPlan) -> RolloutResult:
        """Load and check beside the serving generation, leave the revision Progressing, and let the gates
        (and a canary's steps) decide (``canary.GatedRollout``)."""
        refuse_thin_golden(loaded, gated.gates, self.pool.current)  # before anything loads or is recorded
        # armed before the load: a rollback or a newer change while the candidate is laid out or loads ends
        # this rollout (before its weights load, or as soon as they have), never the revision before it
        self.abort.arm(loaded.digest)
        try:
            with self.store.rollout_lock(loaded.name):  # its revision stays Progressing without the apply lock
                outcome = apply(loaded, store=self.store, options=ApplyOptions(
                    inventory=beside, keep_model=True, force=how.force, gated=True, interrupted=self.abort.check),
                                progress=how.progress, on_step=how.on_step, change=how.change)
                if outcome.status == "unchanged" or outcome.loaded is None:
                    return RolloutResult(False, "none", outcome)
                model, outcome.loaded = outcome.loaded, None  # the pool owns the model now
                run = GatedRollout(self.pool, self.store, loaded, gated, abort=self.abort, publish=self.publish)
                run.run(model, outcome.plan, outcome.revision or 0, serving_of(loaded))
        finally:
            self.abort.disarm()
        return RolloutResult(True, str(Strategy.CANARY if gated.canary else Strategy.BLUE_GREEN), outcome)

    def _recreate(self, loaded: LoadedManifest, how: _How) -> RolloutResult:
        drained = False

        def before_load() -> None:
            nonlocal drained
            self.pool.drain(self.acquire_timeout)
            drained = True

        freed = inventory_freed(how.change.inventory(), self.pool.current)  # planned as if the old one were gone
        options = ApplyOptions(inventory=freed, keep_model=True, before_load=before_load, force=how.force,
                               gated=True)
        try:
            with self.store.rollout_lock(loaded.name):  # Progressing from its apply until it serves
                outcome = apply(loaded, store=self.store, options=options, progress=how.progress,
                                on_step=how.on_step, change=how.change)
                if outcome.status == "unchanged" or outcome.loaded is None:
                    return RolloutResult(False, "none", outcome)
                serve_applied(self.pool, self.store, loaded, outcome, "recreate", serving_of(loaded))
        except BaseException as exc:  # any failure after the drain (the runtime's build too): serve the last
            if drained:               # Ready revision again; the new one was never recorded Ready
                self._restore_after_failure(exc)
            raise
        return RolloutResult(True, "recreate", outcome)

    def _restore_after_failure(self, cause: BaseException) -> None:
        """``restore``, never masking the rollout's own error: a failed restore is logged, and the pool
        answers every waiting and new request at once with why nothing serves (``pool.mark_broken``)."""
        try:
            self.restore()
        except Exception as exc:
            log.exception("%s: restoring the last Ready revision after a failed recreate failed", self.pool.name)
            self.pool.mark_broken(f"deployment {self.pool.name!r} serves nothing: its recreate failed ({cause}) "
                                  f"and loading its last Ready revision again failed too ({exc}); apply a "
                                  "manifest that loads")

    def restore(self) -> None:
        """After a failed recreate: load the last Ready revision again (verified, health-checked)."""
        current = self.store.current(self.pool.name)
        if current is None or current.plan is None:
            self.pool.mark_broken(f"deployment {self.pool.name!r} serves nothing: its recreate failed and no "
                                  "revision was ever Ready to load again; apply a manifest that loads")
            return
        model = load_revision(current)
        self.pool.install(model, current.plan, current.revision, "restore",
                          serving_of(recorded_manifest(current)))
        log.warning("%s: restored revision %d after a failed recreate", self.pool.name, current.revision)
