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
from ..units import format_size, parse_size

ENV_VAR = "DEPLOYKIT_DEVICES"
_GPU_RE = re.compile(r"^(?:(\d+)\s*[xX*]\s*)?(\d+(?:\.\d+)?\s*[A-Za-z]*)$")


@dataclass(frozen=True)
class Gpu:
    index: int
    memory: int  # bytes usable now (free memory for a probed GPU)
    name: str = "simulated"


@dataclass(frozen=True)
class Inventory:
    """Devices available for a deployment. ``cpu``/``disk`` None means "not limited by the host"."""

    gpus: tuple[Gpu, ...] = ()
    cpu: int | None = None
    disk: int | None = None
    simulated: bool = True
    notes: tuple[str, ...] = field(default=(), compare=False)

    def gpu(self, index: int) -> Gpu | None:
        return next((g for g in self.gpus if g.index == index), None)

    def describe(self) -> str:
        parts = [f"cuda:{g.index} {format_size(g.memory)}" for g in self.gpus] or ["no GPU"]
        if self.cpu is not None:
            parts.append(f"cpu {format_size(self.cpu)}")
        if self.disk is not None:
            parts.append(f"disk {format_size(self.disk)}")
        return ("simulated: " if self.simulated else "") + ", ".join(parts)


def parse_devices(spec: str) -> Inventory:
    """Parse a simulated inventory.

    ``"4x80GiB"``; ``"2x24GiB,1x48GiB"`` (``+`` works too); ``"80GiB"`` for one GPU; optional
    ``cpu=64GiB`` and ``disk=1TiB`` items; ``"none"`` or ``""`` for a host without GPUs. GPUs are
    numbered 0..N-1 in the order given.
    """
    gpus: list[Gpu] = []
    cpu: int | None = None
    disk: int | None = None
    items = [p.strip() for p in re.split(r"[,+]", spec) if p.strip()]
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
            match = _GPU_RE.match(item)
            if not match:
                raise ValueError("expected COUNTxSIZE such as 4x80GiB")
            count = int(match.group(1) or 1)
            memory = parse_size(match.group(2).replace(" ", ""))
            if count < 1 or memory <= 0:
                raise ValueError("count and size must be positive")
            first = len(gpus)
            gpus.extend(Gpu(first + i, memory) for i in range(count))
        except ValueError as exc:
            raise InventoryError(f"cannot read device spec {spec!r} at {item!r}: {exc}") from None
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
