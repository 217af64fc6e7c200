"""Several nodes without Ray: the manifest fields, the `Nx(...)` inventory syntax, the node-major plan
(405B on two 8-GPU nodes), and one-node plans left exactly as they were."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import REPO
from test_cli import deploykit
from test_planner import gpus, spec, structure

from deploykit.errors import InventoryError, ManifestError, PlanInfeasible
from deploykit.placement.inventory import Inventory, Node, parse_devices
from deploykit.placement.partition import min_max_stages
from deploykit.placement.plan import Plan
from deploykit.placement.planner import plan
from deploykit.spec.manifest import check_on_host, parse_manifests
from deploykit.spec.schema import Spec

def nspec(**placement) -> Spec:
    offload = placement.pop("offload", {})
    return Spec.model_validate({"model": {"path": "/m"}, "cluster": {"address": "local"},
                                "placement": {"reserve": 0, **placement}, "offload": offload})


HEADER = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata:\n  name: x\nspec:\n  model:\n    path: /m\n"


def issues(text: str) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifests(text.encode(), source="m.yaml", base_dir=Path("/"))
    return [str(i) for i in info.value.issues]


def test_manifest_fields_and_defaults():
    text = HEADER + "  cluster: {address: 'ray://10.0.0.1:10001'}\n  replicas: 3\n  placement: {nodes: 2}\n"
    loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=Path("/"))[0]
    s = loaded.manifest.spec
    assert (s.cluster.address, s.replicas, s.placement.nodes) == ("ray://10.0.0.1:10001", 3, 2)
    assert "nodes: 2" in loaded.text and "replicas: 3" in loaded.text
    # A manifest without the new fields serialises (and so digests) exactly as before they existed.
    plain = parse_manifests(HEADER.encode(), source="m.yaml", base_dir=Path("/"))[0]
    assert "cluster" not in plain.text and "replicas" not in plain.text and "nodes" not in plain.text


NO_CLUSTER = ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata:\n  name: x\nspec:\n  model:\n"
              "    path: {path}\n  placement:\n    gpus: all\n    nodes: 2\n")
NO_CLUSTER_ERROR = ("spec.placement.nodes: 2 nodes need a cluster: add spec.cluster.address (a Ray address, "
                    "'auto' or 'local'), or set nodes to 1")


def test_nodes_without_cluster_plan_but_do_not_deploy(tmp_path):
    """Planning against a simulated inventory needs no cluster; deploying it does (located error)."""
    manifest = tmp_path / "m.yaml"
    manifest.write_text(NO_CLUSTER.format(path=REPO / "manifests" / "configs" / "llama-3.1-405b"))
    planned = deploykit("plan", str(manifest), "--devices", "2x(8x80GiB)", "--output", "json")
    assert planned.returncode == 0, planned.stderr
    assert len(json.loads(planned.stdout)["nodes"]) == 2
    loaded = parse_manifests(manifest.read_bytes(), source="m.yaml", base_dir=tmp_path)[0]
    assert [str(i) for i in check_on_host(loaded)] == [f"m.yaml:10:12: {NO_CLUSTER_ERROR}"]
    for verb in ("validate", "apply"):
        refused = deploykit(verb, str(manifest), env={"DEPLOYKIT_STATE": str(tmp_path / "state")})
        assert refused.returncode == 2, (verb, refused.stdout, refused.stderr)
        assert f"{manifest}:10:12: {NO_CLUSTER_ERROR}" in " ".join(refused.stderr.split()), refused.stderr
    assert not (tmp_path / "state" / "shards").exists()


def test_what_a_cluster_cannot_serve_is_refused_where_it_is_written(tmp_path):
    """replicas > 1 without a cluster was silently served as one copy; a cluster serves text models only."""
    model = REPO / "manifests" / "configs" / "llama-3.1-405b"
    text = HEADER.replace("/m", str(model)) + "  replicas: 3\n"
    loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)[0]
    assert [str(i) for i in check_on_host(loaded)] == [
        "m.yaml:8:13: spec.replicas: 3 replicas need a cluster: add spec.cluster.address (a Ray address, "
        "'auto' or 'local'), or set replicas to 1"]
    text = (HEADER.replace("/m", str(model)) + "    task: feature-extraction\n"
            + "  cluster: {address: local}\n")
    loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)[0]
    [issue] = check_on_host(loaded)
    assert str(issue).startswith("m.yaml:8:11: spec.model.task: a cluster (replicas, pipeline stages) serves "
                                 "causal-lm models only, not feature-extraction")


def test_replicas_nodes_and_address_validated():
    text = HEADER + "  cluster: {address: 'not an address'}\n  replicas: 0\n  placement: {nodes: 0}\n"
    found = issues(text)
    assert any(i.startswith("m.yaml:8:22: spec.cluster.address: not a Ray address") for i in found)
    assert any(i.startswith("m.yaml:9:13: spec.replicas: Input should be greater than or equal to 1")
               for i in found)
    assert any(i.startswith("m.yaml:10:22: spec.placement.nodes: Input should be greater than or equal to 1")
               for i in found)
    # an invalid address is not reported a second time as "no cluster"
    text = HEADER + "  cluster: {address: 'x y'}\n  placement: {nodes: 2}\n"
    assert len(issues(text)) == 1


@pytest.mark.parametrize("address", ["auto", "local", "10.0.0.1:6379", "ray://head:10001", "head-0.svc:6379"])
def test_ray_addresses_accepted(address):
    text = HEADER + f"  cluster: {{address: '{address}'}}\n"
    assert parse_manifests(text.encode(), source="m.yaml", base_dir=Path("/"))[0].manifest.spec.cluster


def test_parse_node_inventories():
    inv = parse_devices("2x(8x80GiB)")
    assert [n.name for n in inv.nodes] == ["node0", "node1"]
    assert [len(n.gpus) for n in inv.nodes] == [8, 8] and inv.nodes[1].gpus[0].index == 0
    assert inv.gpus == inv.nodes[0].gpus  # a one-node deployment plans the first node
    mixed = parse_devices("(2x24GiB,cpu=1GiB),(1x48GiB),cpu=8GiB")
    assert [(len(n.gpus), n.cpu) for n in mixed.nodes] == [(2, 2**30), (1, 8 * 2**30)]
    assert parse_devices("2x()").nodes[1].gpus == ()
    assert parse_devices("4x80GiB").nodes == ()  # the one-host syntax is unchanged
    for bad in ("2x(8x80GiB),1x24GiB", "2x(8x80GiB", "(2x(1GiB))", "0x(1GiB)"):
        with pytest.raises(InventoryError):
            parse_devices(bad)


def two_node_plan(sizes, memory, nodes=2, **placement):
    inv = Inventory.of_nodes(tuple(Node(f"n{k}", gpus(*memory).gpus) for k in range(nodes)))
    return plan(structure(sizes, head=True), nspec(gpus="all", nodes=nodes, **placement), inv)


def test_node_major_split_is_contiguous_and_named():
    p = two_node_plan([2, 1, 1, 1, 1, 1, 1, 1, 1, 2], [100, 100])
    assert [n.blocks for n in p.nodes] == [("embed", "layers.1-4"), ("layers.5-8", "head")]
    assert p.node_map == {"embed": 0, **{f"layers.{i}": 0 for i in range(1, 5)},
                          **{f"layers.{i}": 1 for i in range(5, 9)}, "head": 1}
    assert p.device_map["embed"] == 0 and p.device_map["layers.5"] == 0  # GPU 0 of each node
    assert p.stage_device_map(1) == {**{f"layers.{i}": 0 for i in (5, 6, 7)}, "layers.8": 1,
                                     "head": 1}
    assert p.device_nodes == (0, 0, 0, 1, 1, 1)  # each node: two GPUs and its CPU tier
    assert Plan.from_dict(json.loads(p.to_json())) == p  # a recorded plan comes back whole


def test_nodes_change_the_digest_but_one_node_plans_do_not():
    one = plan(structure([1, 1, 1, 1]), spec(gpus=[0, 1]), gpus(100, 100))
    assert "node_map" not in one.to_dict() and "nodes" not in one.to_dict()
    # the digest of a one-node plan covers exactly what it did before nodes existed
    assert one.digest == "sha256:" + __import__("hashlib").sha256(json.dumps(
        {"name": "", "architecture": "Toy", "dtype": "float16", "device_map": list(one.device_map.items())},
        separators=(",", ":")).encode()).hexdigest()
    two = two_node_plan([1, 1, 1, 1], [100])
    assert two.digest != plan(structure([1, 1, 1, 1], head=True), spec(gpus="all"), gpus(100)).digest


def test_too_many_nodes_names_the_real_nodes():
    inv = Inventory.of_nodes((Node("10.0.0.1/ab12cd34", gpus(80).gpus, address="10.0.0.1"),), simulated=False)
    with pytest.raises(PlanInfeasible) as info:
        plan(structure([1, 1, 1]), nspec(gpus="all", nodes=3), inv)
    assert info.value.field == "spec.placement.nodes"
    assert "placement.nodes is 3, but the inventory has 1 node: 10.0.0.1/ab12cd34 at 10.0.0.1" in str(info.value)
    with pytest.raises(PlanInfeasible, match="a single host"):
        plan(structure([1, 1, 1]), nspec(gpus="all", nodes=2), gpus(80))


def test_node_capacity_and_offload_per_node():
    # node 0's GPU holds 3 blocks, the rest must go to node 1 (its GPU, then its CPU tier)
    p = two_node_plan([1] * 8, [3], offload={"cpu": {"max_memory": 10}})
    assert [n.blocks for n in p.nodes] == [("embed", "layers.1-3"), ("layers.4-6", "head")]
    assert [(p.device_nodes[i], d.device, d.blocks) for i, d in enumerate(p.devices) if d.tier == "cpu"] == [
        (0, "cpu", ("layers.3",)), (1, "cpu", ("head",))]
    with pytest.raises(PlanInfeasible, match="does not fit in 2 pipeline stages"):
        two_node_plan([1] * 8, [3], offload={"cpu": None})


def brute_stages(loads, ratios, max_end, min_first):
    n, m = len(loads), len(ratios)
    best = None
    for cuts in itertools.combinations(range(1, n), m - 1):
        ends = list(cuts) + [n]
        starts = [0] + list(cuts)
        if ends[0] < min_first or any(b > max_end[k][a] for k, (a, b) in enumerate(zip(starts, ends))):
            continue
        value = max(sum(loads[a:b]) / ratios[k] for k, (a, b) in enumerate(zip(starts, ends)))
        best = value if best is None else min(best, value)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=2, max_size=9), st.integers(2, 3), st.integers(5, 60),
       st.integers(0, 2))
def test_min_max_stages_against_brute_force(loads, m, cap, min_first):
    m = min(m, len(loads))
    max_end = [[a for a in range(len(loads) + 1)] for _ in range(m)]
    for k in range(m):  # what node k holds from a: greedy up to cap
        for a in range(len(loads) + 1):
            b, used = a, 0
            while b < len(loads) and used + loads[b] <= cap:
                used, b = used + loads[b], b + 1
            max_end[k][a] = b
    ratios = [1.0] * m
    expected = brute_stages(loads, ratios, max_end, min_first)
    if expected is None:
        with pytest.raises(ValueError):
            min_max_stages(loads, ratios, max_end, min_first=min_first)
    else:
        ends, value = min_max_stages(loads, ratios, max_end, min_first=min_first)
        assert value == expected and ends[-1] == len(loads) and all(a < b for a, b in zip([0] + ends, ends))


def test_405b_on_two_eight_gpu_nodes_prints_each_node():
    """The acceptance case: contiguous layers per node, node loads within 2%, printed per node."""
    manifest = REPO / "manifests" / "llama-3.1-405b.yaml"
    result = deploykit("plan", str(manifest), "--devices", "2x(8x80GiB)", "--output", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert list(data)[:5] == ["name", "digest", "device_map", "node_map", "nodes"]
    assert set(data["node_map"]) == set(data["device_map"])  # every block: its node and its device there
    nodes = data["nodes"]
    assert [n["layers"] for n in nodes] == [[0, 62], [63, 125]]
    for k, n in enumerate(nodes):
        layers = sorted(int(key.rsplit(".", 1)[1]) for key, node in data["node_map"].items()
                        if node == k and key.startswith("model.layers."))
        assert layers == list(range(n["layers"][0], n["layers"][1] + 1))  # contiguous
    assert data["node_map"]["model.embed_tokens"] == 0 and data["device_map"]["model.embed_tokens"] == 0
    assert data["node_map"]["lm_head"] == 1
    loads = [n["load"] for n in nodes]
    assert max(loads) / min(loads) - 1 < 0.02
    assert all(d["node"] in (0, 1) and d["node_name"] in ("node0", "node1") for d in data["devices"])
    assert sum(1 for d in data["devices"] if d["node"] == 1) == 8
    table = deploykit("plan", str(manifest), "--devices", "2x(8x80GiB)")
    assert table.returncode == 0, table.stderr
    assert "node 0 node0: layers 0-62" in table.stdout and "node 1 node1: layers 63-125" in table.stdout
    assert "pipeline stages" in table.stdout


def test_each_pipeline_replica_asks_serve_for_a_bundle_per_stage():
    """Serve's per-replica placement group: the replica with stage 0, then one bundle per stage; a GPU per
    stage when the plan uses GPUs (as the pipeline's stage actors ask); none for a one-node plan."""
    from deploykit.cluster.replicas import ReplicaOptions, replica_bundles

    options = ReplicaOptions(num_cpus=0.25, stage_cpus=0.5)
    gpu_plan = two_node_plan([2, 1, 1, 1, 1, 1, 1, 1, 1, 2], [100, 100])
    assert replica_bundles(gpu_plan, options) == [{"CPU": 0.75, "GPU": 1.0}, {"CPU": 0.5, "GPU": 1.0}]
    cpu_plan = plan(structure([1, 1, 1, 1], head=True), nspec(gpus=[], nodes=3),
                    Inventory.of_nodes(tuple(Node(f"n{k}", (), cpu=100) for k in range(3))))
    assert replica_bundles(cpu_plan, options) == [{"CPU": 0.75}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert replica_bundles(plan(structure([1, 1]), spec(gpus=[0]), gpus(100)), options) is None
