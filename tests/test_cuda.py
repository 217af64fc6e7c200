"""GPU code paths. They run only where CUDA exists (skipped otherwise, see conftest)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from deploykit.spec.manifest import load_manifests
from deploykit.control.revisions.reconciler import ApplyOptions, apply
from deploykit.control.revisions.state import StateStore
from manifests import manifest_text

CUBLAS_WORKSPACE = 32 << 20  # cuBLAS's default workspace on Hopper (CUBLAS_WORKSPACE_CONFIG :4096:8), per thread

pytestmark = pytest.mark.cuda


def test_gpu_plan_with_cpu_and_disk_tiers_loads_and_matches(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model = Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))
    text = manifest_text(model, cpu=150_000).replace("gpus: []", "gpus: [0]\n    reserve: 0")
    path = tmp_path / "gpu.yaml"
    path.write_text(text)
    [loaded] = load_manifests(path)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    # a GPU budget of a third of the model: the rest goes to CPU, then disk
    outcome = apply(loaded, store=StateStore(tmp_path / "state"),
                    options=ApplyOptions(keep_model=True, devices=f"1x{size // 3}"))
    assert {0, "cpu", "disk"} <= set(outcome.plan.device_map.values())
    assert outcome.loaded.serialize_forward and outcome.loaded.input_device == "cuda:0"
    ids = torch.tensor([[1, 7, 42, 100, 3]])
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(ids).logits
        got = outcome.loaded.model(ids.to("cuda:0")).logits.cpu()
    assert torch.allclose(expected, got, atol=1e-4)
    # the GPU holds the plan's GPU blocks, and the model reports the plan's placement
    gpu_bytes = next(d.bytes for d in outcome.plan.devices if d.device == 0)
    assert torch.cuda.memory_allocated(0) >= gpu_bytes
    assert outcome.loaded.model.hf_device_map == outcome.plan.device_map


def test_real_inventory_probe_sees_the_gpus():
    from deploykit.placement.inventory import probe

    inventory = probe()
    assert len(inventory.gpus) == torch.cuda.device_count()
    assert all(g.memory > 0 for g in inventory.gpus)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_on_cuda_equals_its_dequantized_weights(scheme):
    from deploykit.engine.quantized import QuantizedLinear

    torch.manual_seed(0)
    layer = QuantizedLinear(64, 48, bias=True, scheme=scheme, dtype=torch.bfloat16)
    with torch.no_grad():
        low, high = (-127, 128) if scheme == "int8" else (0, 256)
        layer.weight.copy_(torch.randint(low, high, layer.weight.shape).to(layer.weight.dtype))
        for name in ("weight_scale", "weight_zero", "bias"):
            if getattr(layer, name, None) is not None:
                getattr(layer, name).copy_(torch.randn(getattr(layer, name).shape) / 10)
    layer = layer.to("cuda:0")
    x = torch.randn(5, 64, dtype=torch.bfloat16, device="cuda:0")
    expected = torch.nn.functional.linear(x.float(), layer.dequantized(torch.float32), layer.bias.float())
    layer.prepare()  # the CUDA kernels' forms (int4: tinygemm's tiles), replacing the stored ones
    assert layer.kernel is not None and layer.kernel.name == {"int8": "int8-convert", "int4": "tinygemm"}[scheme]
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.device.type == "cuda"
    assert (got.float() - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_on_cuda_holds_the_plans_bytes(scheme):
    from deploykit.engine.quantized import QuantizedLinear
    from deploykit.model.quantization import quantized_nbytes

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    with torch.device("cuda:0"):
        layer = QuantizedLinear(2048, 8192, bias=False, scheme=scheme, dtype=torch.bfloat16)
    layer.prepare()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(0) - before == quantized_nbytes((8192, 2048), scheme, "bfloat16")


def test_closing_a_gpu_deployment_returns_its_gpu_memory(tiny_model, tmp_path):
    from deploykit import Deployment

    model = Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))
    path = tmp_path / "gpu.yaml"
    path.write_text(manifest_text(model).replace("gpus: []", "gpus: [0]\n    reserve: 0"))
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    dep = Deployment.from_manifest(path, state_dir=tmp_path / "state")
    try:
        with dep.acquire_loaded() as loaded:
            assert loaded.input_device == "cuda:0"
            held = torch.cuda.memory_allocated(0) - before
            planned = sum(d.bytes for d in loaded.plan.devices if d.device == 0)
            # cuBLAS keeps a workspace per thread that ran a matmul (the health check's): 32 MiB on Hopper,
            # allocated through torch's allocator; the plan's `reserve` covers it, not its weight bytes
            assert planned <= held < planned + CUBLAS_WORKSPACE + (8 << 20)
        del loaded
    finally:
        dep.close()
    import gc

    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # torch's own cache, not deploykit's
    assert torch.cuda.memory_allocated(0) - before < 1 << 20


def _on_gpu_greedy(model, prompt, max_new):
    ids = torch.tensor([list(prompt)], device="cuda:0")
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def test_the_engine_serves_a_model_wholly_on_the_gpu(tiny_model):
    """Every path of the padded loop with the whole model on cuda:0 and no accelerate hooks to move inputs:
    greedy rows (joined mid-flight, read in chunks, from the prefix cache) equal ``generate`` on the GPU;
    seeded sampling with penalties, bias and logprobs repeats itself; nothing fails."""
    from transformers import AutoModelForCausalLM

    from deploykit.engine.batching import GenerationRequest
    from test_batching import CharTokenizer, prompts
    from test_devices import answers

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32,
                                                 device_map="cuda:0").eval()
    shared = tuple(range(20, 60))
    greedy = [GenerationRequest(p, max_new_tokens=12) for p in prompts(6, seed=3)]
    greedy += [GenerationRequest(shared + (t,), max_new_tokens=6) for t in (5, 6)]
    expected = [_on_gpu_greedy(model, r.prompt_ids, r.max_new_tokens) for r in greedy]
    for options in ({}, {"prefill_chunk": 8}, {"prefix_cache_bytes": 8 << 20, "max_batch_size": 1}):
        got = answers(model, CharTokenizer(), greedy, **options)
        assert [tokens for tokens, *_ in got] == expected, options
    sampled = [GenerationRequest(prompts(1, seed=9)[0], max_new_tokens=10, temperature=0.9, top_p=0.8, seed=7,
                                 presence_penalty=0.5, frequency_penalty=0.5, logit_bias=((40, 5.0),), logprobs=2,
                                 prompt_logprobs=1)]
    first = answers(model, CharTokenizer(), sampled)
    assert first == answers(model, CharTokenizer(), sampled) and len(first[0][0]) == 10


def test_grammar_scoring_and_embeddings_on_the_gpu(tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer, BertConfig, BertModel

    from chatmodel import build_chat_model
    from deploykit.engine.batching import GenerationRequest
    from deploykit.engine.embeddings import Pooling, embed
    from deploykit.engine.loader import LoadedModel
    from deploykit.engine.scoring import score
    from deploykit.engine.types import Constraint
    from deploykit.spec.golden import GoldenCase
    from test_devices import answers
    from test_grammar import SCHEMA

    directory = build_chat_model(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, device_map="cuda:0").eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tuple(tokenizer("Answer in JSON:")["input_ids"])
    constraint = Constraint(json.dumps(SCHEMA))
    got = answers(model, tokenizer, [GenerationRequest(ids, max_new_tokens=60, grammar=constraint),
                                     GenerationRequest(ids, max_new_tokens=60, grammar=constraint, temperature=0.8,
                                                       seed=3)])
    for tokens, reason, *_ in got:
        if reason == "stop":
            assert set(json.loads(tokenizer.decode(tokens, skip_special_tokens=True))) == {"kind", "ok", "n"}
    loaded = LoadedModel(model, None, directory, "cuda:0", False, tokenizer)
    [case] = score(loaded, tokenizer, [GoldenCase("a cat", prompt="Name an animal:")])
    assert len(case.nll) == len(case.top1) > 0
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                vocab_size=len(tokenizer), max_position_embeddings=64)).to("cuda:0").eval()
    vectors, _ = embed(bert, tokenizer, ["a cat", "a dog"], pooling=Pooling("mean", True), max_length=64,
                       device="cuda:0")
    assert len(vectors) == 2 and len(vectors[0]) == 32


def test_continuous_batching_starts_on_a_gpu_given_all_it_has_left(tiny_model):
    """The plan hands the engine what the GPU has left for its KV cache (on a large GPU, over 100 GiB):
    transformers' paged cache must be sized so its own footprint fits (it failed to start on an H200 when
    it was given all of it), and greedy rows equal ``generate``."""
    from transformers import AutoModelForCausalLM

    from deploykit.engine.batching import GenerationRequest
    from test_batching import CharTokenizer, prompts
    from test_devices import answers

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32,
                                                 device_map="cuda:0").eval()
    greedy = [GenerationRequest(p, max_new_tokens=12) for p in prompts(4, seed=5)]
    expected = [_on_gpu_greedy(model, r.prompt_ids, r.max_new_tokens) for r in greedy]
    free, _ = torch.cuda.mem_get_info(0)
    got = answers(model, CharTokenizer(), greedy, backend="continuous", kv_cache_bytes=free)
    assert [tokens for tokens, *_ in got] == expected


def test_the_batch_cache_on_the_gpu_stays_within_its_kv_budget(tiny_model):
    """The CPU test (tests/test_kv_memory.py) measured on a GPU with torch's allocator: the peak of a batch
    that grows and shrinks, above what the engine held after a first request (its thread's cuBLAS
    workspace included), stays within the KV budget plus 2 MiB for the step's activations and logits."""
    import random

    from transformers import AutoModelForCausalLM

    from deploykit.engine.batching import Engine, GenerationRequest
    from test_batching import CharTokenizer

    budget = 4 << 20
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32,
                                                 device_map="cuda:0").eval()
    rng = random.Random(4)
    requests = [GenerationRequest(tuple(rng.randrange(4, 256) for _ in range(rng.randrange(10, 100))),
                                  max_new_tokens=rng.randrange(4, 80)) for _ in range(32)]
    eng = Engine(model, CharTokenizer(), kv_cache_bytes=budget, max_batch_size=16)
    try:
        eng.submit(GenerationRequest((5, 6, 7), max_new_tokens=2)).result(timeout=120)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        results = [h.result(timeout=300) for h in [eng.submit(r) for r in requests]]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
    finally:
        eng.close(timeout=30)
    assert all(r.error is None for r in results)
    assert budget // 2 < peak <= budget + (2 << 20), f"peak {peak} bytes above the engine's baseline, budget {budget}"
