"""Parse once, validate once, plan once per change: an apply through the server's supervisor (under a
budget, as `deploykit serve` runs it) checks the manifest against the host once and plans it once per
inventory, whether it deploys, rolls out a change, finds nothing changed, or only dry-runs."""

from __future__ import annotations

from collections import Counter

import pytest

import deploykit.placement.planning as planning
import deploykit.spec.manifest as manifests
from deploykit.control.budget import Budget
from deploykit.control.budget.host import Host
from deploykit.control.revisions.state import StateStore
from deploykit.control.live.supervisor import Supervisor
from deploykit.spec.manifest import load_manifests
from deploykit.units import parse_size
from manifests import manifest_text


@pytest.fixture
def counted(monkeypatch):
    counts: Counter[str] = Counter()
    for module, name in ((planning, "plan_manifest"), (manifests, "check_on_host")):
        real = getattr(module, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return counts


def test_each_change_is_checked_once_and_planned_once(model, tmp_path, counted):
    host = Host(Budget({"cpu": parse_size("4GiB")}, source="test"))
    supervisor = Supervisor(None, store=StateStore(tmp_path / "state"), host=host)
    supervisor.start()
    path = tmp_path / "tiny.yaml"
    try:
        for shard, dry_run, status in (("200KiB", True, "dry-run"), ("200KiB", False, "applied"),
                                       ("100KiB", False, "applied"), ("100KiB", False, "unchanged")):
            path.write_text(manifest_text(model, name="tiny", shard=shard))
            counted.clear()
            outcome = supervisor.apply_manifest(load_manifests(path)[0], dry_run=dry_run)
            assert outcome.status == status
            # a rollout on a probed host plans twice, each once: as it holds memory after the swap (the budget's
            # need: the serving generation's bytes given back) and beside the serving generation (what it loads)
            plans = 2 if (shard, status) == ("100KiB", "applied") else 1
            assert counted == {"plan_manifest": plans, "check_on_host": 1}, (shard, dry_run, counted)
    finally:
        supervisor.close()
