"""What every check is given: where the repository, the scratch space and the models are, whether CUDA is
there, and the environment its subprocesses (deploykit's CLI, servers, pytest) run with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Context:
    work: Path  # scratch space of this run (models, shards, state, logs)
    dry: bool  # no CUDA: run what needs none, skip the rest with the reason
    site: str = ""  # where the carried wheels were installed, overrides first ("" when none)
    machine_site: str = ""  # the same without the overrides: the machine's own transformers
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> models.build()'s answer

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda:0"

    @property
    def dtype(self) -> str:
        """The dtype the checks load at: bfloat16 on the GPU; float32 on the CPU (fast there)."""
        return "float32" if self.dry else "bfloat16"

    def model(self, name: str) -> Path:
        return Path(self.models[name]["path"])

    def env(self, *, machine: bool = False, **extra: str) -> dict[str, str]:
        """The environment of a subprocess: the carried wheels and this repository first on the path
        (``machine``: without the overrides, so the machine's own versions of those)."""
        site = self.machine_site if machine else self.site
        paths = [p for p in (site, str(ROOT), os.environ.get("PYTHONPATH", "")) if p]
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
                "TQDM_DISABLE": "1",
                "DEPLOYKIT_CACHE": str(self.work / "deploykit-cache"), **extra}

    def deploykit(self, *args: str, timeout: float, state: Path | None = None,
                  machine: bool = False) -> subprocess.CompletedProcess[str]:
        """``deploykit ARGS`` (its CLI, as a user runs it), output captured."""
        env = self.env(machine=machine, DEPLOYKIT_STATE=str(state or self.work / "state-cli"), COLUMNS="200")
        return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], env=env, capture_output=True,
                              text=True, timeout=timeout, cwd=ROOT)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "work": str(self.work)})

    @classmethod
    def from_json(cls, text: str) -> Context:
        data = json.loads(text)
        return cls(Path(data["work"]), data["dry"], data.get("site", ""), data.get("machine_site", ""),
                   data.get("models", {}))


def open_deployment(path: Path, *, state_dir: Path, devices: str | None = None) -> Any:
    """``Deployment.from_manifest`` through deploykit's public name (``from deploykit import Deployment``):
    apply the manifest and hold its model in this process."""
    import deploykit

    return deploykit.Deployment.from_manifest(path, devices=devices, state_dir=state_dir)  # type: ignore[attr-defined]
