"""The real `deploykit` command in a subprocess, on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

MANIFEST = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: tiny
spec:
  model:
    path: {path}
    dtype: float32
  placement:
    gpus: [0, 1, 2]
    ratios: [1, 2, 2]
    reserve: 0
  offload:
    cpu: {{max_memory: 1GiB}}
"""


def deploykit(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploykit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "120", **(env or {})}, cwd=cwd or REPO, timeout=120)


@pytest.fixture
def manifest(tmp_path, tiny_model) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(MANIFEST.format(path=tiny_model("llama")))
    return path


def test_validate_ok(manifest):
    result = deploykit("validate", str(manifest))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "tiny" in result.stdout


def test_validate_reports_located_errors_and_exit_2(tmp_path, manifest):
    bad = tmp_path / "bad.yaml"
    bad.write_text(manifest.read_text().replace("dtype: float32", "dtype: fp32\n    colour: red"))
    result = deploykit("validate", str(bad), str(manifest))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"{bad}:8:12: spec.model.dtype: Input should be 'float32', 'float16' or 'bfloat16' "
        "(hint: did you mean 'float32'?)",
        f"{bad}:9:5: spec.model.colour: unknown field 'colour' "
        "(hint: allowed keys here: path, task, dtype, quantization, trust_remote_code, allow_pickle)",
    ]


def test_validate_locates_yaml_the_reader_refuses(tmp_path):
    control, deep = tmp_path / "control.yaml", tmp_path / "deep.yaml"
    control.write_text("apiVersion: deploykit/v1\n\u000e\n")
    deep.write_text("metadata: " + "[" * 900 + "]" * 900)
    result = deploykit("validate", str(control), str(deep))
    assert result.returncode == 2 and "internal error" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{control}:2:1: the file holds a character YAML does not allow (U+000E) "
        "(hint: remove it, or write it as an escape in a double-quoted string)",
        f"{deep}:1:75: invalid YAML: the document nests deeper than 64 levels"]


def test_validate_checks_the_model_directory_unless_schema_only(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST.format(path="./nowhere"))
    result = deploykit("validate", str(path))
    assert result.returncode == 2
    assert f"{path}:7:11: spec.model.path: model directory" in result.stderr
    assert deploykit("validate", "--schema-only", str(path)).returncode == 0


def test_validate_refuses_a_whitespace_padded_size_in_a_1mib_manifest_at_once(tmp_path, manifest):
    padded = tmp_path / "padded.yaml"
    text = manifest.read_text() + '  sharding: {max_shard_size: "1%s#"}\n'
    padded.write_text(text % (" " * (2**20 - len(text) - 8)))
    assert 2**20 - 16 < padded.stat().st_size <= 2**20
    started = time.monotonic()
    result = deploykit("validate", "--schema-only", str(padded))  # before: quadratic, most of an hour
    seconds = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"{padded}:15:30: spec.sharding.max_shard_size: a size is at most 64 characters")
    assert len(line) < 400  # the value is quoted by its start, not in full
    assert seconds < 20, seconds  # a process start and an import; the refusal itself takes microseconds


def test_validate_refuses_aliases_that_expand_past_a_manifest_s_size(tmp_path, manifest):
    aliased = tmp_path / "aliased.yaml"
    labels = f'  labels:\n    big: &big "{"x" * 50_000}"\n' + "".join(f"    l{i}: *big\n" for i in range(30))
    aliased.write_text(manifest.read_text().replace("  name: tiny\n", "  name: tiny\n" + labels))
    result = deploykit("validate", "--schema-only", str(aliased))
    assert result.returncode == 2, result.stdout
    assert result.stderr.strip().splitlines() == [
        f"{aliased}:6:10: the document expands to more than 1048576 characters of keys and values (an alias "
        "repeats its value in full each time) (hint: write the values out instead of nesting aliases)"]


