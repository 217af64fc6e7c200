"""One change of a deployment, checked once and planned once, whoever asks.

A change through the server passes through several steps that each need the manifest checked against
this host and planned: the budget sizes it, the apply's probe decides whether anything changed, the
rollout checks that it fits beside the serving generation, and the apply records the plan. ``Change``
carries the manifest through all of them and remembers what it found: the host checks run once, the
inventory is probed once, and each inventory is planned once (a simulated inventory seen "beside" the
serving generation is another inventory, so it is planned again; a probed host is not).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ...placement.inventory import Inventory

if TYPE_CHECKING:
    from ...errors import Issue
    from ...placement.plan import Plan
    from ...spec.manifest import LoadedManifest


@dataclass
class Change:
    """``loaded`` as one change, planned against ``devices`` (None: this host, or its Ray cluster)."""

    loaded: LoadedManifest
    devices: str | None = None
    budget_cpu: int | None = None  # the host budget's CPU tier (``Inventory.budget_cpu``), if any
    plans_made: int = 0  # how many times this change was planned (tests and status read it)
    _issues: list[Issue] | None = field(default=None, repr=False)
    _inventory: Inventory | None = field(default=None, repr=False)
    _plans: dict[Inventory, Plan] = field(default_factory=dict, repr=False)

    def issues(self) -> list[Issue]:
        """What this host finds wrong with the manifest (``spec.manifest.check_on_host``), once."""
        if self._issues is None:
            self._issues = host_issues(self.loaded)
        return self._issues

    def inventory(self) -> Inventory:
        """What the change is planned against, probed once (``deployment_inventory``)."""
        if self._inventory is None:
            probed = deployment_inventory(self.loaded, self.devices)
            self._inventory = replace(probed, budget_cpu=self.budget_cpu) if self.budget_cpu else probed
        return self._inventory

    def plan(self, inventory: Inventory | None = None) -> Plan:
        """The plan against ``inventory`` (default: ``inventory()``), made once per inventory. Raises
        ``PlanInfeasible`` each time it is asked when it does not fit."""
        from ...placement.planning import plan_manifest

        inv = inventory if inventory is not None else self.inventory()
        if inv not in self._plans:
            self.plans_made += 1
            self._plans[inv] = plan_manifest(self.loaded, inventory=inv)
        return self._plans[inv]


def host_issues(loaded: LoadedManifest) -> list[Issue]:
    """``spec.manifest.check_on_host``, and for llama.cpp whether a llama-server that runs is found (its
    ``--version`` answered, with a timeout) and a draft model of ``spec.speculative`` can draft for the model:
    a missing or broken binary, a draft with another vocabulary, is a located error before any apply."""
    from ...spec.engines import LLAMA_CPP
    from ...spec.manifest import check_on_host

    issues = check_on_host(loaded)
    engine = loaded.manifest.spec.engine
    if engine.name == LLAMA_CPP:
        from ...engine.llamacpp.binary import BinaryError, find_binary

        try:
            find_binary(loaded.resolve(engine.binary) if engine.binary else None)
        except BinaryError as exc:
            field = "spec.engine.binary" if engine.binary else "spec.engine.name"
            issues.append(loaded.issue(field, str(exc)))
        from ...placement.llamacpp import DRAFT_FIELD, draft_problem

        problem = draft_problem(loaded)  # spec.speculative's draft GGUF: present, GGUF, the same vocabulary
        if problem is not None:
            issues.append(loaded.issue(DRAFT_FIELD, problem))
    return issues


def deployment_inventory(loaded: LoadedManifest, devices: str | None) -> Inventory:
    """What a deployment is planned against: ``devices`` (or ``$DEPLOYKIT_DEVICES``) when given; else
    the Ray cluster's nodes for a pipeline manifest; else this host."""
    import os

    from ...placement.planning import inventory_for

    cluster = loaded.manifest.spec.cluster
    spans_nodes = cluster is not None and loaded.manifest.spec.placement.nodes > 1
    if devices is None and not os.environ.get("DEPLOYKIT_DEVICES") and spans_nodes:
        from ...cluster.inventory import (
            probe_cluster,  # imports ray: only for such manifests
        )

        assert cluster is not None
        return probe_cluster(cluster.address)
    return inventory_for(loaded, devices)
