"""How a deployment's model comes to serve: its first load (``load_initial``: the whole apply, then
serve), and the loads on demand when a request finds it serving nothing: an unloaded deployment is loaded
once its host has made room (at once without a budget: ``Host.unlimited``) — a new revision of an
on-demand deployment by the whole apply, else the current revision from its laid-out shards
(``load_current``). ``budgeting`` decides which of these a start, a reload or a rollback runs.

``Loads`` holds what these loads need and remember (the pool, the store, the manifest still to apply,
the revision whose shards this process verified); ``Deployment`` composes it, and ``budgeting`` works on
it without knowing ``Deployment``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import DeploykitError
from ...names import Strategy
from ..budget.tiers import fit_prefix_cache
from ..admission import Policy, admit
from ..revisions.change import Change
from ..revisions.loading import checked_current, load_laid_out, recorded_manifest, serving_of
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from .commit import serve_applied

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...artifacts.reshard import ProgressSink
    from ...engine.loader import LoadedModel
    from ...engine.serving import ServingSpec
    from ...placement.plan import Plan
    from ...spec.manifest import LoadedManifest
    from ..budget.host import Host
    from ..revisions.state import Revision, StateStore
    from .pool import GenerationPool

log = logging.getLogger(__name__)


@dataclass
class Loads:
    """The loads of one deployment over its pool and store, under ``host`` (unlimited without a budget)."""

    name: str
    pool: GenerationPool
    store: StateStore
    devices: str | None
    host: Host
    acquire_timeout: float
    policy: Policy = field(default_factory=Policy.unrestricted)  # every manifest loaded is admitted under it
    pending: LoadedManifest | None = None  # an on-demand manifest to apply at its first load
    pending_force: bool = False  # that apply is forced (``force``: laid out again, a new revision), as asked
    pending_failure: tuple[DeploykitError, LoadedManifest] | None = None  # it failed: the last Ready one serves
    last_outcome: ApplyOutcome | None = None
    verified: int | None = field(default=None)  # the revision whose shards this process checked by hash
    room_left: dict[str, int] | None = None  # the room the host's grant left the load in progress, per tier

    def _install(self, model: LoadedModel, plan: Plan | None, revision: int, strategy: str,
                 serving: ServingSpec) -> None:
        """Serve ``model``, its default prefix cache fitted to the room the budget left it (``room_left``)."""
        if plan is not None and self.room_left is not None:
            plan = model.plan = fit_prefix_cache(plan, self.room_left)
        self.pool.install(model, plan, revision, strategy, serving)

    def load_initial(self, loaded: LoadedManifest, *, force: bool = False, progress: ProgressSink | None = None,
                     on_step: Callable[[str], None] | None = None, change: Change | None = None) -> None:
        """Apply ``loaded`` (or load its current revision, verified and health-checked) and serve it."""
        with self.store.rollout_lock(loaded.name):  # a new revision is Progressing until it serves
            outcome = apply(loaded, store=self.store, options=ApplyOptions(
                devices=self.devices, keep_model=True, load_if_unchanged=True, force=force, gated=True),
                progress=progress, on_step=on_step, change=change)
            assert outcome.loaded is not None
            if outcome.plan is not None and self.room_left is not None:  # the prefix cache fitted to the grant
                outcome.plan = outcome.loaded.plan = fit_prefix_cache(outcome.plan, self.room_left)
            serve_applied(self.pool, self.store, loaded, outcome, "initial", serving_of(loaded))
        self.last_outcome = outcome
        if outcome.revision is not None:
            self.verified = outcome.revision

    def promoted_before_gates(self, loaded: LoadedManifest) -> Revision | None:
        """The current revision when a start's manifest rolls out through gates (a canary, or blue-green
        with gates) and differs from it (e.g. a restart in the middle of its canary): that one serves first,
        and the change rolls out from it, rather than being loaded unjudged because nothing served yet."""
        rollout = loaded.manifest.spec.rollout
        gated = rollout.strategy == Strategy.CANARY or (rollout.strategy == Strategy.BLUE_GREEN
                                                        and rollout.gates is not None)
        current = self.store.current(self.name) if gated else None
        if current is None or current.plan is None or current.manifest_digest == loaded.digest:
            return None
        return current

    def load_current(self) -> bool:
        """Load the current revision from its laid-out shards (no reshard) and serve it: shards checked
        (by hash the first time this process loads that revision, by presence and size after), then
        loaded and health-checked. A pending new revision of an on-demand deployment: the whole apply,
        unless it rolls out through gates and a promoted revision exists (a canary written while nothing
        was loaded, or interrupted by a restart): that one loads, and True says the pending change waits to
        be rolled out from it (``take_pending``), gates and all, never loaded unjudged."""
        if self.pending is not None and self.promoted_before_gates(self.pending) is None:
            pending, self.pending = self.pending, None  # applied once: a failure is not repeated per request
            force, self.pending_force = self.pending_force, False
            try:
                admit(pending, self.policy)
                self.load_initial(pending, force=force,
                                  change=Change(pending, self.devices, budget_cpu=self.host.cpu_bytes))
                return False
            except DeploykitError as exc:
                if self.store.current(self.name) is None:  # nothing else could serve: the next request tries
                    self.pending, self.pending_force = pending, force  # it again (its files may be mended)
                    raise
                log.warning("%s: its pending change failed (%s); the last Ready revision loads", self.name, exc)
                self.pending_failure = (exc, pending)
        current = self.store.current(self.name)
        if current is not None:  # checked again: a link may point elsewhere now than when it was applied
            admit(recorded_manifest(current), self.policy)
        current = checked_current(self.store, self.name, verified=self.verified)
        self.verified = current.revision
        model, plan, serving = load_laid_out(current)
        self._install(model, plan, current.revision, "on-demand", serving)
        return self.pending is not None

    def take_pending_failure(self) -> tuple[DeploykitError, LoadedManifest] | None:
        """The pending change that failed at the last load on demand (the last Ready revision loaded instead),
        once: the caller shows it as the deployment's error."""
        failure, self.pending_failure = self.pending_failure, None
        return failure

    def defer(self, loaded: LoadedManifest | None, *, force: bool = False) -> None:
        """``loaded`` is the pending change (None: none is), applied by the next load, forced if ``force``."""
        self.pending, self.pending_force = loaded, force and loaded is not None

    def take_pending(self) -> tuple[LoadedManifest, bool] | None:
        """The pending change and whether it is forced, once: the caller rolls it out."""
        pending, force = self.pending, self.pending_force
        self.defer(None)
        return (pending, force) if pending is not None else None
