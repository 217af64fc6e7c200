"""Imports point down the layers (style.md): cli -> server -> runtime -> reconciler -> reshard/loader ->
planner -> structure/inventory -> manifest/checkpoint/state -> units/errors. A module may import only
modules of a lower layer, lazily or not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

LAYERS = [
    {"errors", "units"},
    {"yamlsource", "safetensors_io", "fsutil"},
    {"manifest", "checkpoint", "state"},
    {"inventory", "structure"},
    {"planner"},
    {"planning", "reference", "reshard", "loader"},
    {"health"},
    {"reconciler"},
    {"differ", "watcher"},
    {"runtime"},
    {"server"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODULES = sorted(p.stem for p in (REPO / "deploykit").glob("*.py") if p.stem != "__init__")


def test_every_module_has_a_layer():
    assert sorted(RANK) == MODULES


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
    tree = ast.parse((REPO / "deploykit" / f"{module}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            targets = [node.module] if node.module else [a.name for a in node.names]
            for target in targets:
                if target.startswith("__"):  # `from . import __version__`: the package itself
                    continue
                assert RANK[target] < RANK[module], f"{module} imports {target}, a module of its layer or above"
