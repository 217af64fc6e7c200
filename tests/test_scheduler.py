"""The budget scheduler's decisions as tables, the --budget parser and spec.lifecycle's located errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploykit.control.budget import Budget, BudgetError, host_budget, parse_budget, plan_tiers
from deploykit.control.budget.scheduler import Never, Resident, Room, Wait, Want, evictable, expired, make_room
from deploykit.errors import ManifestError
from deploykit.placement.inventory import Gpu, Inventory
from deploykit.spec.manifest import load_manifests

B = Budget({"cpu": 100})


def r(name: str, cpu: int, *, priority: int = 0, last_used: float = 0.0, busy: int = 0,
      keep_alive: float | None = None) -> Resident:
    return Resident(name, {"cpu": cpu}, priority, last_used, busy, keep_alive)


MAKE_ROOM = [
    # (case, residents, want (name, cpu, priority), expected)
    ("fits beside: nothing unloaded", [r("a", 40), r("b", 30)], ("c", 30, 0), Room(())),
    ("lowest priority first", [r("a", 40, priority=1, last_used=1), r("b", 40, priority=0, last_used=9)],
     ("c", 30, 1), Room(("b",))),
    ("then least recently used", [r("a", 40, last_used=5), r("b", 40, last_used=2)], ("c", 30, 0), Room(("b",))),
    ("as many as needed, in order", [r("a", 30, last_used=3), r("b", 30, last_used=1), r("c", 30, last_used=2)],
     ("d", 60, 0), Room(("b", "c"))),
    ("busy ones are never unloaded", [r("a", 50, busy=1), r("b", 50, last_used=9)], ("c", 40, 0), Room(("b",))),
    ("higher priority ones are not unloaded", [r("a", 50, priority=2), r("b", 50, priority=0)],
     ("c", 40, 1), Room(("b",))),
    ("no room: wait, unload nothing", [r("a", 50, busy=1), r("b", 40, priority=5)], ("c", 30, 1), "wait"),
    ("partial room is no room", [r("a", 60, busy=2), r("b", 30)], ("c", 50, 0), "wait"),
    ("alone over the budget: never", [], ("c", 101, 9), "never"),
    ("exactly the budget fits an empty host", [r("a", 10)], ("c", 100, 0), Room(("a",))),
    ("a waiting request keeps its model", [r("a", 60, busy=1, last_used=0), r("b", 30, last_used=5)],
     ("c", 40, 0), Room(("b",))),
    ("the requester itself is not counted", [r("c", 50), r("a", 50, busy=1)], ("c", 50, 0), Room(())),
]


@pytest.mark.parametrize("case,residents,want,expected", MAKE_ROOM, ids=[c[0] for c in MAKE_ROOM])
def test_make_room(case, residents, want, expected):
    name, cpu, priority = want
    got = make_room(B, residents, Want(name, {"cpu": cpu}, priority))
    if expected == "wait":
        assert isinstance(got, Wait) and "budget" in got.reason and name in got.reason
    elif expected == "never":
        assert isinstance(got, Never) and "budget" in got.reason and "cpu short by" in got.reason
    else:
        assert got == expected


def test_tiers_are_budgeted_apart():
    budget = Budget({"cpu": 100, "gpu0": 100})
    residents = [Resident("cpu-only", {"cpu": 90}, last_used=0),
                 Resident("gpu", {"gpu0": 80, "cpu": 5}, last_used=1)]
    # gpu0 is short: the CPU-only deployment frees nothing there, so only "gpu" goes
    assert make_room(budget, residents, Want("new", {"gpu0": 50})) == Room(("gpu",))
    assert make_room(budget, residents, Want("new", {"cpu": 5})) == Room(())
    assert make_room(budget, residents, Want("new", {"gpu1": 1})) == Room(())  # a tier not budgeted is not limited


def test_eviction_order_and_expiry():
    residents = [r("a", 1, priority=1, last_used=1), r("b", 1, last_used=7), r("c", 1, last_used=3),
                 r("d", 1, busy=1), r("e", 1, priority=3)]
    assert [x.name for x in evictable(residents, Want("z", {"cpu": 1}, 1))] == ["c", "b", "a"]
    timed = [r("a", 1, last_used=0, keep_alive=10), r("b", 1, last_used=5, keep_alive=10),
             r("c", 1, last_used=0, keep_alive=10, busy=1), r("d", 1, last_used=0)]
    assert expired(timed, now=9.9) == []
    assert expired(timed, now=10) == ["a"]
    assert expired(timed, now=100) == ["a", "b"]  # never a busy one, never a forever one


@pytest.mark.parametrize("text,expected", [
    ("cpu=6GiB", {"cpu": 6 << 30}),
    ("cpu=1000, gpu0=2GiB,gpu1=1.5GiB", {"cpu": 1000, "gpu0": 2 << 30, "gpu1": 3 << 29}),
    ("CPU=1MiB", {"cpu": 1 << 20}),
])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text,message", [
    ("", "empty"),
    ("cpu", "'cpu' is not TIER=SIZE"),
    ("ram=4GiB", "unknown tier 'ram'"),
    ("cpu=4XB", "--budget: cpu: unknown size unit 'XB'"),
    ("cpu=1GiB,cpu=2GiB", "tier 'cpu' is given twice"),
    ("cpu=0", "above 0"),
    ("gpu\u0661=1GiB", "unknown tier 'gpu\u0661'"),  # a digit, but not 0-9: no such device
])
def test_parse_budget_errors_say_what_and_where(text, message):
    with pytest.raises(BudgetError, match="^--budget: .*" if text else "--budget"):
        parse_budget(text)
    with pytest.raises(BudgetError) as info:
        parse_budget(text)
    assert message in str(info.value)


def test_host_budget_fills_unnamed_tiers_from_the_host_and_refuses_missing_ones():
    inv = Inventory(gpus=(Gpu(0, 80 << 30),), cpu=64 << 30)
    assert host_budget(inv).tiers == {"gpu0": 80 << 30, "cpu": 64 << 30}
    assert host_budget(inv, {"cpu": 1 << 30}).tiers == {"gpu0": 80 << 30, "cpu": 1 << 30}
    with pytest.raises(BudgetError, match="this host has no gpu1"):
        host_budget(inv, {"gpu1": 1})


def test_plan_tiers_count_cpu_and_gpus_not_disk(model, tmp_path):
    from deploykit.placement.planning import plan_manifest
    from manifests import write_manifest

    [loaded] = load_manifests(write_manifest(tmp_path, model, cpu="100KiB"))
    plan = plan_manifest(loaded, devices="cpu=1GiB,disk=1GiB")
    tiers = plan_tiers(plan)
    weights = tiers["cpu"] - plan.prefix_cache_bytes  # the prefix cache counts where the KV lives
    assert plan.prefix_cache_bytes == 0  # the default is a quarter of the KV room: under 1 MiB here, none
    assert set(tiers) == {"cpu"} and 0 < weights <= 100 << 10
    assert weights < plan.total_bytes  # the rest went to disk, which costs no budget


LIFECYCLE = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {{name: a}}
spec:
  model: {{path: /tmp}}
  lifecycle:
{body}"""


