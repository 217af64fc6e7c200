"""Speculative decoding with a draft model (spec.speculative method draft, deploykit.engine.drafting) in the padded
loop, on real tiny models, no mocks: the serving checkpoint quantized int8 / int4 as its own draft, and a smaller
checkpoint sharing the tokenizer (draft.path). Greedy answers are the answers without speculation, token for
token (many prompts, 16 at once, stop strings, a grammar), seeded samples are the same, drafts are accepted (so
each equality could fail); a draft that fails to load leaves the model serving, the error in the status."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chatmodel import build_chat_model
from deploykit.engine.batching import GenerationRequest
from deploykit.engine.drafting import DraftModel, load_draft
from deploykit.engine.quantized import QuantizedLinear
from deploykit.engine.types import Constraint, Speculation
from test_speculative import CharTokenizer, answers, engine, repeating_prompts

INT8 = Speculation(method="draft", num_tokens=6, draft_quantized="int8")
INT4 = Speculation(method="draft", num_tokens=6, draft_quantized="int4")


@pytest.fixture(scope="module")
def llama_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama(llama_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def draft_of(directory: Path, scheme: str) -> Any:
    return load_draft(checkpoint=directory, path=None, quantized=scheme, dtype=torch.float32,
                      device=torch.device("cpu"))


@pytest.fixture(scope="module")
def int8_draft(llama_dir: Path) -> Any:
    return draft_of(llama_dir, "int8")


def same_and_accepted(model: Any, draft: Any, requests: list[GenerationRequest], settings: Speculation = INT8,
                      **kwargs: Any) -> dict[str, int]:
    plain, _ = answers(model, requests, None, **kwargs)
    fast, stats = answers(model, requests, settings, draft_model=draft, **kwargs)
    for a, b in zip(plain, fast):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
    assert stats["speculative_accepted"] > 0, stats
    return stats


def test_the_quantized_self_draft_quantizes_every_linear_layer(int8_draft: Any, llama: Any) -> None:
    quantized = [m for m in int8_draft.modules() if isinstance(m, QuantizedLinear)]
    linears = [m for m in llama.modules() if isinstance(m, torch.nn.Linear)]
    assert len(quantized) == len(linears) and {m.scheme for m in quantized} == {"int8"}


def test_greedy_answers_are_identical_with_the_int8_self_draft_and_most_drafts_accepted(
        llama: Any, int8_draft: Any) -> None:
    requests = [GenerationRequest(p, max_new_tokens=40) for p in repeating_prompts(24, seed=11)]
    stats = same_and_accepted(llama, int8_draft, requests)
    assert stats["speculative_accepted"] > 0.6 * stats["speculative_drafted"], stats
    assert stats["speculative_emitted"] > 2 * stats["speculative_steps"], stats


def test_greedy_answers_are_identical_with_the_int4_self_draft(llama: Any, llama_dir: Path) -> None:
    draft = draft_of(llama_dir, "int4")
    assert {m.scheme for m in draft.modules() if isinstance(m, QuantizedLinear)} == {"int4"}
    requests = [GenerationRequest(p, max_new_tokens=32) for p in repeating_prompts(12, seed=12)]
    same_and_accepted(llama, draft, requests, INT4)


def test_sixteen_at_once_with_rows_joining_and_leaving(llama: Any, int8_draft: Any) -> None:
    requests = [GenerationRequest(p, max_new_tokens=6 + 4 * (i % 9)) for i, p in enumerate(repeating_prompts(40, 13))]
    same_and_accepted(llama, int8_draft, requests, max_batch_size=16)


def test_stop_strings_stop_ids_and_max_tokens_end_where_they_would(llama: Any, int8_draft: Any) -> None:
    prompts = repeating_prompts(10, seed=14)
    plain, _ = answers(llama, [GenerationRequest(p, max_new_tokens=40) for p in prompts], None)
    tok = CharTokenizer()
    requests = []
    for p, r in zip(prompts, plain):
        text = tok.decode(r.token_ids)
        requests.append(GenerationRequest(p, max_new_tokens=40, stop_strings=(text[20:23],)))
        requests.append(GenerationRequest(p, max_new_tokens=40, stop_token_ids=(r.token_ids[25],)))
        requests.append(GenerationRequest(p, max_new_tokens=7 + len(p) % 5))
    same_and_accepted(llama, int8_draft, requests)


def test_seeded_samples_are_the_same_with_and_without(llama: Any, int8_draft: Any) -> None:
    requests = [GenerationRequest(p, max_new_tokens=32, temperature=0.03, top_p=0.9, seed=i)
                for i, p in enumerate(repeating_prompts(10, seed=15))]
    same_and_accepted(llama, int8_draft, requests)


def test_n_choices_of_one_prompt_share_nothing_wrong(llama: Any, int8_draft: Any) -> None:
    """n > 1: the same prompt in several rows at once (greedy and seeded), each with its own draft cache."""
    prompt = repeating_prompts(2, seed=16)[1]
    requests = [GenerationRequest(prompt, max_new_tokens=40)] * 3
    requests += [GenerationRequest(prompt, max_new_tokens=40, temperature=0.5, seed=s) for s in range(3)]
    same_and_accepted(llama, int8_draft, requests)


def test_a_grammar_cuts_drafts_and_answers_as_without(tmp_path: Path) -> None:
    base = build_chat_model(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    draft = draft_of(base, "int8")
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24}}, "required": ["a"]}
    prompt = tokenizer('{"a": "abcabcabc"} {"a": "abcabc', add_special_tokens=False)["input_ids"]
    requests = [GenerationRequest(prompt, max_new_tokens=40, grammar=Constraint(json.dumps(schema))),
                GenerationRequest(prompt, max_new_tokens=40)]
    same_and_accepted(model, draft, requests, tokenizer=tokenizer)


def test_a_smaller_draft_checkpoint_sharing_the_tokenizer(tmp_path: Path) -> None:
    base = build_chat_model(tmp_path / "chat", layers=2)
    small = build_chat_model(tmp_path / "small", layers=1, seed=1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    draft = load_draft(checkpoint=base, path=str(small), quantized=None, dtype=torch.float32,
                       device=torch.device("cpu"))
    assert draft.config.num_hidden_layers == 1
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("the cat sat", "abc abc abc", "hello")]
    requests = [GenerationRequest(p, max_new_tokens=32) for p in prompts]
    plain, _ = answers(model, requests, None, tokenizer=tokenizer)
    fast, stats = answers(model, requests, Speculation(method="draft", num_tokens=4, draft_path=str(small)),
                          tokenizer=tokenizer, draft_model=draft)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert stats["speculative_drafted"] > 0, stats  # a different model's drafts: verified, whatever is accepted


def test_the_draft_cache_follows_the_accepted_tokens(llama: Any, int8_draft: Any) -> None:
    """After a rejected draft the row's cache is cut back to the shared prefix: its drafts then equal those
    of a fresh cache over the same sequence."""
    seq = list(repeating_prompts(2, seed=17)[1])
    kept = DraftModel(int8_draft, confidence=0)  # random weights: every token unsure, and the drafts must be long
    first = kept.draft("r", seq, 5)
    diverged = seq + first[:2] + [(first[2] + 1) % 256]
    fresh = DraftModel(int8_draft, confidence=0)
    assert kept.draft("r", diverged, 5) == fresh.draft("r", diverged, 5)
    assert kept.cached_positions() == fresh.cached_positions() == len(diverged) + 4
    kept.keep(set())
    assert kept.cached_positions() == 0


def test_a_draft_stops_after_a_token_its_model_is_unsure_of(int8_draft: Any) -> None:
    """A drafted token the draft model gave less than ``confidence`` is the draft's last (it is still
    proposed); with ``confidence`` 0 the draft runs to ``k``. The tiny model's random weights give every token
    about 1 / vocabulary: unsure at any threshold above that."""
    seq = list(repeating_prompts(2, seed=17)[1])
    probs = torch.softmax(int8_draft(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
    assert float(probs.max()) < 0.1
    assert len(DraftModel(int8_draft, confidence=0).draft("r", seq, 5)) == 5
    unsure = DraftModel(int8_draft)  # drafting.DRAFT_CONFIDENCE
    assert unsure.draft("r", seq, 5) == DraftModel(int8_draft, confidence=0).draft("r", seq, 1)
    assert unsure.cached_positions() == len(seq)  # the one drafted token was never fed


def test_a_draft_that_fails_to_load_leaves_the_model_serving(llama: Any, tmp_path: Path) -> None:
    from deploykit.control.live.status import speculation_of
    from deploykit.engine.loader import LoadedModel
    from deploykit.engine.runtime import draft_of as runtime_draft_of

    loaded = LoadedModel(llama, None, tmp_path / "gone", "cpu", False, None)  # type: ignore[arg-type]
    settings = Speculation(method="draft", num_tokens=4, draft_quantized="int8")
    draft, error = runtime_draft_of(loaded, settings)
    assert draft is None and error is not None and "failed to load" in error and "gone" in error
    requests = [GenerationRequest(p, max_new_tokens=16) for p in repeating_prompts(4, seed=18)]
    plain, _ = answers(llama, requests, None)
    with engine(llama, speculative=settings, speculative_error=error) as eng:
        served = [eng.submit(r).result(120) for r in requests]
        status = speculation_of(eng)
    assert [r.token_ids for r in served] == [r.token_ids for r in plain]
    assert status is not None and status["error"] == error and status["drafted"] == 0
    assert status["method"] == "draft"


def draft_manifest_issues(tmp_path: Path, draft: str, model: Path) -> list[tuple[int, str, str]]:
    from deploykit.spec.manifest import check_on_host, parse_manifests

    text = ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: m}\nspec:\n"
            f"  model: {{path: {model}}}\n  speculative:\n    method: draft\n    draft:\n      {draft}\n")
    [loaded] = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    return [(i.line or 0, i.field or "", i.message) for i in check_on_host(loaded)]


def test_a_draft_checkpoint_sharing_the_tokenizer_is_accepted(tmp_path: Path) -> None:
    base = build_chat_model(tmp_path / "chat", layers=2)
    build_chat_model(tmp_path / "small", layers=1, seed=1)
    assert draft_manifest_issues(tmp_path, "path: small", base) == []


@pytest.mark.parametrize("change, says", [
    ("missing", "does not exist"),
    ("no-config", "no config.json"),
    ("vocabulary", "vocabulary has"),
    ("tokenizer", "tokenizer differs"),
    ("template", "chat template differs"),
])
def test_a_draft_checkpoint_that_cannot_draft_is_refused_at_its_field(tmp_path: Path, change: str, says: str) -> None:
    base = build_chat_model(tmp_path / "chat", layers=2)
    small = build_chat_model(tmp_path / "small", layers=1, seed=1)
    if change == "missing":
        small = tmp_path / "gone"
    elif change == "no-config":
        (small / "config.json").unlink()
    elif change == "vocabulary":
        config = json.loads((small / "config.json").read_text())
        (small / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    elif change == "tokenizer":
        tok = json.loads((small / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = list(vocab)[:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other ids
        (small / "tokenizer.json").write_text(json.dumps(tok))
    else:
        (small / "chat_template.jinja").write_text("{{ messages }}")
        for f in ("tokenizer_config.json",):
            cfg = json.loads((small / f).read_text())
            cfg.pop("chat_template", None)
            (small / f).write_text(json.dumps(cfg))
    [(line, field, message)] = draft_manifest_issues(tmp_path, f"path: {small}", base)
    assert field == "spec.speculative.draft.path" and line == 9 and says in message, message


def refused(path: Path, model: str, speculative: str) -> str:
    """The ManifestError of a manifest at ``path`` with ``model`` and ``speculative`` (its indented lines)."""
    from deploykit.errors import ManifestError
    from deploykit.spec.manifest import load_manifests

    path.write_text("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: m}\nspec:\n"
                    f"  model: {model}\n  speculative:\n{speculative}")
    with pytest.raises(ManifestError) as info:
        load_manifests(path)
    return str(info.value)


def test_a_quantized_self_draft_of_a_quantized_model_is_refused_at_its_field(tmp_path: Path) -> None:
    said = refused(tmp_path / "m.yaml", "{path: /m, quantization: int8}", "    method: draft\n    draft: {quantized: int4}\n")
    assert "spec.speculative.draft.quantized" in said and "already quantized" in said


def test_prompt_lookup_sizes_beside_a_draft_model_are_refused_not_ignored(tmp_path: Path) -> None:
    from deploykit.spec.manifest import load_manifests

    path = tmp_path / "m.yaml"
    said = refused(path, "{path: /m}", "    method: draft\n    ngram_max: 8\n    draft: {quantized: int4}\n")
    assert "m.yaml:8:" in said and "spec.speculative.ngram_max" in said, said
    path.write_text(path.read_text().replace("    ngram_max: 8\n", "    ngram_max: 4\n"))  # the default
    assert load_manifests(path)[0].manifest.spec.speculative.method == "draft"


def test_the_plan_counts_the_draft_weights_and_kv(tmp_path: Path) -> None:
    from test_cli import deploykit

    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import parse_manifests

    base = build_chat_model(tmp_path / "chat", layers=2)
    small = build_chat_model(tmp_path / "small", layers=1, seed=1)

    def planned(speculative: str) -> Any:
        text = ("apiVersion: deploykit/v1\nkind: ModelDeployment\nmetadata: {name: m}\nspec:\n"
                f"  model: {{path: {base}, dtype: float32}}\n  placement: {{gpus: []}}\n"
                f"  serving: {{max_concurrent: 4, context_length: 100}}\n" + speculative)
        (tmp_path / "m.yaml").write_text(text)
        [loaded] = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
        return plan_manifest(loaded, devices="cpu=1GiB")

    plain = planned("")
    int8 = planned("  speculative: {method: draft, draft: {quantized: int8}}\n")
    path = planned(f"  speculative: {{method: draft, draft: {{path: {small}}}}}\n")
    assert plain.draft_bytes == 0 and "draft_bytes" not in plain.to_dict()
    weights = sum(f.stat().st_size for f in small.glob("*.safetensors"))
    kv_per_token = 2 * 2 * 16 * 4  # keys and values of one layer: 2 KV heads of 16 at float32
    assert path.kv_cache_tokens is None  # CPU, no limit: each of the 4 rows' context_length
    assert abs(path.draft_bytes - (weights + 4 * 100 * kv_per_token)) < 4096  # the files hold headers too
    assert 0 < int8.draft_bytes and int8.total_bytes - plain.total_bytes == int8.draft_bytes
    assert path.total_bytes - plain.total_bytes == path.draft_bytes
    assert any("speculative draft model" in n for n in int8.notes)
    shown = deploykit("plan", str(tmp_path / "m.yaml"), "--devices", "cpu=1GiB", "--output", "json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["draft_bytes"] == path.draft_bytes
    assert any("speculative draft model" in n for n in json.loads(shown.stdout)["notes"])


def test_a_draft_slower_than_what_it_saves_stops_drafting(tmp_path: Path) -> None:
    """A draft model far larger than the model (same tokenizer): after its first drafts are timed, a batch of
    16 rows decodes without them (each drafted token would cost more than its row's share of a step)."""
    base = build_chat_model(tmp_path / "chat", layers=1)
    big = build_chat_model(tmp_path / "big", layers=6, hidden=256, intermediate=1024, seed=1)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    draft = load_draft(checkpoint=base, path=str(big), quantized=None, dtype=torch.float32, device=torch.device("cpu"))
    requests = [GenerationRequest(p, max_new_tokens=24) for p in repeating_prompts(16, seed=19)]
    plain, _ = answers(model, requests, None, tokenizer=tokenizer)
    fast, stats = answers(model, requests, Speculation(method="draft", num_tokens=4, draft_path=str(big)),
                          tokenizer=tokenizer, draft_model=draft, max_batch_size=16)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert 1 <= stats["speculative_steps"] <= 2, stats  # drafted once (timed), then not while 16 rows run
