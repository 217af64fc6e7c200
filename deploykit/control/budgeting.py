"""How a deployment starts and rolls out under the host's budget (``deploykit serve``).

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

from ..names import Load, Strategy
from ..spec.manifest import LoadedManifest
from .budget import BudgetError, plan_tiers
from .reconciler import ApplyOptions, apply, plan_deployment
from .rollout import Rollout, RolloutResult

if TYPE_CHECKING:
    from ..artifacts.reshard import ProgressSink
    from .deployment import Deployment
    from .host import Host

StepSink = Callable[[str], None] | None


def need_of(dep: Deployment, loaded: LoadedManifest) -> dict[str, int]:
    """Bytes per budget tier of ``loaded``'s plan (planned as an apply would: pure, no weights read)."""
    return plan_tiers(plan_deployment(loaded, devices=dep.devices))


def start_budgeted(dep: Deployment, host: Host, loaded: LoadedManifest, *, force: bool = False,
                   progress: ProgressSink | None = None, on_step: StepSink = None) -> None:
    lifecycle = loaded.manifest.spec.lifecycle
    need = need_of(dep, loaded)
    host.register(dep.name, dep.pool, need, priority=lifecycle.priority, keep_alive=lifecycle.keep_alive)
    try:
        _start(dep, host, loaded, need, force=force, progress=progress, on_step=on_step)
    except BaseException:
        host.forget(dep.name)  # it never served: the budget holds nothing for it
        raise


def _start(dep: Deployment, host: Host, loaded: LoadedManifest, need: dict[str, int], *, force: bool,
           progress: ProgressSink | None, on_step: StepSink) -> None:
    if loaded.manifest.spec.lifecycle.load == Load.ON_DEMAND:
        probe = apply(loaded, store=dep.store, options=ApplyOptions(devices=dep.devices, dry_run=True, force=force))
        dep.last_outcome = probe
        if probe.status != "unchanged":
            dep.pending = loaded  # applied (laid out, loaded, checked, recorded) at its first request
            dep.last_outcome = replace(probe, status="deferred")
        dep.pool.mark_unloaded()
        return
    with host.room(dep.name, need, reason="start"):
        dep.load_initial(loaded, force=force, progress=progress, on_step=on_step)


def roll_budgeted(dep: Deployment, host: Host, loaded: LoadedManifest, *, force: bool = False,
                  progress: ProgressSink | None = None, on_step: StepSink = None) -> RolloutResult:
    lifecycle = loaded.manifest.spec.lifecycle
    need = need_of(dep, loaded)
    host.register(dep.name, dep.pool, need, priority=lifecycle.priority, keep_alive=lifecycle.keep_alive)
    probe = apply(loaded, store=dep.store, options=ApplyOptions(devices=dep.devices, dry_run=True, force=force))
    if probe.status == "unchanged":
        dep.pending = None  # back to what is recorded: nothing left to apply
        dep.store.settle(dep.name)  # a no-op confirms what serves: earlier errors are over (as apply does)
        return RolloutResult(False, "none", probe)
    if dep.pool.unloaded:
        dep.pending = loaded  # nothing serves: its next request applies it (no room taken now)
        return RolloutResult(False, "none", replace(probe, status="deferred"))
    rollout = Rollout(dep.pool, dep.store, devices=dep.devices, acquire_timeout=dep.acquire_timeout)
    with host.rolling(dep.name):
        requested = loaded.manifest.spec.rollout.strategy
        if dep.pool.current is not None and requested != Strategy.RECREATE:
            try:
                with host.room(dep.name, need, reason="rollout", beside=True,
                               timeout=0 if requested == Strategy.AUTO else None):
                    return rollout.run(loaded, force=force, progress=progress, on_step=on_step)
            except BudgetError:
                if requested == Strategy.BLUE_GREEN:
                    raise
        with host.room(dep.name, need, reason="rollout"):
            return rollout.run(loaded, strategy=Strategy.RECREATE, force=force, progress=progress, on_step=on_step)
