"""Manifests for tests: a tiny real model on CPU and disk tiers."""

from __future__ import annotations

import os
from pathlib import Path

TEMPLATE = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: {name}
spec:
  model:
    path: {path}
    task: {task}
    dtype: float32
  placement:
    gpus: []
  sharding:
    max_shard_size: {shard}
    path: shards
  offload:
    cpu: {{max_memory: {cpu}}}
    disk: {{path: offload, max_size: 1GiB}}
  rollout:
    strategy: {strategy}
"""


def manifest_text(model: Path, *, name: str = "tiny", cpu: int | str = "1GiB", shard: str = "200KiB",
                  task: str = "causal-lm", strategy: str = "auto") -> str:
    return TEMPLATE.format(name=name, path=model, cpu=cpu, shard=shard, task=task, strategy=strategy)


def write_manifest(directory: Path, model: Path, **kwargs) -> Path:
    path = directory / f"{kwargs.get('name', 'tiny')}.yaml"
    path.write_text(manifest_text(model, **kwargs))
    return path


def replace_like_an_editor(path: Path, text: str) -> None:
    """Write a new file and rename it over the old one, as editors and `git checkout` do."""
    tmp = path.with_name(f".{path.name}.swp")
    tmp.write_text(text)
    os.replace(tmp, path)
