"""Imports point down the layers (.importlinter, run by `make test`): cli -> serve -> control ->
cluster -> engine -> artifacts -> placement -> model -> spec -> errors/units/names, lazily or not.
These tests show the contracts hold today and that they fail on a wrong import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--no-cache", "--config", str(root / ".importlinter")], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True,
                          text=True, timeout=120)


def test_contracts_hold():
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _with_extra_import(tmp_path: Path, module: str, code: str) -> subprocess.CompletedProcess[str]:
    """Lint a copy of the package in which ``module`` (a path under deploykit/) gained ``code``."""
    shutil.copytree(REPO / "deploykit", tmp_path / "deploykit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    target = tmp_path / "deploykit" / module
    target.write_text(target.read_text() + f"\n\ndef _extra() -> None:\n    {code}  # noqa\n")
    return _lint(tmp_path)


@pytest.mark.parametrize("module, code, broken", [
    # an upward import breaks the layers
    ("placement/planner.py", "from ..control.revisions import state",
     "deploykit.placement.planner -> deploykit.control.revisions.state"),
    # the light layers never import torch
    ("spec/manifest.py", "import torch", "deploykit.spec.manifest -> torch"),
    # the revisions and the budget never import the live deployments
    ("control/revisions/reconciler.py", "from ..live import pool",
     "deploykit.control.revisions.reconciler -> deploykit.control.live.pool"),
    ("control/budget/host.py", "from ..live import deployment",
     "deploykit.control.budget.host -> deploykit.control.live.deployment"),
])
def test_a_wrong_import_breaks_a_contract(tmp_path, module, code, broken):
    result = _with_extra_import(tmp_path, module, code)
    assert result.returncode != 0
    assert broken in result.stdout
