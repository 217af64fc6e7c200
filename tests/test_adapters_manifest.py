"""spec.adapters: validated from the files alone (real PEFT adapters trained in the test), located at the
field with file and line; the fields deploykit cannot serve adapters with are refused, never ignored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from deploykit.errors import ManifestError
from deploykit.spec.manifest import check_on_host, load_manifests

HEAD = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata:
  name: chat
spec:
  model:
    path: {base}
    dtype: float32
"""


def _write(tmp_path: Path, base: Path, adapters: list[tuple[str, Path]], extra: str = "") -> Path:
    text = HEAD.format(base=base) + extra + "  adapters:\n"
    for name, path in adapters:
        text += f"    - name: {name}\n      path: {path}\n"
    file = tmp_path / "chat.yaml"
    file.write_text(text)
    return file


def _issues(file: Path) -> list[Any]:
    [loaded] = load_manifests(file)
    return check_on_host(loaded)


def test_adapters_made_for_the_base_are_valid_and_relative_paths_resolve(lora: Any, tmp_path: Path) -> None:
    shutil.copytree(lora.pirate, tmp_path / "pirate")
    file = _write(tmp_path, lora.base, [("pirate", Path("pirate")), ("polite", lora.polite)])
    assert _issues(file) == []
    [loaded] = load_manifests(file)
    assert f"path: {(tmp_path / 'pirate').resolve()}" in loaded.text  # the recorded revision names it absolutely


def test_an_adapter_for_another_architecture_or_size_is_refused_at_its_path(lora: Any, tmp_path: Path) -> None:
    file = _write(tmp_path, lora.base, [("pirate", lora.pirate), ("gpt", lora.gpt2), ("narrow", lora.narrow)])
    issues = _issues(file)
    assert [(i.field, i.line) for i in issues] == [("spec.adapters.1.path", 13), ("spec.adapters.2.path", 15)]
    assert "'transformer.h.0.attn.c_attn', which the base model does not have" in issues[0].message
    assert "do not fit the base's weight" in issues[1].message


def test_missing_and_non_lora_directories_are_refused(lora: Any, tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    shutil.copy(lora.pirate / "adapter_config.json", tmp_path / "half")
    file = _write(tmp_path, lora.base, [("gone", tmp_path / "nowhere"), ("half", tmp_path / "half")])
    issues = _issues(file)
    assert [i.field for i in issues] == ["spec.adapters.0.path", "spec.adapters.1.path"]
    assert "does not exist" in issues[0].message
    assert "has no adapter_model.safetensors" in issues[1].message


@pytest.mark.parametrize(("change", "said"), [
    ({"use_dora": True}, "DoRA"), ({"r": 512}, "rank 512"), ({"peft_type": "IA3"}, "not a LoRA adapter"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    # inits that rewrite the base's weights at injection (peft's LoraLayer.update_layer)
    *(({"init_lora_weights": init}, f"init_lora_weights {init!r} rewrites the base model's weights")
      for init in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga", "mica")),
    # the config and the tensors disagree: peft would size the layers by the config, or leave them random
    ({"r": 8}, "has rank 4, but adapter_config.json gives this module rank 8 (r)"),
    ({"rank_pattern": {"q_proj": 2}}, "has rank 4, but adapter_config.json gives this module rank 2 (rank_pattern"),
    ({"target_modules": ["q_proj", "v_proj"]}, "which target_modules ['q_proj', 'v_proj'] does not name"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}, "for which the adapter holds no weights"),
    ({"target_modules": ["q_proj", "v_proj", "down_proj"], "layers_to_transform": [0]}, "does not name"),
    ({"target_modules": "(q_proj"}, "not a regular expression"),
])
def test_what_deploykit_does_not_serve_is_refused(lora: Any, tmp_path: Path, change: dict[str, Any],
                                                  said: str) -> None:
    changed = Path(shutil.copytree(lora.pirate, tmp_path / "changed"))
    config = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, **change}))
    [issue] = _issues(_write(tmp_path, lora.base, [("changed", changed)]))
    assert issue.field == "spec.adapters.0.path" and said in issue.message


@pytest.mark.parametrize("change", [{"init_lora_weights": False}, {"init_lora_weights": "gaussian"},
                                    {"target_modules": "model.*(q_proj|v_proj|down_proj)"},
                                    {"rank_pattern": {"q_proj": 4}}, {"target_modules": "all-linear"}])
def test_inits_that_leave_the_base_alone_and_agreeing_targets_are_valid(lora: Any, tmp_path: Path,
                                                                        change: dict[str, Any]) -> None:
    changed = Path(shutil.copytree(lora.pirate, tmp_path / "changed"))
    config = json.loads((changed / "adapter_config.json").read_text())
    (changed / "adapter_config.json").write_text(json.dumps({**config, **change}))
    assert _issues(_write(tmp_path, lora.base, [("changed", changed)])) == []


