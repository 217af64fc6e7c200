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


# ---------------------------------------------------------------------------------------------------
# Exact plan sizes.

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _expected_bytes(model: Path, scheme: str, *, head_quantized: bool = True) -> int:
    """The bytes the model takes at float32 under ``scheme``, worked out by hand from the checkpoint's
    tensors: int8 = 1 byte per weight + a float32 scale per output row; int4 = half a byte per weight +
    a float32 scale and zero per 32 inputs of each row. The lm_head is quantized at load: an untied
    one in place of its float32 weight, a tied one as a copy beside the float32 embeddings (on disk, with
    ``head_quantized`` false, it is float32). Embeddings and norms stay float32. Buffers that are not saved (rotary frequencies) are in memory too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from deploykit.model.checkpoint import open_checkpoint

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    saved = meta.state_dict()
    total = sum(b.numel() * 4 for n, b in meta.named_buffers() if n not in saved)
    tensors = open_checkpoint(model).tensors
    if head_quantized and scheme != "none" and not any(t.name == "lm_head.weight" for t in tensors):  # tied: a quantized copy
        out, inputs = next(t.shape for t in tensors if t.name == "model.embed_tokens.weight")
        total += out * inputs + out * 4 if scheme == "int8" else out * inputs // 2 + 2 * out * (inputs // 32) * 4
    for t in tensors:
        linear = (t.name.startswith("model.layers.") and t.name.split(".")[-2] in LINEARS) or (head_quantized and t.name == "lm_head.weight")
        out, inputs = t.shape if len(t.shape) == 2 else (0, 0)
        if linear and scheme == "int8":
            total += out * inputs + out * 4
        elif linear and scheme == "int4":
            total += out * inputs // 2 + 2 * out * (inputs // 32) * 4
        else:
            total += t.nbytes // 2 * 4 if t.dtype in ("F16", "BF16") else t.nbytes
    return total


def _plan(model: Path, scheme: str, tmp_path: Path, devices: str = "cpu=8GiB", gpus: str = "[]"):
    from deploykit.placement.planning import plan_manifest

    text = _manifest(model, scheme).replace("placement: {gpus: []}", f"placement: {{gpus: {gpus}, reserve: 0}}")
    [loaded] = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    return plan_manifest(loaded, devices=devices)


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
@pytest.mark.parametrize("scheme", ["none", "int8", "int4"])
def test_plan_bytes_are_exact(tiny_model, tmp_path, name, scheme):
    model = tiny_model(name)
    plan = _plan(model, scheme, tmp_path)
    assert plan.total_bytes == _expected_bytes(model, scheme)  # a tied lm_head counted once
    assert plan.quantization == scheme
    data = plan.to_dict()
    assert data["devices"][0]["weight_bytes"] == plan.total_bytes
    assert ("quantization" in data) == (scheme != "none")


def test_quantization_changes_the_plan_digest_not_the_unquantized_one(tiny_model, tmp_path):
    from deploykit.placement.plan import plan_digest

    model = tiny_model("llama")
    none, int8, int4 = (_plan(model, s, tmp_path) for s in ("none", "int8", "int4"))
    assert none.device_map == int8.device_map == int4.device_map
    assert len({none.digest, int8.digest, int4.digest}) == 3
    assert none.digest == plan_digest("q", none.architecture, "float32", none.device_map)  # as before the field


def test_quantized_plan_balances_the_quantized_bytes(tiny_model, tmp_path):
    """Two equal GPUs split the layers by their quantized bytes; the split stays the exact optimum."""
    model = tiny_model("llama")
    plan = _plan(model, "int4", tmp_path, devices="2x1GiB", gpus="[0, 1]")
    gpu0, gpu1 = plan.devices[:2]
    assert gpu0.weight_bytes + gpu1.weight_bytes == _expected_bytes(model, "int4")
    unquantized = _plan(model, "none", tmp_path, devices="2x1GiB", gpus="[0, 1]")
    assert gpu0.weight_bytes < unquantized.devices[0].weight_bytes
    assert plan.bottleneck_factor is not None and plan.bottleneck_factor <= unquantized.bottleneck_factor + 0.2


# ---------------------------------------------------------------------------------------------------
# Laid out quantized, loaded, answered.


def _quantized_manifest(directory: Path, model: Path, scheme: str, **kwargs) -> Path:
    from manifests import write_manifest

    path = write_manifest(directory, model, **kwargs)
    path.write_text(path.read_text().replace("    dtype: float32\n",
                                             f"    dtype: float32\n    quantization: {scheme}\n"))
    return path


def _apply(manifest: Path, store, **options):
    from deploykit.control.revisions.reconciler import ApplyOptions, apply
    from deploykit.spec.manifest import load_manifests

    [loaded] = load_manifests(manifest)
    return apply(loaded, store=store, options=ApplyOptions(**options))


@pytest.fixture
def store(tmp_path):
    from deploykit.control.revisions.state import StateStore

    return StateStore(tmp_path / "state")


def _shard_tensors(directory: Path) -> dict[str, tuple[str, list[int]]]:
    from deploykit.model.safetensors_io import read_header

    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update({t.name: (t.dtype, list(t.shape)) for t in read_header(file).tensors})
    return found


def _dequantized_model(shards: Path, reference):
    """The float32 model whose weights are what the shards store, dequantized by the documented format
    (docs/quantization.md), independently of deploykit's loader. ``reference``: a checkpoint directory or
    a float32 model of the same architecture, whose weights are replaced."""
    import torch
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file

    stored: dict[str, torch.Tensor] = {}
    for file in shards.glob("*.safetensors"):
        stored.update(load_file(file))
    model = (AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32) if isinstance(reference, Path)
             else reference)
    state = model.state_dict()
    for name in list(state):
        if name + "_scale" not in stored:
            continue
        q, scale = stored[name], stored[name + "_scale"]
        if q.dtype == torch.int8:
            state[name] = q.float() * scale[:, None]
        else:
            values = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1, 32).float()
            state[name] = ((values - 8) * scale[..., None] + stored[name + "_zero"][..., None]).reshape(q.shape[0], -1)
    model.load_state_dict(state)
    scheme = next(("int8" if t.dtype == torch.int8 else "int4" for n, t in stored.items() if n.endswith("_proj.weight")
                   and t.dtype in (torch.int8, torch.uint8)), "none")
    if scheme != "none":  # the head is quantized at load, by the same documented rule (untied here)
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(_quantized_and_back(head.weight.detach(), scheme))
    return model


def _quantized_and_back(w, scheme: str):
    """``w`` [out, in] float32 through the documented format: int8 per row, int4 per group of 32."""
    import torch

    if scheme == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(w / scale).clamp(-127, 127) * scale
    groups = w.reshape(w.shape[0], -1, 32)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    scale = (high - low) / 15
    zero = low + 8 * scale
    q = torch.round((groups - zero) / scale + 8).clamp(0, 15)
    return ((q - 8) * scale + zero).reshape(w.shape)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_apply_lays_out_quantized_shards_loads_them_and_answers(model, store, tmp_path, scheme):
    import torch
    from transformers import AutoModelForCausalLM

    from deploykit.artifacts.verify import read_lock, verify
    from deploykit.engine.quantized import QuantizedLinear

    outcome = _apply(_quantized_manifest(tmp_path, model, scheme), store, keep_model=True)
    assert outcome.status == "applied" and outcome.plan.quantization == scheme
    # on disk: the documented format, every shard checksummed, the planned bytes
    tensors = _shard_tensors(outcome.shards)
    stored = "I8" if scheme == "int8" else "U8"
    assert tensors["model.layers.0.mlp.down_proj.weight"] == (stored, [64, 128 if scheme == "int8" else 64])
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"][1] == ([64] if scheme == "int8" else [64, 4])
    assert ("model.layers.0.mlp.down_proj.weight_zero" in tensors) == (scheme == "int4")
    assert tensors["model.embed_tokens.weight"] == ("F32", [256, 64])  # embeddings stay at dtype
    assert tensors["model.norm.weight"] == ("F32", [64])
    lock = read_lock(outcome.shards)
    assert lock["layout"]["quantization"] == scheme and all(s["hash"] for s in lock["shards"])
    assert verify(outcome.shards) == []
    # the plan's bytes, less unsaved buffers, with the head as stored (it is quantized at load)
    assert lock["total_size"] == _expected_bytes(model, scheme, head_quantized=False) - 64
    assert outcome.plan.total_bytes == _expected_bytes(model, scheme)
    # loaded with the quantized modules; logits are those of the stored weights; greedy answer as float32
    served = outcome.loaded.model
    assert isinstance(served.model.layers[0].mlp.down_proj, QuantizedLinear)
    ids = torch.tensor([[1, 7, 42, 100, 3, 9, 11, 200]])
    dequantized = _dequantized_model(outcome.shards, model)
    with torch.no_grad():
        got, want = served(ids).logits, dequantized(ids).logits
    assert torch.allclose(got, want, atol=0.02), (got - want).abs().max()  # kernels compute in bfloat16
    greedy = dict(max_new_tokens=8, do_sample=False)
    answer = served.generate(ids, **greedy)
    assert torch.equal(answer, dequantized.generate(ids, **greedy))
    if scheme == "int8":  # this close to float32 that the random tiny model answers the same
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        assert torch.equal(answer, reference.generate(ids, **greedy))


def test_second_apply_is_a_no_op_and_a_new_quantization_lays_out_again(model, store, tmp_path):
    first = _apply(_quantized_manifest(tmp_path, model, "int8"), store)
    mtimes = sorted(p.stat().st_mtime_ns for p in first.shards.iterdir())
    again = _apply(_quantized_manifest(tmp_path, model, "int8"), store)
    assert again.status == "unchanged" and again.revision == 1 and list(again.timings) == ["validate"]
    assert sorted(p.stat().st_mtime_ns for p in first.shards.iterdir()) == mtimes
    int4 = _apply(_quantized_manifest(tmp_path, model, "int4"), store)
    assert int4.status == "applied" and int4.revision == 2 and int4.shards != first.shards
    assert _shard_tensors(int4.shards)["model.layers.0.mlp.up_proj.weight"][0] == "U8"
    plain = _apply(_quantized_manifest(tmp_path, model, "none"), store)
    assert plain.revision == 3 and plain.shards not in (first.shards, int4.shards)
    assert _shard_tensors(plain.shards)["model.layers.0.mlp.up_proj.weight"][0] == "F32"


def test_kill_9_during_the_quantizing_reshard_then_apply_finishes(model, tmp_path):
    import os
    import signal

    from deploykit.artifacts.verify import verify
    from deploykit.control.revisions.state import StateStore

    manifest = _quantized_manifest(tmp_path, model, "int4", shard="20KiB")
    state = tmp_path / "state"
    env = {**os.environ, "DEPLOYKIT_STATE": str(state)}

    def cli(failpoint: str = "") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "deploykit.cli", "apply", str(manifest), "-q"],
                              capture_output=True, text=True, timeout=300,
                              env={**env, "DEPLOYKIT_FAILPOINT": failpoint})

    assert cli("after-shard-3").returncode == -signal.SIGKILL
    done = cli()
    assert done.returncode == 0, done.stderr
    history = StateStore(state).history("tiny")
    assert [(r.revision, r.phase) for r in history] == [(1, "Failed"), (2, "Ready")]
    shards = Path(history[-1].shards_path or "")
    assert verify(shards) == [] and not list(shards.glob("*.partial"))
    assert _shard_tensors(shards)["model.layers.3.mlp.down_proj.weight"][0] == "U8"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gguf_source_is_imported_quantized_without_a_full_precision_copy(store, tmp_path, scheme):
    """A GGUF file is imported one tensor at a time straight to quantized shards: no file anywhere in
    the state directory holds a linear weight at full precision, and the model answers from what the
    shards store."""
    import torch

    from deploykit.artifacts.gguf import import_problem, read_record
    from test_gguf import reference, write_tiny_gguf

    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    outcome = _apply(_quantized_manifest(tmp_path, gguf_file, scheme), store, keep_model=True)
    assert outcome.status == "applied"
    record = read_record(outcome.shards)  # the import, served in place: every file checksummed
    assert record is not None and import_problem(outcome.shards, record["fingerprint"], hashes=True) is None
    linears = {}
    for directory in {f.parent for f in store.directory.rglob("*.safetensors")}:
        linears.update({n: d for n, (d, _) in _shard_tensors(directory).items()
                        if n.endswith(("_proj.weight"))})
    assert len(linears) == 2 * 7 and set(linears.values()) == {"I8" if scheme == "int8" else "U8"}
    ids = torch.tensor([[1, 7, 42, 100, 3]])
    dequantized = _dequantized_model(outcome.shards, reference(gguf_file))
    with torch.no_grad():
        got, want = outcome.loaded.model(ids).logits, dequantized(ids).logits
    assert torch.allclose(got, want, atol=0.02), (got - want).abs().max()
    if scheme == "int8":
        with torch.no_grad():
            assert torch.allclose(got, reference(gguf_file)(ids).logits, atol=0.02)


def test_quantization_on_a_ray_cluster_is_refused_where_it_is_written(tmp_path):
    text = _manifest(tmp_path, "int8") + "  cluster: {address: local}\n"
    with pytest.raises(ManifestError) as err:
        parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    [issue] = err.value.issues
    assert (issue.line, issue.column, issue.field) == (8, 19, "spec.model.quantization")
    assert "not available on a Ray cluster" in issue.message


# ---------------------------------------------------------------------------------------------------
# Served like any other model.


def _chat_manifest(model: Path, scheme: str) -> str:
    from test_serve import chat_manifest

    return chat_manifest(model, strategy="blue-green").replace(
        "dtype: float32}", f"dtype: float32, quantization: {scheme}}}")


def _greedy_reference(shards: Path, model: Path, prompt: str, max_tokens: int) -> str:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = _dequantized_model(shards, model).generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                                      attention_mask=torch.ones_like(ids))
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_served_quantized_answers_and_hot_reloads_int8_to_int4_without_failures(tmp_path):
    import openai

    from chatmodel import build_chat_model
    from deploykit.control.revisions.state import StateStore
    from servers import Server
    from test_serve_reload import Streams, replace_like_an_editor, status, wait_for

    model = build_chat_model(tmp_path / "model")
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    path = manifests / "chat.yaml"
    path.write_text(_chat_manifest(model, "int8"))
    store = StateStore(tmp_path / "state")

    def answer(client: openai.OpenAI) -> str:
        return client.completions.create(model="tiny-chat", prompt="Hello there", max_tokens=10,
                                         temperature=0).choices[0].text

    with Server(manifests, tmp_path / "state") as server, Streams(server.url) as streams:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        int8 = Path(store.current("tiny-chat").shards_path or "")
        assert answer(client) == _greedy_reference(int8, model, "Hello there", 10)
        wait_for(lambda: len(streams.texts) >= 3)
        replace_like_an_editor(path, _chat_manifest(model, "int4"))
        wait_for(lambda: status(server.url)["generation"] == 2)
        served = len(streams.texts)
        wait_for(lambda: len(streams.texts) >= served + 3)
        int4 = Path(store.current("tiny-chat").shards_path or "")
        assert int4 != int8
        assert answer(client) == _greedy_reference(int4, model, "Hello there", 10)
    assert streams.failures == []


def test_acquire_yields_a_module_whose_forward_returns_logits(tmp_path):
    import torch

    from chatmodel import build_chat_model
    from deploykit.control.live.deployment import Deployment
    from deploykit.engine.quantized import QuantizedLinear

    model = build_chat_model(tmp_path / "model")
    (tmp_path / "chat.yaml").write_text(_chat_manifest(model, "int4"))
    dep = Deployment.from_manifest(tmp_path / "chat.yaml", state_dir=tmp_path / "state")
    try:
        with dep.acquire() as module:
            assert any(isinstance(m, QuantizedLinear) for m in module.modules())
            with torch.no_grad():
                logits = module(torch.tensor([[1, 2, 3, 4]])).logits
        assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
    finally:
        dep.close()


def test_reshard_command_quantizes_and_a_second_run_writes_nothing(tiny_model, tmp_path):
    from deploykit.artifacts.verify import verify

    dst = tmp_path / "dst"
    command = [sys.executable, "-m", "deploykit.cli", "reshard", str(tiny_model("llama")), str(dst),
               "--max-shard-size", "100KiB", "--quantization", "int8", "-q"]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert first.returncode == 0, first.stderr
    assert verify(dst) == []
    tensors = _shard_tensors(dst)
    assert tensors["model.layers.2.self_attn.o_proj.weight"] == ("I8", [64, 64])
    assert tensors["model.layers.2.self_attn.o_proj.weight_scale"] == ("F32", [64])
    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stderr


def test_smollm2_plan_bytes_are_its_weights_once(tmp_path):
    """SmolLM2 ties lm_head to the embeddings: the plan counts that tensor once, so its float32 bytes are
    the GGUF's parameters x 4 (plus the rotary buffers), and int8 / int4 shrink them as documented."""
    gguf = pytest.importorskip("gguf")
    from helpers import smollm2_file

    from deploykit.placement.planning import plan_manifest

    path = smollm2_file()
    reader = gguf.GGUFReader(str(path))
    parameters = sum(int(t.n_elements) for t in reader.tensors)
    assert all(t.name != "output.weight" for t in reader.tensors)  # tied: no separate lm_head
    plans = {}
    for scheme in ("none", "int8", "int4"):
        [loaded] = parse_manifests(_manifest(path, scheme).encode(), source="m.yaml", base_dir=tmp_path)
        plans[scheme] = plan_manifest(loaded).total_bytes
    assert plans["none"] == parameters * 4 + 2 * 32 * 4  # inv_freq and original_inv_freq, head_dim 64
    assert plans["int8"] <= 0.5 * plans["none"] and plans["int4"] <= 0.4 * plans["none"]


