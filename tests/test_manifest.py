"""Manifest loading: one test per class of error, each checking file, line, column and field."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploykit.errors import ManifestError
from deploykit.spec.manifest import check_on_host, load_manifests, parse_manifests

VALID = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: llama-chat
spec:
  model:
    path: ./models/llama
    task: causal-lm
    dtype: float16
    trust_remote_code: false
  placement:
    gpus: [0, 1, 2, 3]
    ratios: [0.5, 1, 1, 1]
    reserve: 2GiB
    embeddings: first
  sharding:
    max_shard_size: 2GiB
    path: ./shards/llama
  offload:
    cpu: {max_memory: 32GiB}
    disk: {path: ./offload, max_size: 200GiB}
  rollout:
    strategy: auto
    health_check: {input: "Hello", timeout: 120s}
"""


def parse(text: str | bytes, name: str = "m.yaml"):
    data = text.encode() if isinstance(text, str) else text
    return parse_manifests(data, source=name, base_dir=Path("/base"))


def issues_of(text: str | bytes):
    with pytest.raises(ManifestError) as info:
        parse(text)
    return info.value.issues


def edit(old: str, new: str) -> str:
    assert old in VALID, old
    return VALID.replace(old, new, 1)


def test_valid_manifest_parses_with_units_and_paths():
    [loaded] = parse(VALID)
    spec = loaded.manifest.spec
    assert loaded.name == "llama-chat"
    assert spec.placement.reserve == 2 * 2**30
    assert spec.offload.disk.max_size == 200 * 2**30
    assert spec.rollout.health_check.timeout == 120.0
    assert loaded.model_path == Path("/base/models/llama")
    assert loaded.locate("spec.placement.ratios") == (13, 13)


def test_defaults_are_sensible():
    [loaded] = parse("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: m}\n"
                     "spec:\n  model: {path: /m}\n")
    spec = loaded.manifest.spec
    assert spec.model.task == "causal-lm" and spec.model.dtype == "float16"
    assert spec.model.trust_remote_code is False
    assert spec.placement.gpus == [] and spec.placement.embeddings == "first"
    assert spec.offload.cpu is not None and spec.offload.disk is None


# (edit, line, column, field, message fragment, hint fragment)
CASES = [
    pytest.param(("max_shard_size: 2GiB", "max_shard_sze: 2GiB"), 17, 5, "spec.sharding.max_shard_sze",
                 "unknown field", "did you mean 'max_shard_size'?", id="unknown-key-typo"),
    pytest.param(("  rollout:", "  rolout:"), 22, 3, "spec.rolout", "unknown field", "did you mean 'rollout'",
                 id="unknown-key-top"),
    pytest.param(("name: llama-chat", "name: llama-chat\n  colour: red"), 5, 3, "metadata.colour",
                 "unknown field", "allowed keys here", id="unknown-key-no-close-match"),
    pytest.param(("ratios: [0.5, 1, 1, 1]", "ratios: [0.5, 1, 1]"), 13, 13, "spec.placement.ratios",
                 "3 ratios for 4 GPUs", None, id="ratios-length"),
    pytest.param(("ratios: [0.5, 1, 1, 1]", "ratios: [0, 0, 0, 0]"), 13, 13, "spec.placement.ratios",
                 "greater than 0", None, id="ratios-all-zero"),
    pytest.param(("ratios: [0.5, 1, 1, 1]", "ratios: [1, -1, 1, 1]"), 13, 17, "spec.placement.ratios.1",
                 "greater than or equal to 0", None, id="ratio-negative"),
    pytest.param(("ratios: [0.5, 1, 1, 1]", "ratios: [0, 1, 1, 1]"), 13, 13, "spec.placement.ratios",
                 "embeddings", None, id="ratio-first-zero"),
    pytest.param(("gpus: [0, 1, 2, 3]", "gpus: [0, 1, 1, 3]"), 12, 11, "spec.placement.gpus",
                 "listed more than once", None, id="gpu-duplicate"),
    pytest.param(("gpus: [0, 1, 2, 3]", "gpus: some"), 12, 11, "spec.placement.gpus", "", None,
                 id="gpus-bad-string"),
    pytest.param(("max_shard_size: 2GiB", "max_shard_size: 2XB"), 17, 21, "spec.sharding.max_shard_size",
                 "unknown size unit 'XB'", None, id="size-unit"),
    pytest.param(("max_shard_size: 2GiB", "max_shard_size: 0"), 17, 21, "spec.sharding.max_shard_size",
                 "greater than 0", None, id="size-zero"),
    pytest.param(("timeout: 120s", "timeout: soon"), 24, 45, "spec.rollout.health_check.timeout",
                 "duration", None, id="duration"),
    pytest.param(("task: causal-lm", "task: causal-llm"), 8, 11, "spec.model.task", "Input should be",
                 "did you mean 'causal-lm'?", id="task-typo"),
    pytest.param(("dtype: float16", "dtype: fp16"), 9, 12, "spec.model.dtype", "float32", None,
                 id="dtype"),
    pytest.param(("trust_remote_code: false", "trust_remote_code: yes"), 10, 24,
                 "spec.model.trust_remote_code", "valid boolean", None, id="bool-strict-yes"),
    pytest.param(("trust_remote_code: false", 'trust_remote_code: "false"'), 10, 24,
                 "spec.model.trust_remote_code", "valid boolean", None, id="bool-strict-string"),
    pytest.param(("name: llama-chat", "name: Llama_Chat"), 4, 9, "metadata.name", "not a valid name",
                 None, id="name-dns"),
    pytest.param(("name: llama-chat", "name: " + "a" * 64), 4, 9, "metadata.name", "not a valid name",
                 None, id="name-too-long"),
    pytest.param(("name: llama-chat", 'name: "llama-chat\\n"'), 4, 9, "metadata.name", "not a valid name",
                 None, id="name-trailing-newline"),
    pytest.param(("strategy: auto", "strategy: rolling"), 23, 15, "spec.rollout.strategy",
                 "Input should be", None, id="strategy"),
    pytest.param(("    path: ./models/llama\n", ""), 6, 3, "spec.model.path", "required field 'path'",
                 None, id="missing-field"),
    pytest.param(("apiVersion: deploykit/v1", "apiVersion: apps/v1"), 1, 13, "apiVersion",
                 "expected 'deploykit/v1'", None, id="api-version"),
    pytest.param(("kind: ModelDeployment", "kind: Deployment"), 2, 7, "kind", "expected 'ModelDeployment'",
                 None, id="kind"),
    pytest.param(("embeddings: first", "embeddings: last"), 15, 17, "spec.placement.embeddings",
                 "Input should be", None, id="embeddings"),
]


