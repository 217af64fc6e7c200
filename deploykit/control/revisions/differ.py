"""`deploykit diff`: what applying a manifest would change against its current revision.

Three answers: which manifest fields change (old -> new), which modules move to another device, and
whether the checkpoint must be resharded. Reads config.json and safetensors headers only.
"""

from __future__ import annotations

from typing import Any

import yaml

from ...artifacts.layout import fits_layout, plan_layout
from ...artifacts.verify import read_lock
from ...errors import DeploykitError
from ...model.checkpoint import open_checkpoint
from ...model.gguf import is_gguf
from ...placement.keys import compress_names
from ...spec.manifest import LoadedManifest
from .state import StateStore


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def field_changes(old_text: str, new_text: str) -> list[tuple[str, Any, Any]]:
    old, new = _flatten(yaml.safe_load(old_text)), _flatten(yaml.safe_load(new_text))
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def diff_manifest(loaded: LoadedManifest, *, store: StateStore, devices: str | None = None) -> list[str]:
    from ...placement.planning import plan_manifest
    from .layouts import shards_dir

    current = store.current(loaded.name)
    lines = [f"{loaded.name} ({loaded.source}):"]
    if current is None:
        lines.append("  not deployed yet: apply creates revision 1")
    else:
        changes = field_changes(current.manifest_text, loaded.text)
        lines.append(f"  against revision {current.revision}: "
                     + (f"{len(changes)} field(s) change" if changes else "manifest unchanged"))
        lines += [f"    {k}: {old!r} -> {new!r}" for k, old, new in changes]
    try:
        plan = plan_manifest(loaded, devices=devices)
    except DeploykitError as exc:
        lines.append(f"  the new manifest does not plan: {exc}")
        return lines
    old_plan = current.plan if current else None
    old_map: dict[str, Any] = dict(old_plan.device_map) if old_plan else {}
    moves: dict[tuple[Any, Any], list[str]] = {}
    for module, device in plan.device_map.items():
        before = old_map.get(module)
        if current is not None and before != device:
            moves.setdefault((before, device), []).append(module)
    if current is not None:
        if not moves:
            lines.append("  placement: no module moves")
        for (before, after), modules in moves.items():
            lines.append(f"  move {', '.join(compress_names(modules))}: {before} -> {after}")
    spec = loaded.manifest.spec
    if is_gguf(loaded.model_path):
        from .layouts import existing_import

        directory, imported = existing_import(loaded, store)
        if imported is None:
            lines.append(f"  import: needed, {loaded.model_path.name} is converted to {spec.model.dtype} "
                         f"into {directory} (the reshard is decided then)")
            return lines
        lines.append(f"  import: not needed ({directory} holds it)")
        checkpoint = imported
    else:
        checkpoint = open_checkpoint(loaded.model_path, allow_pickle=spec.model.allow_pickle)
    kwargs: dict[str, Any] = {"max_shard_size": spec.sharding.max_shard_size, "dtype": spec.model.dtype,
                              "device_map": plan.device_map}
    if fits_layout(checkpoint, **kwargs):
        lines.append("  reshard: not needed (the checkpoint's own layout fits)")
    else:
        layout = plan_layout(checkpoint, **kwargs)
        target = shards_dir(loaded, store, checkpoint.fingerprint, layout.digest)
        lock = read_lock(target)
        if lock and lock["source"]["fingerprint"] == checkpoint.fingerprint:
            lines.append(f"  reshard: not needed ({target} already holds this layout)")
        else:
            lines.append(f"  reshard: needed, {len(layout.shards)} shard(s) into {target}")
    return lines
