"""Imports point down the layers (.importlinter, run by `make test`): cli -> serve -> control ->
cluster -> engine -> artifacts -> placement -> model -> spec -> errors/units/names, lazily or not.
These tests show the contracts hold today and that they fail on a wrong import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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


def test_an_upward_import_breaks_the_layers(tmp_path):
    shutil.copytree(REPO / "deploykit", tmp_path / "deploykit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    planner = tmp_path / "deploykit" / "placement" / "planner.py"
    planner.write_text(planner.read_text() + "\n\ndef _upward() -> None:\n    from ..control import state  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "deploykit.placement.planner -> deploykit.control.state" in result.stdout


def test_the_light_layers_never_import_torch(tmp_path):
    shutil.copytree(REPO / "deploykit", tmp_path / "deploykit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    manifest = tmp_path / "deploykit" / "spec" / "manifest.py"
    manifest.write_text(manifest.read_text() + "\n\ndef _heavy() -> None:\n    import torch  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "deploykit.spec.manifest -> torch" in result.stdout
