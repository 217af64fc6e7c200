"""The nodes of a Ray cluster as a planning inventory: what ``deploykit plan`` plans against when a
manifest names ``spec.cluster`` and no ``--devices`` is given. Torch-free (the CLI imports it)."""

from __future__ import annotations

from typing import Any

from ..placement.inventory import Gpu, Inventory, Node
from .ray_env import ClusterError, connect


def nodes_of(ray: Any) -> tuple[Node, ...]:
    """Alive nodes, head first then by address: each with its GPUs (Ray reports their count and type,
    not their memory: see :func:`probe_cluster`) and the memory Ray schedules with as the CPU tier."""
    found = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = info.get("Resources", {})
        found.append((not any(k == "node:__internal_head__" for k in resources),
                      info.get("NodeManagerAddress", ""), info))
    found.sort(key=lambda t: (t[0], t[1]))
    nodes = []
    for i, (_not_head, address, info) in enumerate(found):
        resources = info.get("Resources", {})
        gpus = int(resources.get("GPU", 0))
        memory = int(resources.get("memory", 0)) or None
        node_id = str(info.get("NodeID", ""))
        nodes.append(Node(name=f"{address}/{node_id[:8]}" if address else node_id[:12],
                          gpus=tuple(Gpu(g, 0, "ray") for g in range(gpus)), cpu=memory,
                          address=address or None, id=node_id))
    return tuple(nodes)


def probe_cluster(address: str, *, gpu_memory: int | None = None) -> Inventory:
    """The cluster at ``address`` as an inventory of nodes (not simulated). Ray knows each node's GPU
    count, not its free memory: ``gpu_memory`` (bytes per GPU) fills it in, else GPUs count with 0
    bytes and a note says so."""
    ray = connect(address)
    nodes = nodes_of(ray)
    if not nodes:
        raise ClusterError(f"the Ray cluster at {address!r} reports no alive node")
    notes: tuple[str, ...] = ()
    if any(n.gpus for n in nodes):
        if gpu_memory is None:
            notes = ("Ray reports GPU counts, not their memory: pass --devices 'Nx(MxSIZE)' to plan "
                     "GPU budgets",)
        else:
            nodes = tuple(Node(n.name, tuple(Gpu(g.index, gpu_memory, g.name) for g in n.gpus), n.cpu,
                               n.disk, n.address, n.id) for n in nodes)
    return Inventory.of_nodes(nodes, simulated=False, notes=notes)
