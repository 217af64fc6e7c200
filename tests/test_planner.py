"""The planner on made-up structures with known answers, against brute force, and on edge cases."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploykit.errors import PlanInfeasible
from deploykit.placement.inventory import Inventory, parse_devices
from deploykit.spec.schema import Spec
from deploykit.placement.keys import compress_names
from deploykit.placement.partition import longest_prefix, min_max_partition
from deploykit.placement.planner import plan
from deploykit.model.structure import Block, Structure


def structure(sizes, *, embedding=0, flops=None, kv=0, logits=0, head=False) -> Structure:
    """A made-up model: block 0 is 'embed', the last is 'head' when head=True, the rest layers."""
    blocks = []
    for i, size in enumerate(sizes):
        if i == embedding:
            name, kind = "embed", "embedding"
        elif head and i == len(sizes) - 1:
            name, kind = "head", "head"
        else:
            name, kind = f"layers.{i}", "layer"
        blocks.append(Block(name=name, modules=(name,), kind=kind, weight_bytes=size,
                            flops_per_token=(flops[i] if flops else size),
                            kv_bytes_per_token=kv if kind == "layer" else 0,
                            logits_bytes_per_token=logits if kind == "head" else 0))
    return Structure(architecture="Toy", model_type="toy", dtype="float16", blocks=tuple(blocks),
                     embedding_block=embedding)


def spec(**placement) -> Spec:
    offload = placement.pop("offload", {})
    return Spec.model_validate({"model": {"path": "/m"}, "placement": {"reserve": 0, **placement},
                                "offload": offload})


def gpus(*memory: int, cpu=None, disk=None) -> Inventory:
    from deploykit.placement.inventory import Gpu

    return Inventory(gpus=tuple(Gpu(i, m) for i, m in enumerate(memory)), cpu=cpu, disk=disk)


def runs(p):
    return {d.device: list(d.blocks) for d in p.devices if d.blocks}


# ------------------------------------------------------------------------------------------------
# Table-driven: small structures with answers worked out by hand.

TABLE = [
    # sizes, ratios, gpu memory, expected runs per device
    pytest.param([1, 1, 1, 1], None, [100, 100], {0: ["embed", "layers.1"], 1: ["layers.2-3"]}, id="even"),
    pytest.param([1, 1, 1, 1, 1, 1], [1, 2], [100, 100], {0: ["embed", "layers.1"], 1: ["layers.2-5"]},
                 id="ratio-1-2"),
    pytest.param([4, 1, 1, 1, 1], None, [100, 100], {0: ["embed"], 1: ["layers.1-4"]}, id="heavy-embed"),
    pytest.param([1, 2, 2, 2, 2, 2, 2, 2, 1], None, [100, 100, 100, 100],
                 {0: ["embed", "layers.1-2"], 1: ["layers.3-4"], 2: ["layers.5-6"], 3: ["layers.7-8"]},
                 id="four-gpus"),
    pytest.param([1, 1, 1, 1], [1, 0, 1], [100, 100, 100], {0: ["embed", "layers.1"], 2: ["layers.2-3"]},
                 id="zero-ratio-gpu-skipped"),
    pytest.param([1, 1, 1, 1, 1, 1], None, [2, 100], {0: ["embed", "layers.1"], 1: ["layers.2-5"]},
                 id="capacity-caps-first-gpu"),
    pytest.param([3, 1, 1, 1], None, [100, 100, 100], {0: ["embed"], 1: ["layers.1-2"], 2: ["layers.3"]},
                 id="most-even-of-optimal"),
]


@pytest.mark.parametrize("sizes,ratios,memory,expected", TABLE)
def test_table(sizes, ratios, memory, expected):
    placement = {"gpus": list(range(len(memory)))}
    if ratios:
        placement["ratios"] = ratios
    p = plan(structure(sizes), spec(**placement), gpus(*memory))
    assert runs(p) == expected


def test_bottleneck_factor_and_shares():
    p = plan(structure([1, 1, 1, 1, 1, 1]), spec(gpus=[0, 1], ratios=[1, 2]), gpus(100, 100))
    assert p.bottleneck_factor == 1.0
    assert [d.target_share for d in p.devices[:2]] == [pytest.approx(1 / 3, abs=1e-6),
                                                       pytest.approx(2 / 3, abs=1e-6)]
    p = plan(structure([1, 1, 1]), spec(gpus=[0, 1]), gpus(100, 100))
    assert p.bottleneck_factor == pytest.approx(4 / 3, abs=1e-6)  # 2 of 3 blocks on one of 2 GPUs


def test_embeddings_stay_on_first_gpu_even_when_not_first_block():
    s = structure([5, 1, 1, 1], embedding=2)  # something heavy runs before the embeddings
    p = plan(s, spec(gpus=[0, 1]), gpus(100, 100))
    assert p.device_map["embed"] == 0
    assert p.device_map["layers.0"] == 0 and p.device_map["layers.1"] == 0


def test_overflow_goes_to_cpu_then_disk_in_order():
    s = structure([2, 2, 2, 2, 2, 2])
    p = plan(s, spec(gpus=[0], offload={"cpu": {"max_memory": 4}, "disk": {"path": "/o", "max_size": 100}}),
             gpus(4))
    assert runs(p) == {0: ["embed", "layers.1"], "cpu": ["layers.2-3"], "disk": ["layers.4-5"]}
    assert list(p.device_map.values()) == [0, 0, "cpu", "cpu", "disk", "disk"]
    assert any("offloaded" in n for n in p.notes)


def test_no_gpus_plans_cpu_only():
    p = plan(structure([1, 2, 3]), spec(gpus=[]), Inventory())
    assert set(p.device_map.values()) == {"cpu"}
    assert p.bottleneck_factor is None


def test_infeasible_names_shortfall_per_tier():
    s = structure([10, 10, 10, 10])
    with pytest.raises(PlanInfeasible) as info:
        plan(s, spec(gpus=[0], offload={"cpu": {"max_memory": 10}, "disk": {"path": "/o", "max_size": 5}}),
             gpus(15))
    assert info.value.shortfall == {"gpu": 30, "cpu": 20, "disk": 20}
    assert info.value.field == "spec.offload"
    assert "20 B do not fit" in str(info.value)


def test_cpu_tier_disabled_with_null():
    with pytest.raises(PlanInfeasible, match="no offload tier"):
        plan(structure([10, 10]), spec(gpus=[0], offload={"cpu": None}), gpus(15))


def test_host_inventory_caps_the_cpu_tier():
    with pytest.raises(PlanInfeasible):
        plan(structure([10, 10]), spec(gpus=[], offload={"cpu": {"max_memory": 100}}), Inventory(cpu=15))


def test_embeddings_too_big_for_first_gpu():
    with pytest.raises(PlanInfeasible, match="cannot hold the input embeddings") as info:
        plan(structure([50, 1, 1]), spec(gpus=[0, 1]), gpus(10, 100))
    assert info.value.shortfall == {"cuda:0": 40}


def test_reserve_is_taken_from_each_gpu():
    p = plan(structure([3, 3, 3, 3]), spec(gpus=[0, 1], reserve=4), gpus(10, 10))
    assert [d.budget for d in p.devices[:2]] == [6, 6]
    with pytest.raises(PlanInfeasible):
        plan(structure([3, 3, 3, 3]), spec(gpus=[0, 1], reserve=8, offload={"cpu": None}), gpus(10, 10))


def test_unknown_gpu_points_at_gpus_field():
    with pytest.raises(PlanInfeasible, match="GPU 3 not in the inventory") as info:
        plan(structure([1, 1]), spec(gpus=[0, 3]), gpus(10, 10))
    assert info.value.field == "spec.placement.gpus"


def test_gpus_all_uses_every_inventory_gpu():
    p = plan(structure([1] * 8), spec(gpus="all"), parse_devices("4x1KiB"))
    assert sorted(d for d in set(p.device_map.values())) == [0, 1, 2, 3]


def test_kv_cache_and_logits_count_toward_capacity():
    s = structure([10, 10, 10, 10, 10], kv=1, logits=2, head=True)
    p = plan(s, spec(gpus=[0, 1], kv_cache={"tokens": 5}), gpus(100, 100))
    by_device = {d.device: d for d in p.devices}
    assert sum(by_device[g].bytes for g in (0, 1)) == 50 + 3 * 5 + 2 * 5
    assert by_device[0].bytes - by_device[0].weight_bytes + by_device[1].bytes - by_device[1].weight_bytes == 25
    assert p.kv_cache_tokens == 5
    with pytest.raises(PlanInfeasible):
        plan(s, spec(gpus=[0, 1], kv_cache={"tokens": 100}, offload={"cpu": None}), gpus(100, 100))


def test_compute_balance_ignores_cheap_lookups():
    # a huge embedding that costs no compute, and a head that costs a lot
    s = structure([8, 1, 1, 1, 1, 8], flops=[0, 2, 2, 2, 2, 8], head=True)
    memory = plan(s, spec(gpus=[0, 1]), gpus(100, 100))
    compute = plan(s, spec(gpus=[0, 1], balance="compute"), gpus(100, 100))
    assert runs(memory) == {0: ["embed", "layers.1-2"], 1: ["layers.3-4", "head"]}
    assert runs(compute) == {0: ["embed", "layers.1-4"], 1: ["head"]}
    assert compute.bottleneck_factor == 1.0


def test_plan_is_deterministic_and_json_serialisable():
    s = structure([3, 1, 4, 1, 5, 9, 2, 6])
    a = plan(s, spec(gpus=[0, 1, 2], ratios=[1, 2, 1.5]), gpus(100, 100, 100), name="x")
    b = plan(s, spec(gpus=[0, 1, 2], ratios=[1, 2, 1.5]), gpus(100, 100, 100), name="x")
    assert a == b and a.to_json() == b.to_json()
    assert a.digest.startswith("sha256:") and len(a.digest) == 71
    data = json.loads(a.to_json())
    assert {"name", "digest", "device_map", "devices", "bottleneck_factor"} <= set(data)
    assert set(data["devices"][0]) >= {"device", "bytes", "budget", "blocks"}
    c = plan(s, spec(gpus=[0, 1, 2], ratios=[2, 1, 1.5]), gpus(100, 100, 100), name="x")
    assert c.digest != a.digest


def test_compress_names():
    assert compress_names(["a.0", "a.1", "a.2", "b", "a.4", "c.5", "c.6"]) == ("a.0-2", "b", "a.4", "c.5-6")
    assert compress_names(["a.0\n", "a.1"]) == ("a.0\n", "a.1")  # a whole name ends in its number, or is not run


def test_longest_prefix():
    assert longest_prefix([2, 2, 2, 2], [3, 4]) == 3
    assert longest_prefix([5, 1], [4, 10], min_first=1) == -1


# ------------------------------------------------------------------------------------------------
# Property: the planner's bottleneck equals the brute-force optimum.


def brute_force(loads, sizes, ratios, budgets, min_first):
    n, m = len(loads), len(ratios)
    best = None
    for cuts in itertools.combinations_with_replacement(range(n + 1), m - 1):
        ends = [*cuts, n]
        start, worst, ok = 0, 0.0, True
        for k, end in enumerate(ends):
            if sum(sizes[start:end]) > budgets[k] or (k == 0 and end < min_first):
                ok = False
                break
            worst = max(worst, sum(loads[start:end]) / ratios[k])
            start = end
        if ok and (best is None or worst < best):
            best = worst
    return best


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=9),
    ratios=st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=4),
    data=st.data(),
)
def test_min_max_partition_equals_brute_force(sizes, ratios, data):
    loads = data.draw(st.lists(st.integers(0, 50), min_size=len(sizes), max_size=len(sizes)))
    budgets = data.draw(st.lists(st.integers(0, 200), min_size=len(ratios), max_size=len(ratios)))
    min_first = data.draw(st.integers(0, len(sizes)))
    expected = brute_force(loads, sizes, ratios, budgets, min_first)
    if expected is None:
        with pytest.raises(ValueError):
            min_max_partition(loads, sizes, ratios, budgets, min_first=min_first)
        return
    ends, optimum = min_max_partition(loads, sizes, ratios, budgets, min_first=min_first)
    assert optimum == expected
    start = 0
    for k, end in enumerate(ends):  # the returned split is feasible and achieves the optimum
        assert sum(sizes[start:end]) <= budgets[k]
        assert sum(loads[start:end]) / ratios[k] <= optimum
        start = end
    assert ends[-1] == len(sizes) and ends[0] >= min_first


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=2, max_size=10),
       ratios=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=4))
def test_plan_bottleneck_is_optimal_when_everything_fits(sizes, ratios):
    p = plan(structure(sizes), spec(gpus=list(range(len(ratios))), ratios=ratios),
             gpus(*[10_000] * len(ratios)))
    optimum = brute_force(sizes, sizes, ratios, [10_000] * len(ratios), 1)
    total, rsum = sum(sizes), sum(ratios)
    assert p.bottleneck_factor == pytest.approx(optimum / (total / rsum), rel=1e-5)