def test_quantization_with_tensor_parallel_is_refused_where_it_is_written(tmp_path):
    text = _manifest(tmp_path, "int4").replace("placement: {gpus: []}", "placement: {gpus: [], tensor_parallel: 2}")
    with pytest.raises(ManifestError) as err:
        parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    [issue] = err.value.issues
    assert (issue.line, issue.column, issue.field) == (8, 19, "spec.model.quantization")
    assert "not available with tensor_parallel" in issue.message


def _held_bytes(module) -> dict[str, int]:
    """Bytes of ``module``'s parameters and buffers per device, a tensor shared by two names counted once."""
    seen: set[tuple[str, int]] = set()
    held: dict[str, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        key = (str(t.device), t.data_ptr())
        if key not in seen:
            seen.add(key)
            held[t.device.type] = held.get(t.device.type, 0) + t.nbytes
    return held


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_bfloat16_quantized_model_holds_its_plans_bytes(tiny_model, tmp_path, store, name, scheme):
    """Loaded at bfloat16, the quantized linears hold what the plan sizes: int8 / int4 weights with scales
    and zeros at bfloat16 (as the shards store them), not at float32. Their parameters are what a GPU
    holds (the CPU's kernels repack int4 into a layout of the same size). The rotary frequencies stay
    float32, which the plan sizes at dtype."""
    import torch

    from deploykit.engine.quantized import QuantizedLinear

    manifest = _quantized_manifest(tmp_path, tiny_model(name), scheme)
    manifest.write_text(manifest.read_text().replace("dtype: float32", "dtype: bfloat16"))
    outcome = _apply(manifest, store, keep_model=True)
    model = outcome.loaded.model
    rotary = sum(b.nbytes // 2 for b in model.buffers() if b.dtype == torch.float32)
    planned = {d.tier: d.weight_bytes for d in outcome.plan.devices if d.weight_bytes}
    assert _held_bytes(model) == {"cpu": planned["cpu"] + rotary} and list(planned) == ["cpu"]
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and {m.weight_scale.dtype for m in quantized} == {torch.bfloat16}