@pytest.mark.parametrize("content", [b"", b"\x00\x01binary", b"\xff\xfe\x00x", b"a: [unclosed\n", b"- 1\n"])
def test_bad_input_never_shows_a_traceback(tmp_path, content):
    path = tmp_path / "x.yaml"
    path.write_bytes(content)
    result = deploykit("validate", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and str(path) in result.stderr


def test_missing_file_exit_2():
    result = deploykit("validate", "/no/such/manifest.yaml")
    assert result.returncode == 2 and "no such file" in result.stderr


def test_plan_json_on_simulated_gpus(manifest):
    result = deploykit("plan", str(manifest), "--devices", "3x1GiB", "--output", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert list(data)[:5] == ["name", "digest", "device_map", "devices", "bottleneck_factor"]
    assert data["device_map"]["model.embed_tokens"] == 0
    assert set(data["device_map"].values()) == {0, 1, 2}
    assert [d["device"] for d in data["devices"]] == [0, 1, 2, "cpu"]
    assert data["bottleneck_factor"] >= 1.0


def test_plan_table_and_env_inventory(manifest):
    result = deploykit("plan", str(manifest), env={"DEPLOYKIT_DEVICES": "3x1GiB"})
    assert result.returncode == 0, result.stderr
    assert "cuda:0" in result.stdout and "model.layers." in result.stdout
    assert "bottleneck factor" in result.stdout


def test_plan_infeasible_is_located_and_exit_1(manifest):
    text = manifest.read_text().replace("max_memory: 1GiB", "max_memory: 1KiB")
    manifest.write_text(text)
    result = deploykit("plan", str(manifest), "--devices", "3x100KiB")
    assert result.returncode == 1
    assert f"{manifest}:13:3: spec.offload: the model needs" in result.stderr
    result = deploykit("plan", str(manifest), "--devices", "1x1GiB")
    assert result.returncode == 1 and "GPU 1, 2 not in the inventory" in result.stderr
    assert f"{manifest}:10:11: spec.placement.gpus" in result.stderr


def test_plan_bad_device_spec(manifest):
    result = deploykit("plan", str(manifest), "--devices", "3y1GiB")
    assert result.returncode == 1 and "cannot read device spec" in result.stderr


def test_schema_is_json_schema():
    result = deploykit("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert schema["required"] == ["apiVersion", "kind", "metadata", "spec"]
    assert schema["additionalProperties"] is False


def test_docs_manifest_reference_is_current():
    from deploykit.spec.reference import render

    on_disk = (REPO / "docs" / "manifest.md").read_text()
    assert on_disk == render(), "docs/manifest.md is stale: run `make docs`"
    schema_file = json.loads((REPO / "docs" / "deploykit-v1.schema.json").read_text())
    from deploykit.spec.manifest import json_schema

    assert schema_file == json_schema(), "docs/deploykit-v1.schema.json is stale: run `make docs`"


def test_shipped_manifests_validate():
    files = sorted(str(p) for p in (REPO / "manifests").glob("*.yaml"))
    result = deploykit("validate", "--schema-only", *files)
    assert result.returncode == 0, result.stderr


def test_validate_does_not_import_torch(manifest):
    code = ("import sys\nfrom deploykit import cli\n"
            f"try:\n    cli.main(['validate', {str(manifest)!r}])\nexcept SystemExit as e:\n    code = e.code\n"
            "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip().splitlines()[-1] == "0 False False"


def test_reshard_and_verify_commands(tiny_model, tmp_path):
    dst = tmp_path / "out"
    result = deploykit("reshard", str(tiny_model("llama")), str(dst), "--max-shard-size", "50KiB")
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "shards" in result.stdout
    assert "larger than max_shard_size" in result.stderr  # the embedding gets its own shard
    again = deploykit("reshard", str(tiny_model("llama")), str(dst), "--max-shard-size", "50KiB", "-q")
    assert again.returncode == 0 and "up to date" in again.stdout
    assert deploykit("verify", str(dst)).returncode == 0
    (dst / "config.json").write_text("{}")
    bad = deploykit("verify", str(dst))
    assert bad.returncode == 1 and "config.json: missing or modified" in bad.stderr


def test_reshard_bad_input_is_an_error_not_a_traceback(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    result = deploykit("reshard", str(src), str(tmp_path / "dst"), "--max-shard-size", "1GiB")
    assert result.returncode == 1
    assert "corrupt safetensors header" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "dst").exists()
    result = deploykit("reshard", str(src), str(tmp_path / "dst"), "--max-shard-size", "1XB")
    assert result.returncode == 2 and "max-shard-size" in result.stderr
