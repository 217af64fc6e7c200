"""Grammar-constrained decoding in the transformers engine (deploykit.engine.grammar), on a real tiny
model with a byte-level tokenizer (tests/chatmodel.py), no mocks: every keyword deploykit accepts is
enforced by xgrammar (a valid instance accepted, a violating one refused), every keyword xgrammar
ignores is refused by deploykit (and shown to be ignored by xgrammar), and a constrained request's
greedy answer is the same alone and in a batch with free ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from chatmodel import build_chat_model

from deploykit.engine.batching import Engine, GenerationRequest
from deploykit.engine.grammar import ENFORCED, Grammars
from deploykit.engine.text import RequestError
from deploykit.engine.types import Constraint

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
# keyword -> (schema, valid instance, violating instance): each proves the keyword is enforced
ENFORCED_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "type": ({"type": "integer"}, "1", '"a"'),
    "enum": ({"enum": ["a", "b"]}, '"a"', '"c"'),
    "const": ({"const": "a"}, '"a"', '"b"'),
    "required": ({**OBJ, "required": ["a"]}, '{"a": 1}', "{}"),
    "properties": (OBJ, '{"a": 1}', '{"a": "x"}'),
    "additionalProperties": ({**OBJ, "additionalProperties": False}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1, 2]", '["a"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", '["a"]'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, '"ab"', '"A1"'),
    "minLength": ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"ab"', '"abc"'),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1, 2]", "[1]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
    "minimum": ({"type": "integer", "minimum": 5}, "5", "4"),
    "maximum": ({"type": "number", "maximum": 5.5}, "5.5", "6"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, "6", "5"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, "4", "5"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    "format": ({"type": "string", "format": "date"}, '"2024-01-02"', '"x"'),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, **OBJ, "properties": {"a": {"$ref": "#/$defs/x"}}},
             '{"a": 1}', '{"a": "s"}'),
}
# keywords xgrammar accepts and then does not follow: refused, with the instance it would let through
IGNORED_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2"),
    "not": ({"not": {"type": "integer"}}, "1"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "dependentRequired": ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
                          '{"a": 1}'),
    "format: foo": ({"type": "string", "format": "foo"}, '"anything"'),
    "maxLength with pattern": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abcdef"'),
    "minLength with format": ({"type": "string", "format": "date", "minLength": 20}, '"2024-01-02"'),
}
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "ok", "n"]}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chat_model(tmp_path_factory.mktemp("grammar") / "chat")


@pytest.fixture(scope="module")
def grammars(chat_dir: Path) -> Grammars:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    return Grammars(tokenizer, vocab_size=len(tokenizer), stop_ids=[tokenizer.eos_token_id])


def accepts(grammars: Grammars, schema: dict[str, Any], text: str) -> bool:
    row = grammars.matcher(Constraint(json.dumps(schema)))
    return bool(row.matcher.accept_string(text)) and bool(row.matcher.is_completed())


def test_every_accepted_keyword_is_enforced(grammars: Grammars) -> None:
    assert set(ENFORCED) - {"$defs", "definitions"} == set(ENFORCED_CASES)  # a new keyword needs its case
    for keyword, (schema, good, bad) in ENFORCED_CASES.items():
        assert accepts(grammars, schema, good), keyword
        assert not accepts(grammars, schema, bad), keyword


def test_keywords_the_library_ignores_are_refused(grammars: Grammars) -> None:
    import xgrammar as xgr

    compiler = grammars._compiler_now()
    for keyword, (schema, violating) in IGNORED_CASES.items():
        if not keyword.startswith("format"):  # an unknown format has no meaning to check against
            assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(violating)), keyword
        ignored = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  separators=(", ", ": ")))
        assert ignored.accept_string(violating), f"xgrammar now enforces {keyword}: accept it"
        nested = {"type": "object", "properties": {"x": schema}}
        with pytest.raises(RequestError, match=f"'{keyword}' \\(at #/properties/x\\)") as refused:
            grammars.compile(Constraint(json.dumps(nested), param="tools"))
        assert refused.value.param == "tools"


def test_schemas_the_library_refuses_or_would_take_seconds_on_are_request_errors(grammars: Grammars) -> None:
    with pytest.raises(RequestError, match="cannot be compiled") as refused:
        grammars.compile(Constraint(json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}})))
    assert refused.value.param == "response_format" and "/project" not in str(refused.value)  # xgrammar's own words
    with pytest.raises(RequestError, match="'maxLength above 100000'"):  # xgrammar takes seconds over it
        grammars.compile(Constraint(json.dumps({"type": "string", "maxLength": 10**9})))


@pytest.fixture(scope="module")
def engine(chat_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32)
    engine = Engine(model, AutoTokenizer.from_pretrained(chat_dir), max_batch_size=8)
    yield engine
    engine.close(30)


def constrained(prompt: list[int], **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, max_new_tokens=kw.pop("max_new_tokens", 64),
                             grammar=Constraint(json.dumps(SCHEMA)), **kw)


def test_constrained_rows_equal_alone_and_mixed_with_free_ones(engine: Any) -> None:
    prompts = [[60, 61, 62], [70, 71, 72, 73, 74, 75], [80, 81]]
    alone = [engine.submit(constrained(p)).result(60) for p in prompts]
    for result in alone:
        assert result.finish_reason == "stop"
        text = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    free = [GenerationRequest(prompt_ids=[90 + i] * (i + 2), max_new_tokens=20, temperature=0.9, seed=i)
            for i in range(3)]
    mixed = [engine.submit(r) for r in [free[0], constrained(prompts[0]), free[1], constrained(prompts[1]),
                                        constrained(prompts[2], logprobs=2), free[2]]]
    got = [h.result(60) for h in mixed]
    assert [r.token_ids for r in (got[1], got[3], got[4])] == [r.token_ids for r in alone]
    assert got[4].logprobs is not None and len(got[4].logprobs) == len(got[4].token_ids)


def test_a_length_cut_ends_with_length(engine: Any) -> None:
    result = engine.submit(constrained([60, 61], max_new_tokens=4)).result(60)
    assert (result.finish_reason, len(result.token_ids)) == ("length", 4)


def test_sampled_constrained_answers_validate_with_penalties(engine: Any) -> None:
    handles = [engine.submit(constrained([50 + i, 51], temperature=1.5, seed=i, presence_penalty=1.0,
                                         frequency_penalty=0.5)) for i in range(4)]
    for h in handles:
        result = h.result(60)
        assert result.finish_reason == "stop"
        jsonschema.validate(json.loads(engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)), SCHEMA)


class ModelStepper:
    """A ``Stepper`` over the model in this process (what pipeline stages and tensor-parallel ranks do
    across processes): one KV cache per request group."""

    def __init__(self, model: Any) -> None:
        self.model, self.caches = model, {}

    def step(self, group: str, ids: Any, mask: Any, positions: Any) -> Any:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=self.caches.get(group), use_cache=True)
        self.caches[group] = out.past_key_values
        return out.logits[:, -1]

    def release(self, group: str) -> None:
        self.caches.pop(group, None)

    def close(self) -> None:
        self.caches.clear()


def test_the_stepped_engine_constrains_like_the_padded_one(engine: Any) -> None:
    from deploykit.engine.stepped import SteppedEngine

    stepped = SteppedEngine(ModelStepper(engine.model), engine.tokenizer, engine.eos_ids, max_batch_size=4)
    try:
        prompts = [[60, 61, 62], [70, 71, 72, 73]]
        for prompt in prompts:
            got = stepped.submit(constrained(prompt)).result(60)
            assert got.token_ids == engine.submit(constrained(prompt)).result(60).token_ids
            assert got.finish_reason == "stop"
    finally:
        stepped.close(30)


@pytest.mark.parametrize(("pattern", "named"), [
    ("(?<=a)b", "pattern: look-behind (?<="), ("a(?=b)", "pattern: look-ahead (?="),
    ("(?!x)y", "pattern: negative look-ahead (?!"), ("(?<!x)y", "pattern: negative look-behind (?<!"),
    (r"^(a)\1$", "pattern: back-reference to group 1"), (r"(?<n>a)\k<n>", "pattern: named back-reference")])
def test_regex_features_a_grammar_cannot_enforce_are_refused(grammars: Grammars, pattern: str, named: str) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(RequestError) as refused:
        grammars.compile(Constraint(json.dumps(schema)))
    assert f"'{named}' (at #/properties/s)" in str(refused.value) and refused.value.param == "response_format"


def test_a_pattern_beside_a_format_is_refused_and_plain_patterns_are_not(grammars: Grammars) -> None:
    with pytest.raises(RequestError, match="'pattern with format'"):  # xgrammar would follow one of them
        grammars.compile(Constraint(json.dumps({"type": "string", "format": "email", "pattern": "^a"})))
    for literal in (r"^\(?=x$", "^[(?=]+$", r"^[a-z]\d{2}$", "^(?:ab)+$"):  # escaped or in a class: not look-around
        assert accepts(grammars, {"type": "string", "pattern": literal}, json.dumps(
            {r"^\(?=x$": "(=x", "^[(?=]+$": "(?=", r"^[a-z]\d{2}$": "a12", "^(?:ab)+$": "abab"}[literal]))