def test_lifecycle_fields_and_defaults(tmp_path: Path):
    path = tmp_path / "m.yaml"
    path.write_text(LIFECYCLE.format(body="    keep_alive: 5m\n    load: on-demand\n    priority: -2\n"))
    [loaded] = load_manifests(path)
    lc = loaded.manifest.spec.lifecycle
    assert (lc.keep_alive, lc.load, lc.priority) == (300.0, "on-demand", -2)
    assert "keep_alive: 5m" in loaded.text
    path.write_text(LIFECYCLE.format(body="    keep_alive: forever\n"))
    [loaded] = load_manifests(path)
    assert loaded.manifest.spec.lifecycle.keep_alive is None and "lifecycle" not in loaded.text  # default


def test_lifecycle_errors_are_located(tmp_path: Path):
    path = tmp_path / "m.yaml"
    path.write_text(LIFECYCLE.format(body="    keep_alive: soon\n    load: lazy\n    priority: high\n    ttl: 1\n"))
    with pytest.raises(ManifestError) as info:
        load_manifests(path)
    text = str(info.value)
    assert f"{path}:7:17: spec.lifecycle.keep_alive: cannot read 'soon' as a duration" in text
    assert "or 'forever'" in text
    assert f"{path}:8:11: spec.lifecycle.load: Input should be 'eager' or 'on-demand'" in text
    assert f"{path}:9:15: spec.lifecycle.priority:" in text
    assert f"{path}:10:5: spec.lifecycle.ttl: unknown field 'ttl'" in text