@pytest.mark.parametrize("change,line,column,field,message,hint", CASES)
def test_error_is_located(change, line, column, field, message, hint):
    [issue] = issues_of(edit(*change))
    assert (issue.path, issue.line, issue.column, issue.field) == ("m.yaml", line, column, field), str(issue)
    assert message in issue.message
    if hint:
        assert hint in (issue.hint or "")
    assert str(issue).startswith(f"m.yaml:{line}:{column}: {field}: ")


def test_all_errors_of_a_file_are_reported_at_once():
    text = edit("max_shard_size: 2GiB", "max_shard_sze: 2GiB")
    text = text.replace("dtype: float16", "dtype: fp8").replace("name: llama-chat", "name: X")
    issues = issues_of(text)
    assert [i.field for i in issues] == ["metadata.name", "spec.model.dtype", "spec.sharding.max_shard_sze"]


def test_duplicate_keys_are_errors_and_other_errors_still_reported():
    text = edit("  rollout:", "  placement: {}\n  rollout:").replace("dtype: float16", "dtype: fp8")
    issues = issues_of(text)
    dup = next(i for i in issues if "duplicate key" in i.message)
    assert (dup.line, dup.column, dup.field) == (22, 3, "spec.placement")
    assert "first defined at line 11" in dup.message
    assert any(i.field == "spec.model.dtype" for i in issues)


def test_unclosed_quote_points_at_the_line_it_opens_on():
    text = edit('input: "Hello"', 'input: "Hello')
    [issue] = issues_of(text)
    assert issue.line == 24 and "quoted scalar" in issue.message


def test_bad_indentation_points_at_the_problem_line():
    text = edit("    dtype: float16", "   dtype: float16")
    [issue] = issues_of(text)
    assert issue.line == 9 and issue.message.startswith("invalid YAML")


@pytest.mark.parametrize("data,fragment", [
    (b"", "empty"), (b"   \n\n", "empty"), (b"# only a comment\n", "no YAML document"),
    (b"\x00\x01\x02binary", "binary"), (b"name: caf\xe9\n", "not valid UTF-8"),
    (b"- a\n- b\n", "must be a mapping, found list"), (b"just text\n", "must be a mapping, found str"),
])
def test_unreadable_inputs(data, fragment):
    issues = issues_of(data)
    assert fragment in issues[0].message
    assert issues[0].line == 1