def test_a_base_without_safetensors_is_refused_with_the_reason(lora: Any, tmp_path: Path) -> None:
    """Pickle weights (and a GGUF file): the adapters cannot be checked against them from headers, so they are
    refused for what they are, not as adapters "made for another model"."""
    import torch
    from safetensors.torch import load_file

    base = tmp_path / "bin-base"
    shutil.copytree(lora.base, base)
    torch.save(load_file(base / "model.safetensors"), base / "pytorch_model.bin")
    (base / "model.safetensors").unlink()
    text = _write(tmp_path, base, [("pirate", lora.pirate)]).read_text()
    file = tmp_path / "chat.yaml"
    file.write_text(text.replace("    dtype: float32\n", "    dtype: float32\n    allow_pickle: true\n"))
    issues = _issues(file)
    assert [i.field for i in issues] == ["spec.model.path"], issues
    assert "served on safetensors checkpoints only" in issues[0].message
    assert "another model" not in issues[0].message


def test_duplicate_and_invalid_names_are_refused_at_the_name(lora: Any, tmp_path: Path) -> None:
    with pytest.raises(ManifestError) as err:
        load_manifests(_write(tmp_path, lora.base, [("pirate", lora.pirate), ("pirate", lora.polite)]))
    [issue] = err.value.issues
    assert (issue.field, issue.line) == ("spec.adapters.1.name", 12)
    assert "already used by spec.adapters[0]" in issue.message
    for bad in ("chat:pirate", '"pirate\\n"'):  # a trailing newline too ("$" would take it)
        with pytest.raises(ManifestError) as err:
            load_manifests(_write(tmp_path, lora.base, [(bad, lora.pirate)]))
        assert err.value.issues[0].field == "spec.adapters.0.name", bad


@pytest.mark.parametrize(("extra", "field", "said"), [
    ("  engine:\n    name: llama.cpp\n", "spec.engine.name", "transformers engine only"),
    ("  placement:\n    tensor_parallel: 2\n", "spec.placement.tensor_parallel", "tensor-parallel ranks"),
    ("  cluster:\n    address: local\n", "spec.cluster", "Ray replicas or pipeline stages"),
    ("  serving:\n    batching: continuous\n", "spec.serving.batching", "padded batch loop"),
    ("  rollout:\n    strategy: canary\n", "spec.rollout.strategy", "not canaried"),
])
def test_fields_adapters_cannot_be_served_with_are_refused_there(lora: Any, tmp_path: Path, extra: str, field: str,
                                                                 said: str) -> None:
    with pytest.raises(ManifestError) as err:
        load_manifests(_write(tmp_path, lora.base, [("pirate", lora.pirate)], extra))
    assert [(i.field, said in i.message) for i in err.value.issues] == [(field, True)], err.value.issues


def test_a_quantized_base_is_refused_at_quantization(lora: Any, tmp_path: Path) -> None:
    file = _write(tmp_path, lora.base, [("pirate", lora.pirate)])
    file.write_text(file.read_text().replace("    dtype: float32\n", "    dtype: float32\n    quantization: int8\n"))
    with pytest.raises(ManifestError) as err:
        load_manifests(file)
    assert [i.field for i in err.value.issues] == ["spec.model.quantization"]


def test_deploykit_validate_says_file_line_and_field(lora: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from deploykit.cli import main

    file = _write(tmp_path, lora.base, [("pirate", lora.pirate), ("gpt", lora.gpt2)])
    result = CliRunner().invoke(main, ["validate", str(file)])
    assert result.exit_code == 2, result.output
    assert f"{file}:13:13: spec.adapters.1.path: adapter 'gpt'" in result.output.replace("\n", "")


def test_the_kv_room_is_what_the_adapters_leave(lora: Any, tmp_path: Path) -> None:
    """The adapters' bytes are on the devices of the layers they adapt, beside the weights: the KV cache
    the running batch may take there (``kv_budget``, what the engine's cache is sized to) is that much less."""
    from dataclasses import replace

    from deploykit.placement.kv import kv_budget, kv_shares
    from deploykit.placement.planning import plan_manifest

    [loaded] = load_manifests(_write(tmp_path, lora.base, [("pirate", lora.pirate), ("polite", lora.polite)]))
    plan = plan_manifest(loaded, devices="cpu=64MiB")
    assert plan.adapters and all(device == "cpu" for a in plan.adapters for device, _ in a.devices)
    without = kv_budget(replace(plan, adapters=()))
    assert without is not None
    adapters, share = sum(a.bytes for a in plan.adapters), kv_shares(plan)["cpu"]
    room = kv_budget(plan)
    assert room is not None and abs(room - (without - adapters / share)) <= 1  # rounding to whole bytes
