"""spec.engine: the field, the digest of manifests that never name it, and every refusal located at the
field llama.cpp cannot honour; a llama.cpp manifest whose model is not a GGUF file or whose binary does not
run is refused by `deploykit validate` (no weights read, no server started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deploykit.errors import ManifestError
from deploykit.spec.manifest import parse_manifests

HEADER = "apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: q}\nspec:\n  model:\n    path: m.gguf\n"


def parsed(text: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    [loaded] = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    return loaded


def test_a_manifest_without_an_engine_keeps_its_digest(tmp_path):
    plain = parsed(HEADER, tmp_path)
    named = parsed(HEADER + "  engine:\n    name: transformers\n", tmp_path)
    llama = parsed(HEADER + "  engine:\n    name: llama.cpp\n", tmp_path)
    assert plain.manifest.spec.engine.name == "transformers"
    assert "engine" not in plain.text and plain.digest == named.digest
    # the digest is the sha256 of the normalised YAML: the text before spec.engine existed
    assert plain.text == ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata:\n  name: q\n  labels: {}\nspec:\n"
                          + plain.text.split("spec:\n", 1)[1])
    assert llama.digest != plain.digest and "name: llama.cpp" in llama.text
    # a revision records the normalised text (every default named) and loads it again: still valid, same digest
    assert parsed(llama.text, tmp_path).digest == llama.digest


@pytest.mark.parametrize("extra, field, words", [
    ("    quantization: int8\n  engine: {name: llama.cpp}\n", "spec.model.quantization", "GGUF's tensor types"),
    ("    task: feature-extraction\n  engine: {name: llama.cpp}\n", "spec.model.task", "causal-lm models only"),
    ("  engine: {name: llama.cpp}\n  placement: {tensor_parallel: 2}\n", "spec.placement.tensor_parallel", "--tensor-split"),
    ("  engine: {name: llama.cpp}\n  placement: {nodes: 2}\n", "spec.placement.nodes", "one host"),
    ("  engine: {name: llama.cpp}\n  replicas: 2\n", "spec.replicas", "set replicas to 1"),
    ("  engine: {name: llama.cpp}\n  cluster: {address: local}\n", "spec.cluster", "not on a Ray cluster"),
    ("  engine: {name: llama.cpp}\n  serving: {batching: continuous}\n", "spec.serving.batching", "batches its slots"),
    ("  engine: {name: llama.cpp}\n  serving: {max_concurrent: 4}\n", "spec.serving.max_concurrent", "spec.engine.slots"),
    ("  engine: {name: llama.cpp, context: 256}\n  serving: {max_tokens: 300}\n", "spec.serving.max_tokens", "no room"),
    ("  engine: {slots: 3}\n", "spec.engine.slots", "option of the llama.cpp engine"),
    ("  engine: {name: llama.cpp}\n  serving: {prefix_cache: {max_bytes: 8MiB}}\n", "spec.serving.prefix_cache.max_bytes",
     "its slots' own prompts"),
])
def test_what_llama_cpp_cannot_honour_is_refused_at_the_field(tmp_path, extra, field, words):
    with pytest.raises(ManifestError) as err:
        parsed(HEADER + extra, tmp_path)
    [issue] = err.value.issues
    assert issue.field == field and words in issue.message, str(issue)
    key = field.rsplit(".", 1)[-1]
    line = (HEADER + extra).splitlines()[issue.line - 1]
    assert key in line, (issue.line, line)  # located at the field's own line


def _validate(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "deploykit.cli", "validate", str(path)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=60)


def test_validate_refuses_a_directory_and_a_binary_that_does_not_run(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "a.yaml").write_text(HEADER.replace("m.gguf", "dir") + "  engine: {name: llama.cpp}\n")
    result = _validate(tmp_path / "a.yaml", {"DEPLOYKIT_LLAMA_SERVER": "/bin/true"})
    assert result.returncode == 2
    assert "a.yaml:6:11: spec.model.path: the llama.cpp engine serves a GGUF file" in result.stderr, result.stderr

    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(64))
    broken = tmp_path / "llama-server"
    broken.write_text("#!/bin/sh\nkill -ILL $$\n")
    broken.chmod(0o755)
    (tmp_path / "b.yaml").write_text(HEADER + "  engine: {name: llama.cpp, binary: llama-server}\n")
    result = _validate(tmp_path / "b.yaml", {})
    assert result.returncode == 2
    assert "spec.engine.binary: llama-server" in result.stderr and "SIGILL" in result.stderr, result.stderr

    (tmp_path / "c.yaml").write_text(HEADER + "  engine: {name: llama.cpp}\n")
    result = _validate(tmp_path / "c.yaml", {"DEPLOYKIT_LLAMA_SERVER": str(tmp_path / "nowhere")})
    assert result.returncode == 2
    assert "spec.engine.name: llama-server" in result.stderr and "$DEPLOYKIT_LLAMA_SERVER" in result.stderr
