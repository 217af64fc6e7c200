"""Names in a device_map: ``compress_names`` (runs of block names, ``model.layers.0-7``, as plans show
them) and ``placement_key`` (the device_map key that places a module or a checkpoint tensor)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any


def compress_names(names: Sequence[str]) -> tuple[str, ...]:
    """["model.layers.0", "model.layers.1", "model.norm"] -> ("model.layers.0-1", "model.norm")."""
    out: list[str] = []
    run_prefix, run_start, run_end = None, 0, 0
    for name in names:
        match = re.fullmatch(r"(.*\.)([0-9]+)", name, re.DOTALL)
        if match and match.group(1) == run_prefix and int(match.group(2)) == run_end + 1:
            run_end += 1
            out[-1] = f"{run_prefix}{run_start}-{run_end}"
            continue
        out.append(name)
        run_prefix, run_start, run_end = (match.group(1), int(match.group(2)),
                                          int(match.group(2))) if match else (None, 0, 0)
    return tuple(out)


def placement_key(name: str, device_map: Mapping[str, Any]) -> str | None:
    """The device_map key that places module or tensor ``name``: the longest key equal to it or a dotted
    prefix of it. Checkpoints saved from a base model may carry one extra leading component
    (``bert.encoder...``), tried second."""
    candidates = [name] + ([name.split(".", 1)[1]] if "." in name else [])
    for candidate in candidates:
        parts = candidate.split(".")
        for i in range(len(parts), 0, -1):
            key = ".".join(parts[:i])
            if key in device_map:
                return key
    return "" if "" in device_map else None
