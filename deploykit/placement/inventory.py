"""What devices exist: probed on this host, or simulated for planning anywhere.

The only module that probes hardware. ``Inventory`` is a plain value, so the planner can be given a
made-up one (``4x80GiB``) and plan a 4-GPU host from a laptop. torch is imported only by ``probe``,
and only when CUDA might be present.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InventoryError
from ..spec.limits import MAX_GPUS, MAX_NODES
from ..units import format_size, parse_size

ENV_VAR = "DEPLOYKIT_DEVICES"
MAX_SPEC_TEXT = 4096  # characters of a --devices spec: "2x(8x80GiB,cpu=2TiB)" is 20
_MAX_COUNT_DIGITS = 6
_GPU_RE = re.compile(r"(?:(\d+)\s*[xX*]\s*)?(\d+(?:\.\d+)?\s*[A-Za-z]*)", re.ASCII)  # fullmatch: whole items


@dataclass(frozen=True)
class Gpu:
    index: int
    memory: int  # bytes usable now (free memory for a probed GPU)
    name: str = "simulated"


@dataclass(frozen=True)
class Node:
    """One machine of a cluster: its own GPUs (indexed from 0 on that machine) and tiers."""

    name: str
    gpus: tuple[Gpu, ...] = ()
    cpu: int | None = None
    disk: int | None = None
    address: str | None = None  # the node's IP (a Ray cluster), None when simulated
    id: str | None = None  # the cluster's id of the node (Ray's NodeID)

    def host(self, *, simulated: bool = True) -> Inventory:
        """This node as a single-host inventory."""
        return Inventory(gpus=self.gpus, cpu=self.cpu, disk=self.disk, simulated=simulated)

    def describe(self) -> str:
        parts = [f"{len(self.gpus)}x GPU" + (f" ({format_size(min(g.memory for g in self.gpus))})"
                                             if self.gpus else "")]
        if self.cpu is not None:
            parts.append(f"cpu {format_size(self.cpu)}")
        where = f" at {self.address}" if self.address else ""
        return f"{self.name}{where}: " + ", ".join(parts)


@dataclass(frozen=True)
class Inventory:
    """Devices available for a deployment. ``cpu``/``disk`` None means "not limited by the host".

    A cluster inventory also lists its ``nodes`` (machines, in order); its own ``gpus``/``cpu``/``disk``
    are then those of the first node, where a one-node deployment runs."""

    gpus: tuple[Gpu, ...] = ()
    cpu: int | None = None
    disk: int | None = None
    simulated: bool = True
    notes: tuple[str, ...] = field(default=(), compare=False)
    nodes: tuple[Node, ...] = ()  # empty: a single host
    # the CPU tier of the host budget this deployment runs under (deploykit serve --budget), if any: the
    # default prefix cache is sized within it (the weights' placement does not read it)
    budget_cpu: int | None = None

    @classmethod
    def of_nodes(cls, nodes: tuple[Node, ...], *, simulated: bool = True,
                 notes: tuple[str, ...] = ()) -> Inventory:
        first = nodes[0] if nodes else Node("none")
        return cls(gpus=first.gpus, cpu=first.cpu, disk=first.disk, simulated=simulated, notes=notes,
                   nodes=nodes)

    @property
    def node_count(self) -> int:
        return len(self.nodes) or 1

    def node_list(self) -> tuple[Node, ...]:
        """The machines: the listed nodes, or this host as the only one."""
        return self.nodes or (Node("local", self.gpus, self.cpu, self.disk),)

    def describe_nodes(self) -> str:
        return "; ".join(n.describe() for n in self.node_list())

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def describe(self) -> str:
        if len(self.nodes) > 1:
            return ("simulated: " if self.simulated else "") + f"{len(self.nodes)} nodes: " + self.describe_nodes()
        parts = [f"cuda:{g.index} {format_size(g.memory)}" for g in self.gpus] or ["no GPU"]
        if self.cpu is not None:
            parts.append(f"cpu {format_size(self.cpu)}")
        if self.disk is not None:
            parts.append(f"disk {format_size(self.disk)}")
        return ("simulated: " if self.simulated else "") + ", ".join(parts)


_NODES_RE = re.compile(r"(?:(\d+)\s*[xX*]\s*)?\((.*)\)", re.ASCII)  # fullmatch


def _split_top(spec: str) -> list[str]:
    """Split on ``,``/``+`` outside parentheses."""
    items, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise InventoryError(f"cannot read device spec {spec!r}: unbalanced ')'")
        if ch in ",+" and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if depth:
        raise InventoryError(f"cannot read device spec {spec!r}: unclosed '('")
    items.append(cur.strip())
    return [i for i in items if i]


def parse_devices(spec: str) -> Inventory:
    """Parse a simulated inventory.

    ``"4x80GiB"``; ``"2x24GiB,1x48GiB"`` (``+`` works too); ``"80GiB"`` for one GPU; optional
    ``cpu=64GiB`` and ``disk=1TiB`` items; ``"none"`` or ``""`` for a host without GPUs. GPUs are
    numbered 0..N-1 in the order given.

    Several machines: ``"2x(8x80GiB)"`` is two nodes of eight 80 GiB GPUs each; ``"(8x80GiB),(4x80GiB)"``
    two different ones; ``"2x(8x80GiB,cpu=512GiB)"`` with their own CPU tier. A ``cpu=``/``disk=`` item
    outside the parentheses applies to every node that names none. Nodes are named node0, node1...
    and each numbers its GPUs from 0.
    """
    if len(spec) > MAX_SPEC_TEXT:
        raise InventoryError(f"a device spec is at most {MAX_SPEC_TEXT} characters, got {len(spec)}")
    items = _split_top(spec)
    if any(_NODES_RE.fullmatch(i) for i in items):
        return _parse_nodes(spec, items)
    return _parse_host(spec, items)


def _parse_nodes(spec: str, items: list[str]) -> Inventory:
    hosts: list[Inventory] = []
    shared: list[str] = []
    for item in items:
        match = _NODES_RE.fullmatch(item)
        if match is None:
            if "=" not in item:
                raise InventoryError(f"cannot read device spec {spec!r} at {item!r}: GPUs outside a node's "
                                     "parentheses; write each machine as (GPUs), e.g. 2x(8x80GiB)")
            shared.append(item)
            continue
        count = _count(match.group(1))
        if count < 1:
            raise InventoryError(f"cannot read device spec {spec!r} at {item!r}: node count must be positive")
        inner = _split_top(match.group(2))
        if any(_NODES_RE.fullmatch(i) for i in inner):
            raise InventoryError(f"cannot read device spec {spec!r} at {item!r}: nodes cannot be nested")
        host = _parse_host(spec, inner)
        if len(hosts) + count > MAX_NODES:
            raise InventoryError(f"device spec {_short(spec)!r} names more than {MAX_NODES} nodes")
        if sum(len(h.gpus) for h in hosts) + count * len(host.gpus) > MAX_GPUS:
            raise InventoryError(f"device spec {_short(spec)!r} names more than {MAX_GPUS} GPUs in all")
        hosts.extend([host] * count)
    defaults = _parse_host(spec, shared)
    nodes = tuple(Node(f"node{i}", h.gpus, h.cpu if h.cpu is not None else defaults.cpu,
                       h.disk if h.disk is not None else defaults.disk) for i, h in enumerate(hosts))
    return Inventory.of_nodes(nodes, simulated=True)


def _count(digits: str | None) -> int:
    """A count of a device spec (``4`` of ``4x80GiB``); 1 when absent. Never ``int()`` of a long run of
    digits: past any bound anyway, and Python refuses more than 4300 of them."""
    if digits is None:
        return 1
    if len(digits) > _MAX_COUNT_DIGITS:
        raise InventoryError(f"a device count of {len(digits)} digits; at most {MAX_GPUS} GPUs and {MAX_NODES} "
                             "nodes are planned")
    return int(digits)


def _short(spec: str) -> str:
    return spec if len(spec) <= 80 else f"{spec[:80]}..."


def _parse_host(spec: str, items: list[str]) -> Inventory:
    gpus: list[Gpu] = []
    cpu: int | None = None
    disk: int | None = None
    if items == ["none"]:
        items = []
    for item in items:
        try:
            if "=" in item:
                key, _, value = item.partition("=")
                key = key.strip().lower()
                if key == "cpu":
                    cpu = parse_size(value.strip())
                elif key == "disk":
                    disk = parse_size(value.strip())
                else:
                    raise ValueError(f"unknown tier {key!r}; use cpu=SIZE or disk=SIZE")
                continue
            match = _GPU_RE.fullmatch(item)
            if not match:
                raise ValueError("expected COUNTxSIZE such as 4x80GiB")
            count = _count(match.group(1))
            memory = parse_size(match.group(2).replace(" ", ""))
            if count < 1 or memory <= 0:
                raise ValueError("count and size must be positive")
            if len(gpus) + count > MAX_GPUS:
                raise ValueError(f"more than {MAX_GPUS} GPUs")
            first = len(gpus)
            gpus.extend(Gpu(first + i, memory) for i in range(count))
        except ValueError as exc:
            raise InventoryError(f"cannot read device spec {_short(spec)!r} at {_short(item)!r}: {exc}") from None
    return Inventory(gpus=tuple(gpus), cpu=cpu, disk=disk, simulated=True)


def _proc_bytes(path: str, field: str) -> int | None:
    """A ``Field:  N kB`` line of a /proc file, in bytes."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_rss() -> int:
    """Resident set of this process in bytes (0 where /proc is missing)."""
    return _proc_bytes("/proc/self/status", "VmRSS") or 0


def _available_ram() -> int | None:
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _probe_gpus() -> tuple[Gpu, ...]:
    # Importing torch costs seconds; skip it when no NVIDIA driver is visible at all.
    if not (Path("/proc/driver/nvidia").exists() or os.environ.get("CUDA_VISIBLE_DEVICES")):
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(index)
        gpus.append(Gpu(index, int(free), torch.cuda.get_device_name(index)))
    return tuple(gpus)


def probe(*, disk_path: Path | None = None) -> Inventory:
    """The real devices of this host: GPUs with their free memory, available RAM, free disk."""
    disk = None
    if disk_path is not None:
        existing = disk_path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        disk = shutil.disk_usage(existing).free
    return Inventory(gpus=_probe_gpus(), cpu=_available_ram(), disk=disk, simulated=False)


def resolve(devices: str | None, *, disk_path: Path | None = None) -> Inventory:
    """``--devices`` if given, else ``$DEPLOYKIT_DEVICES``, else the probed host."""
    spec = devices if devices is not None else os.environ.get(ENV_VAR)
    if spec is not None:
        return parse_devices(spec)
    return probe(disk_path=disk_path)