def test_alias_bomb_is_refused_fast():
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    start = time.perf_counter()
    [issue] = issues_of("\n".join(lines) + "\n")
    assert time.perf_counter() - start < 2  # 9**9 values if expanded
    assert "alias bomb" in issue.message


def aliased_labels(value_size: int, uses: int) -> str:
    """A valid manifest whose one label of ``value_size`` characters is repeated ``uses`` times by aliases."""
    labels = f'    big: &big "{"x" * value_size}"\n' + "".join(f"    l{i}: *big\n" for i in range(uses))
    return VALID.replace("  name: llama-chat\n", "  name: llama-chat\n  labels:\n" + labels)


def test_aliases_are_counted_in_bytes_not_only_in_values():
    text = aliased_labels(50_000, 30)  # 52 KB of file, 1.5 MB of labels once expanded
    assert len(text) < 60_000
    started = time.perf_counter()
    [issue] = issues_of(text)
    assert time.perf_counter() - started < 2
    assert issue.message.startswith("the document expands to more than 1048576 characters of keys and values")
    assert (issue.path, issue.line) == ("m.yaml", 6)  # the anchored value the aliases repeat
    [loaded] = parse(aliased_labels(50_000, 15))  # 0.8 MB expanded: allowed, and written out in full once
    assert len(loaded.text) > 15 * 50_000 and loaded.text is loaded.text


def test_recursive_alias_is_refused():
    [issue] = issues_of("a: &a [*a]\n")
    assert "alias bomb" in issue.message


@pytest.mark.parametrize("text, line, column, fragment", [
    ("apiVersion: deploykit/v1\n\u000e\n", 2, 1, "a character YAML does not allow (U+000E)"),
    ("apiVersion: deploykit/v1\nkind: \"a\u0007\"\n", 2, 9, "a character YAML does not allow (U+0007)"),
    ("metadata: " + "[" * 900 + "]" * 900, 1, 75, "nests deeper than 64 levels"),
    ("a:\n" + "".join(" " * i + "- \n" for i in range(1, 400)), 66, 66, "nests deeper than 64 levels"),
])
def test_yaml_the_reader_refuses_is_a_located_error(text, line, column, fragment):
    [issue] = issues_of(text)
    assert fragment in issue.message and (issue.line, issue.column) == (line, column)


def test_oversized_file_is_refused():
    [issue] = issues_of(b"a: " + b"x" * (2 << 20))
    assert "at most" in issue.message


def test_several_documents_and_duplicate_names():
    second = VALID.replace("name: llama-chat", "name: other")
    loaded = parse(VALID + "---\n" + second + "---\n")
    assert [m.name for m in loaded] == ["llama-chat", "other"]
    assert loaded[1].locate("metadata.name") == (4 + VALID.count("\n") + 1, 9)
    issues = issues_of(VALID + "---\n" + VALID)
    assert "already used" in issues[0].message and issues[0].line == VALID.count("\n") + 5


def test_errors_in_second_document_have_file_lines():
    bad = VALID.replace("dtype: float16", "dtype: fp8")
    [issue] = issues_of(VALID.replace("name: llama-chat", "name: a") + "---\n" + bad)
    assert issue.line == VALID.count("\n") + 1 + 9


def test_load_manifests_from_file_and_missing_file(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(VALID)
    [loaded] = load_manifests(path)
    assert loaded.model_path == tmp_path / "models" / "llama"
    with pytest.raises(ManifestError, match="no such file"):
        load_manifests(tmp_path / "missing.yaml")
    with pytest.raises(ManifestError, match="directory"):
        load_manifests(tmp_path)


def test_host_checks_find_missing_model_dir_and_config(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text(VALID)
    [loaded] = load_manifests(path)
    [issue] = check_on_host(loaded)
    assert issue.field == "spec.model.path" and issue.line == 7 and "does not exist" in issue.message
    (tmp_path / "models" / "llama").mkdir(parents=True)
    [issue] = check_on_host(loaded)
    assert "no config.json" in issue.message
    (tmp_path / "models" / "llama" / "config.json").write_text("{}")
    assert check_on_host(loaded) == []


def test_manifest_is_immutable():
    [loaded] = parse(VALID)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        loaded.manifest.spec.model.dtype = "float32"  # type: ignore[misc]
