"""How a deployment starts, serves its last Ready revision after a failed start, and rolls out: the one
path, under its host. Under ``deploykit serve`` the host holds the budget; without one (a library
``Deployment``, a ``Supervisor`` given none) it is ``Host.unlimited()``: every room below is granted at once,
nothing waits and nothing is unloaded for room, and ``lifecycle`` (on-demand, keep-alive) works the same.

- Start: the plan's bytes are known before anything loads; a plan that alone exceeds the budget is
  refused (a ``BudgetError`` naming the budget: the deployment is Failed, the others are untouched).
  ``load: eager`` loads once the host has made room; ``load: on-demand`` is validated and planned now and
  stays unloaded until its first request, which loads it: the current revision from its laid-out shards,
  or, for a new revision, the whole apply (lay out, load, health-check, record) under the budget, so that
  checking it never needs room beside the eager deployments at start.
- Rollout: nothing changed is a no-op that takes no room. A change of an unloaded deployment is
  validated and planned now and applied by its next request (as an on-demand start). A loaded one rolls out blue-green only if the budget has room for both generations,
  unloading idle deployments of its priority or lower if needed: ``blue-green`` waits for that room
  (then fails naming the budget), ``auto`` falls back to ``recreate`` at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ...errors import ManifestError, PlanInfeasible
from ...names import Load, Strategy
from ..budget import BudgetError, plan_tiers
from ..budget.host import Shrink
from ..budget.tiers import fit_prefix_cache
from ..revisions.change import Change
from ..revisions.reconciler import ApplyOptions, ApplyOutcome, apply
from .adapters import live_adapter_diff
from .held import inventory_freed
from .rollout import Rollout, RolloutResult, inventory_beside

if TYPE_CHECKING:
    from ...artifacts.reshard import ProgressSink
    from ..budget.host import Host
    from .canary import AbortSignal, CanaryProgress
    from .on_demand import Loads
    from .pool import Generation

StepSink = Callable[[str], None] | None


def need_of(change: Change, serving: Generation | None = None) -> dict[str, int]:
    """Bytes per budget tier of the change's plan (the plan its apply uses: pure, no weights read); with a
    ``serving`` generation, planned against the host with its bytes given back (``held.inventory_freed``)."""
    return plan_tiers(change.plan(inventory_freed(change.inventory(), serving)))


def shrink_of(change: Change, serving: Generation | None = None) -> Shrink | None:
    """How the change's need shrinks to fit a room (``Host.room``'s ``shrink``): its default prefix cache is
    sized from what the budget leaves it (``tiers.fit_prefix_cache``); None where its cache is not a default
    one (off, or ``max_bytes`` set: counted as the manifest says)."""
    plan = change.plan(inventory_freed(change.inventory(), serving))
    if not plan.prefix_cache_bytes or change.loaded.manifest.spec.serving.prefix_cache.max_bytes is not None:
        return None
    return lambda left: plan_tiers(fit_prefix_cache(plan, left))


def need_beside(change: Change, serving: Generation | None, need: dict[str, int]) -> dict[str, int]:
    """Bytes per tier of the plan a rollout loads beside ``serving``: planned against the inventory less what
    ``serving`` holds (``rollout.inventory_beside``), as ``Rollout.run`` plans it (a simulated inventory's
    beside plan may place blocks elsewhere than the full one). ``need`` when it does not fit beside: the
    rollout then decides what that means (recreate, or a refusal)."""
    try:
        return plan_tiers(change.plan(inventory_beside(change.inventory(), serving)))
    except PlanInfeasible:
        return need


def start_budgeted(loads: Loads, host: Host, change: Change, *, force: bool = False,
                   progress: ProgressSink | None = None, on_step: StepSink = None) -> bool:
    """Start under the budget; True when the last promoted revision was loaded instead of the manifest,
    which the caller then rolls out through its gates (``Loads.promoted_before_gates``)."""
    _refuse_invalid(loads, change)
    lifecycle = change.loaded.manifest.spec.lifecycle
    need, shrink = need_of(change), shrink_of(change)
    host.register(loads.name, loads.pool, need, priority=lifecycle.priority, keep_alive=lifecycle.keep_alive,
                  shrink=shrink)
    try:
        return _start(loads, host, change, need, shrink, force=force, progress=progress, on_step=on_step)
    except BaseException:
        host.forget(loads.name)  # it never served: the budget holds nothing for it
        raise
    finally:
        loads.room_left = None


def _refuse_invalid(loads: Loads, change: Change) -> None:
    """A manifest this host refuses (``change.issues()``) fails as its apply says, before it is sized for the
    host: a located error, or, when its source is gone and the recorded shards are damaged too, the shard
    (``reconciler``'s validate step; planning it first would only say the source is missing)."""
    if not change.issues():
        return
    apply(change.loaded, store=loads.store, change=change, options=ApplyOptions(
        devices=loads.devices, load_if_unchanged=True, dry_run=True))  # raises at its validate step
    raise ManifestError(change.issues())


def serve_last_ready(loads: Loads, host: Host, change: Change) -> None:
    """After a failed start: serve the last Ready revision under the budget, as ``start_budgeted`` would have
    served the manifest (known to the host again; loaded in the room it grants, or at the first request of an
    on-demand deployment)."""
    current = loads.store.current(loads.name)
    assert current is not None and current.plan is not None
    lifecycle = change.loaded.manifest.spec.lifecycle
    need = plan_tiers(current.plan)
    host.register(loads.name, loads.pool, need, priority=lifecycle.priority, keep_alive=lifecycle.keep_alive)
    try:
        if lifecycle.load == Load.ON_DEMAND:
            loads.pool.mark_unloaded()
            return
        with host.room(loads.name, need, reason="start"):
            loads.load_current()
    except BaseException:
        host.forget(loads.name)
        raise


def _start(loads: Loads, host: Host, change: Change, need: dict[str, int], shrink: Shrink | None, *,
           force: bool, progress: ProgressSink | None, on_step: StepSink) -> bool:
    loaded = change.loaded
    if loaded.manifest.spec.lifecycle.load == Load.ON_DEMAND:
        probe = _probe(loads, change, force=force)
        loads.last_outcome = probe
        if probe.status != "unchanged":
            loads.defer(loaded, force=force)  # applied (laid out, loaded, checked, recorded) at its first request
            loads.last_outcome = replace(probe, status="deferred")
        loads.pool.mark_unloaded()
        return False
    promoted = None if force else loads.promoted_before_gates(loaded)
    if promoted is not None and promoted.plan is not None:
        with host.room(loads.name, plan_tiers(promoted.plan), reason="start"):
            loads.load_current()
        return True
    with host.room(loads.name, need, reason="start", shrink=shrink) as grant:
        loads.room_left = grant.left
        loads.load_initial(loaded, force=force, progress=progress, on_step=on_step, change=change)
    return False


def _probe(loads: Loads, change: Change, *, force: bool) -> ApplyOutcome:
    """What the apply of ``change`` would do (a dry run: nothing recorded, nothing loaded), planned against
    the host with what the serving generation holds given back (as a recreate or a live change plans it)."""
    return apply(change.loaded, store=loads.store, change=change, options=ApplyOptions(
        devices=loads.devices, inventory=inventory_freed(change.inventory(), loads.pool.current), dry_run=True,
        force=force))


def roll_budgeted(loads: Loads, host: Host, change: Change, *, force: bool = False,
                  progress: ProgressSink | None = None, on_step: StepSink = None,
                  abort: AbortSignal | None = None,
                  publish: Callable[[CanaryProgress | None], None] | None = None) -> RolloutResult:
    """Roll ``change`` out under the host (see the module docstring). The host knows the change's plan and
    ``lifecycle`` from now on; a change that fails gives the serving revision's back (its priority and
    keep-alive: what serves is not unloaded for a change that never served)."""
    lifecycle = change.loaded.manifest.spec.lifecycle
    need = need_of(change, loads.pool.current)
    before = host.registration(loads.name)
    host.register(loads.name, loads.pool, need, priority=lifecycle.priority, keep_alive=lifecycle.keep_alive,
                  shrink=shrink_of(change, loads.pool.current))
    try:
        return _roll(loads, host, change, need, force=force, progress=progress, on_step=on_step, abort=abort,
                     publish=publish)
    except BaseException:
        if before is not None:
            host.register(loads.name, loads.pool, before.need, priority=before.priority,
                          keep_alive=before.keep_alive, shrink=before.shrink)
        raise


def _roll(loads: Loads, host: Host, change: Change, need: dict[str, int], *, force: bool,
          progress: ProgressSink | None, on_step: StepSink, abort: AbortSignal | None,
          publish: Callable[[CanaryProgress | None], None] | None) -> RolloutResult:
    loaded = change.loaded
    probe = _probe(loads, change, force=force)
    if probe.status == "unchanged":
        loads.defer(None)  # back to what is recorded: nothing left to apply
        loads.store.settle(loads.name)  # a no-op confirms what serves: earlier errors are over (as apply does)
        return RolloutResult(False, "none", probe)
    if loads.pool.unloaded:
        loads.defer(loaded, force=force)  # nothing serves: its next request applies it (no room taken now)
        return RolloutResult(False, "none", replace(probe, status="deferred"))
    rollout = Rollout(loads.pool, loads.store, devices=loads.devices, acquire_timeout=loads.acquire_timeout,
                      abort=abort, publish=publish)
    if not force and live_adapter_diff(loads.store, loads.pool.current, loaded) is not None:
        # spec.adapters alone, on the serving generation: room for its new size, not for a second generation
        with host.rolling(loads.name), host.room(loads.name, need, reason="rollout", resize=True):
            return rollout.run(loaded, progress=progress, on_step=on_step, change=change)
    with host.rolling(loads.name):
        requested = loaded.manifest.spec.rollout.strategy
        if loads.pool.current is not None and requested != Strategy.RECREATE:
            try:
                beside = need_beside(change, loads.pool.current, need)
                with host.room(loads.name, beside, reason="rollout", beside=True,
                               timeout=0 if requested == Strategy.AUTO else None):
                    return rollout.run(loaded, force=force, progress=progress, on_step=on_step, change=change)
            except BudgetError as exc:
                if requested == Strategy.CANARY:  # never a silent recreate: it needs both generations
                    raise BudgetError(f"canary needs the new generation loaded beside the serving one: {exc}") \
                        from None
                if requested == Strategy.BLUE_GREEN:
                    raise
        with host.room(loads.name, need, reason="rollout"):
            return rollout.run(loaded, strategy=Strategy.RECREATE, force=force, progress=progress, on_step=on_step,
                               change=change)
