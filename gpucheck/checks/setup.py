"""Set-up: what the machine has (GPU, versions), whether deploykit and the carried packages import and their
requirements are met, and the random-weight models every later check uses (``ctx.models``)."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

from .. import models
from ..context import Context
from ..gpu import describe_gpus
from ..record import Recorder

VERSIONS = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "pydantic", "fastapi", "uvicorn",
            "starlette", "watchdog", "gguf", "openai", "httpx", "click", "rich", "pyyaml", "pytest", "numpy")
IMPORTS = ("deploykit.cli", "deploykit.control.live.deployment", "deploykit.serve.app", "fastapi", "uvicorn", "watchdog",
           "gguf", "openai", "accelerate")
# name -> (dtype of its weights, built on the GPU at full size; tiny on the CPU in the dry run)
MODELS = {"llama-3.2-1b": "bfloat16", "smollm2-135m": "float32"}


def run(ctx: Context, rec: Recorder) -> None:
    rec.metric("versions", _versions())
    rec.metric("python", f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})")
    rec.metric("nvidia_smi", describe_gpus())
    _cuda(ctx, rec)
    for module in IMPORTS:
        _imports(rec, module)
    if ctx.site:
        problems = [p for site in ctx.site.split(os.pathsep) for p in unmet_requirements(Path(site))]
        rec.expect("carried wheels' requirements met here", not problems, "; ".join(problems) or "all met")
    built: dict[str, Any] = {}
    for name, dtype in MODELS.items():
        with rec.step(f"build {name}") as step:
            info = models.build(name, ctx.work / "models" / name, tiny=ctx.dry, device=ctx.device, dtype=dtype)
            step.detail = f"{info['parameters'] / 1e6:.1f}M parameters, {info['bytes'] / 2**20:.0f} MiB {dtype}" + (
                " (tiny: the dry run)" if ctx.dry else "")
            built[name] = info
        rec.metric("models", built)


def _versions() -> dict[str, str]:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def _cuda(ctx: Context, rec: Recorder) -> None:
    import torch

    cuda = torch.cuda.is_available()
    rec.metric("cuda", cuda)
    if not cuda:
        rec.skip("CUDA device", f"torch {torch.__version__} sees no CUDA device: dry run")
        return
    props = torch.cuda.get_device_properties(0)
    gpu = {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
           "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
           "count": torch.cuda.device_count()}
    rec.metric("gpu", gpu)
    rec.note("CUDA device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, CUDA {torch.version.cuda}")


def _imports(rec: Recorder, module: str) -> None:
    try:
        importlib.import_module(module)
        rec.note(f"import {module}", "ok")
    except Exception as exc:  # noqa: BLE001 - reported; the checks that need it will say more
        rec.expect(f"import {module}", False, f"{type(exc).__name__}: {exc}")


def unmet_requirements(site: Path) -> list[str]:
    """Each requirement of a package installed in ``site`` that this Python's packages do not meet."""
    from packaging.requirements import Requirement

    problems = []
    for dist in metadata.distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: {have} here")
    return problems
