"""Speculative decoding in the padded loop (deploykit.engine.speculative, spec.speculative method ngram) on real
tiny models, no mocks: greedy answers are the answers without it, token for token (with stop strings,
logprobs, penalties, a grammar, LoRA adapters, 16 requests at once), drafts are accepted (so each equality
could fail), seeded samples are the same with and without it, the sampled distribution is the model's, and a
request cancelled while it drafts ends alone."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploykit.engine.adapters import Adapters, AdapterSource
from deploykit.engine.batching import Engine, GenerationRequest, GenerationResult
from deploykit.engine.requests import RequestHandle
from deploykit.engine.speculative import Pace, Speculator, ngram_draft
from deploykit.engine.types import Constraint, Speculation
from lora import chat_ids

NGRAM = Speculation(num_tokens=6, ngram_min=1, ngram_max=3, hold=False)  # every step drafts: exactness, not the policy


class CharTokenizer:
    """One character per id (stop strings decode tails of the ids)."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[[str], Path]) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


@contextmanager
def engine(model: Any, tokenizer: Any = None, **kwargs: Any) -> Iterator[Engine]:
    eng = Engine(model, tokenizer or CharTokenizer(), **kwargs)
    try:
        yield eng
    finally:
        eng.close(timeout=60)


def repeating_prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Prompts that repeat a span (drafts to find) and random ones (no drafts), 8..60 ids."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = [rng.randrange(4, 256) for _ in range(rng.randrange(2, 8))]
        span = [rng.randrange(4, 256) for _ in range(rng.randrange(3, 12))]
        out.append(tuple(head + span * rng.randrange(2, 5)) if i % 4 else tuple(head + span))
    return out


def answers(model: Any, requests: list[GenerationRequest], speculative: Speculation | None, **kwargs: Any
            ) -> tuple[list[GenerationResult], dict[str, int]]:
    with engine(model, speculative=speculative, **kwargs) as eng:
        handles = [eng.submit(r) for r in requests]
        results = [h.result(120) for h in handles]
        return results, eng.stats()


def assert_same_and_accepted(model: Any, requests: list[GenerationRequest], **kwargs: Any) -> dict[str, int]:
    plain, _ = answers(model, requests, None, **kwargs)
    fast, stats = answers(model, requests, NGRAM, **kwargs)
    for a, b in zip(plain, fast):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert b.completion_tokens == len(b.token_ids)
    assert stats["speculative_accepted"] > 0, stats  # drafts were verified and accepted: the equality was tested
    return stats


def test_ngram_draft_is_the_continuation_of_the_last_longest_match() -> None:
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_draft(seq, 3, 1, 3) == [7, 8, 5]  # "2 3" last seen before position 5: what followed it
    assert ngram_draft(seq, 2, 3, 3) == []  # "5 2 3" never occurred before
    assert ngram_draft([4, 4, 4], 5, 1, 2) == [4]  # the tail's own window is never a match
    assert ngram_draft([4], 5, 1, 2) == []


def test_pace_backs_off_to_a_pause_and_grows_back() -> None:
    pace = Pace(8)
    for _ in range(4):
        pace.after(pace.allowed(), 0, 8)
    assert (pace.limit, pace.wait) == (1, 1)
    assert pace.allowed() == 0 and pace.allowed() == 1  # paused one step, then drafts one token
    pace.after(1, 1, 8)
    pace.after(2, 2, 8)
    assert pace.limit == 4


def test_the_batch_holds_its_drafts_while_verification_pays_less_than_decoding() -> None:
    """Verification steps that emit fewer tokens per second than decode steps (many rows whose drafts fail)
    hold the whole batch's drafts for 4, 8, 16 .. steps, then one step drafts again to measure; a step that pays
    ends the holds."""
    spec = Speculator(Speculation(num_tokens=6, ngram_min=1, ngram_max=3))
    rows = [RequestHandle(GenerationRequest((1, 2, 3, 1, 2, 3, 1, 2), max_new_tokens=64), id=str(i)) for i in range(4)]

    def drafting() -> bool:
        return any(spec.drafts(rows))

    assert drafting()  # nothing measured yet: drafts
    spec.decoded(0.10)
    spec.verified(0.20, rows=4, emitted=5)  # 1.25 tokens a row for twice a decode step's time
    assert spec.gain is not None and spec.gain < 1
    assert [drafting() for _ in range(5)] == [False] * 4 + [True]  # held four steps, then drafts to measure anew
    spec.verified(0.20, rows=4, emitted=5)
    assert [drafting() for _ in range(9)] == [False] * 8 + [True]  # held eight steps now
    spec.verified(0.12, rows=4, emitted=24)  # 6 tokens a row: it pays again
    assert spec.gain > 1 and drafting() and drafting()


def held_speculator() -> tuple[Speculator, list[RequestHandle], Callable[[], bool]]:
    """A speculator whose batch of four rows has just been held (verification paid a quarter of decoding)."""
    spec = Speculator(Speculation(num_tokens=6, ngram_min=1, ngram_max=3))
    rows = [RequestHandle(GenerationRequest((1, 2, 3, 1, 2, 3, 1, 2), max_new_tokens=64), id=str(i)) for i in range(4)]
    spec.decoded(0.10)
    spec.verified(0.20, rows=4, emitted=2)  # half a token a row for twice a decode step's time
    return spec, rows, lambda: any(spec.drafts(rows))


def test_one_verification_step_that_pays_after_a_hold_ends_the_holds() -> None:
    """The step that drafts after a hold measures anew: when it pays, the batch drafts on (the gain before the
    hold, which the hold answered, does not outweigh it), and when it does not, the next hold is longer."""
    spec, _, drafting = held_speculator()
    assert [drafting() for _ in range(5)] == [False] * 4 + [True]
    spec.verified(0.10, rows=4, emitted=6)  # 1.5 tokens a row in a decode step's time: it pays
    assert spec.gain is not None and spec.gain > 1 and drafting() and drafting()
    spec.verified(0.20, rows=4, emitted=2)  # it stopped paying: held four steps again
    assert [drafting() for _ in range(5)] == [False] * 4 + [True]
    spec.verified(0.20, rows=4, emitted=2)  # the probe after it did not pay either: eight
    assert [drafting() for _ in range(9)] == [False] * 8 + [True]


def test_a_lone_row_is_left_to_its_own_pace() -> None:
    """One row's verification that did not pay holds nothing: its ``Pace`` backs it off (a hold of a lone row
    drafting with a model whose drafts mostly pay would cost it the steps after one unlucky draft)."""
    spec = Speculator(Speculation(num_tokens=6, ngram_min=1, ngram_max=3))
    rows = [RequestHandle(GenerationRequest((1, 2, 3, 1, 2, 3, 1, 2), max_new_tokens=64), id="a")]
    spec.decoded(0.10)
    spec.verified(0.20, rows=1, emitted=1)
    spec.verified(0.20, rows=1, emitted=1)
    assert spec.gain is None and any(spec.drafts(rows))


def test_a_batch_that_empties_forgets_its_holds() -> None:
    """A request that comes after the batch emptied drafts at once: the holds (up to 64 steps) and the gain were
    the rows' that left."""
    spec, _, _ = held_speculator()
    spec.keep([])  # the loop going idle
    copying = [RequestHandle(GenerationRequest((5, 6, 7, 5, 6, 7, 5, 6), max_new_tokens=64), id="copy")]
    assert spec.gain is None and any(spec.drafts(copying))


def test_greedy_answers_are_identical_and_drafts_are_accepted(llama: Any) -> None:
    requests = [GenerationRequest(p, max_new_tokens=48) for p in repeating_prompts(24)]
    stats = assert_same_and_accepted(llama, requests)
    assert stats["speculative_emitted"] > stats["speculative_steps"]  # more than a token per verification


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gemma", "gpt2"])
def test_greedy_answers_are_identical_on_other_architectures(tiny_model: Callable[[str], Path], name: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.float32).eval()
    requests = [GenerationRequest(p, max_new_tokens=24) for p in repeating_prompts(8, seed=8)]
    assert_same_and_accepted(model, requests)


def test_greedy_equals_generate(llama: Any) -> None:
    prompt = repeating_prompts(2, seed=3)[1]
    with torch.inference_mode():
        out = llama.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=40, do_sample=False)
    [result], stats = answers(llama, [GenerationRequest(prompt, max_new_tokens=40)], NGRAM)
    assert result.token_ids == [int(t) for t in out[0, len(prompt):]]
    assert stats["speculative_accepted"] > 0


def test_stop_strings_stop_ids_and_max_tokens_end_where_they_would(llama: Any) -> None:
    prompts = repeating_prompts(16, seed=1)
    plain, _ = answers(llama, [GenerationRequest(p, max_new_tokens=40) for p in prompts], None)
    tok = CharTokenizer()
    requests = []
    for p, r in zip(prompts, plain):  # a stop string and a stop id taken from inside each plain answer
        text = tok.decode(r.token_ids)
        requests.append(GenerationRequest(p, max_new_tokens=40, stop_strings=(text[20:23],)))
        requests.append(GenerationRequest(p, max_new_tokens=40, stop_token_ids=(r.token_ids[25],)))
        requests.append(GenerationRequest(p, max_new_tokens=7 + len(p) % 5))
    assert_same_and_accepted(llama, requests)


def test_logprobs_and_penalties_are_per_position_as_without(llama: Any) -> None:
    prompts = repeating_prompts(12, seed=2)
    requests = [GenerationRequest(p, max_new_tokens=32, logprobs=3) for p in prompts]
    requests += [GenerationRequest(p, max_new_tokens=32, presence_penalty=0.3, frequency_penalty=0.2,
                                   logit_bias=((7, 0.5),)) for p in prompts]
    plain, _ = answers(llama, requests, None)
    fast, stats = answers(llama, requests, NGRAM)
    assert stats["speculative_accepted"] > 0
    for a, b in zip(plain, fast):
        assert b.token_ids == a.token_ids
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert (y.token, [t for t, _ in y.top]) == (x.token, [t for t, _ in x.top])
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
        assert len(b.logprobs or []) == len(a.logprobs or [])


def test_seeded_samples_are_the_same_with_and_without(llama: Any) -> None:
    requests = [GenerationRequest(p, max_new_tokens=32, temperature=0.03, top_p=0.9, seed=i)
                for i, p in enumerate(repeating_prompts(12, seed=4))]
    assert_same_and_accepted(llama, requests)


def test_the_prefix_cache_keeps_what_verification_steps_computed(llama: Any) -> None:
    """Rows that leave after verification steps put their KV in the prefix cache (the accepted positions
    only, right-aligned): a second round of the same prompts, and prompts continuing the first answers,
    read it and answer as without speculation."""
    prompts = repeating_prompts(8, seed=9)
    first = [GenerationRequest(p, max_new_tokens=24) for p in prompts]
    plain, _ = answers(llama, first, None)
    continued = [GenerationRequest(tuple(p) + tuple(r.token_ids[:20]), max_new_tokens=16)
                 for p, r in zip(prompts, plain)]
    expected, _ = answers(llama, continued, None)
    with engine(llama, speculative=NGRAM, prefix_cache_bytes=8 << 20) as eng:
        again = [eng.submit(r).result(120) for r in first]
        later = [eng.submit(r).result(120) for r in continued]
        stats = eng.stats()
    assert [r.token_ids for r in again] == [r.token_ids for r in plain]
    assert [r.token_ids for r in later] == [r.token_ids for r in expected]
    assert all(r.cached_tokens > len(p) for r, p in zip(later, prompts))  # generated positions were read back
    assert stats["speculative_accepted"] > 0


def test_sixteen_at_once_with_rows_joining_and_leaving(llama: Any) -> None:
    prompts = repeating_prompts(40, seed=5)
    requests = [GenerationRequest(p, max_new_tokens=8 + 4 * (i % 9)) for i, p in enumerate(prompts)]
    assert_same_and_accepted(llama, requests, max_batch_size=16)


def test_drafts_back_off_under_a_full_batch(llama: Any) -> None:
    prompts = repeating_prompts(64, seed=6)
    _, stats = answers(llama, [GenerationRequest(p, max_new_tokens=12) for p in prompts], NGRAM, max_batch_size=64, max_queued=64)
    # 64 rows: a verification would hold 128 positions, more than VERIFY_POSITIONS: drafting stops while full
    assert stats["speculative_drafted"] < 64 * 11 * NGRAM.num_tokens // 4


def test_sampled_tokens_at_drafted_positions_follow_the_model(llama: Any) -> None:
    """The second token of a request is chosen at a verification step with a one-token draft (the first
    comes from the prefill): its empirical distribution over many seeds against the exact one, the sum over
    the first token of p(first) * p(second | first), by total variation."""
    temperature, n = 0.02, 1200
    prompt = [5, 9, 5, 9, 5, 9]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        first = torch.softmax(llama(ids).logits[0, -1] / temperature, -1)
        likely = [int(t) for t in torch.nonzero(first > 1e-4)]
        best = llama(torch.tensor([prompt + [c] for c in likely])).logits[:, -1].argmax(-1).tolist()
        prompt += [t for c, b in zip(likely, best) for t in (c, b)]  # each likely first token, its likely next: a draft
        ids = torch.tensor([prompt])
        first = torch.softmax(llama(ids).logits[0, -1] / temperature, -1)
        pairs = torch.tensor([prompt + [a] for a in range(first.shape[0])])
        second = torch.softmax(llama(pairs).logits[:, -1] / temperature, -1)
    exact = (first[:, None] * second).sum(0)
    requests = [GenerationRequest(prompt, max_new_tokens=3, temperature=temperature, seed=s) for s in range(n)]
    results, stats = answers(llama, requests, Speculation(num_tokens=4, hold=False), max_batch_size=32,
                             max_queued=n)
    assert stats["speculative_drafted"] > n // 2 and stats["speculative_accepted"] > 0, stats
    counts = Counter(r.token_ids[1] for r in results)
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - float(exact[t])) for t in range(exact.shape[0]))
    assert tv < 0.08, (tv, counts.most_common(5), torch.topk(exact, 5))


def test_a_request_cancelled_while_it_drafts_ends_alone(llama: Any) -> None:
    prompts = repeating_prompts(8, seed=7)
    plain, _ = answers(llama, [GenerationRequest(p, max_new_tokens=48) for p in prompts], None)
    with engine(llama, speculative=NGRAM) as eng:
        started = threading.Event()
        victim = eng.submit(GenerationRequest(prompts[1], max_new_tokens=120),
                            listener=lambda item: started.set())
        others = [eng.submit(GenerationRequest(p, max_new_tokens=48)) for p in prompts]
        assert started.wait(60)
        eng.cancel(victim)
        assert victim.result(60).finish_reason == "cancelled"
        assert [h.result(120).token_ids for h in others] == [r.token_ids for r in plain]
        again = eng.submit(GenerationRequest(prompts[0], max_new_tokens=48)).result(120)  # nothing of it left behind
        stats = eng.stats()
    assert again.token_ids == plain[0].token_ids
    assert stats["speculative_accepted"] > 0


def test_a_grammar_truncates_drafts_and_answers_as_without(tmp_path: Path) -> None:
    from chatmodel import build_chat_model

    base = build_chat_model(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24}}, "required": ["a"]}
    grammar = Constraint(json.dumps(schema))
    prompt = tokenizer('{"a": "abcabcabc"} {"a": "abcabc', add_special_tokens=False)["input_ids"]
    requests = [GenerationRequest(prompt, max_new_tokens=40, grammar=grammar),
                GenerationRequest(prompt, max_new_tokens=40)]
    plain, _ = answers(model, requests, None, tokenizer=tokenizer)
    fast, stats = answers(model, requests, NGRAM, tokenizer=tokenizer)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert tokenizer.decode(fast[0].token_ids, skip_special_tokens=True).startswith('{"a"')
    assert stats["speculative_drafted"] > 0


def test_adapter_rows_verify_with_their_own_adapter(lora: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    tokenizer = AutoTokenizer.from_pretrained(lora.base)
    prompt = chat_ids(lora.base, "hi")
    requests = [GenerationRequest(prompt, max_new_tokens=40, adapter="pirate"),
                GenerationRequest(prompt, max_new_tokens=40)] * 2
    plain, _ = answers(model, requests, None, tokenizer=tokenizer, adapters=adapters)
    fast, stats = answers(model, requests, NGRAM, tokenizer=tokenizer, adapters=adapters)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert plain[0].token_ids != plain[1].token_ids  # the adapter changes the answer
    assert stats["speculative_accepted"] > 0


LONG = tuple((7 * i) % 250 + 4 for i in range(150))  # read in chunks of 16 beside the running rows


def test_rows_verify_packed_beside_a_long_prompt_being_read(llama: Any) -> None:
    """Copying rows draft while a prompt longer than ``prefill_chunk`` is read: their verifications share the
    forwards with its chunks (mixed.py: each row adds its own positions, the chunk its tokens), and every
    answer, the rows' and the prompt's, is the one without speculation."""
    requests = [GenerationRequest(p, max_new_tokens=48) for p in repeating_prompts(6, seed=12)]
    requests.append(GenerationRequest(LONG, max_new_tokens=12))
    plain, _ = answers(llama, requests, None, prefill_chunk=16)
    fast, stats = answers(llama, requests, NGRAM, prefill_chunk=16)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert stats["speculative_steps_with_chunk"] > 0 and stats["speculative_accepted"] > 0, stats


def test_adapter_rows_verify_packed_beside_a_prompt_with_its_own_adapter(lora: Any) -> None:
    """The same with LoRA adapters: pirate and base rows verify beside a long pirate prompt's chunks, each
    packed token with its own row's adapter."""
    model = AutoModelForCausalLM.from_pretrained(lora.base, dtype=torch.float32)
    adapters = Adapters(model)
    adapters.load(AdapterSource("pirate", str(lora.pirate)))
    tokenizer = AutoTokenizer.from_pretrained(lora.base)
    prompt = chat_ids(lora.base, "hi")
    long = chat_ids(lora.base, " ".join(["tell me of the sea and the ship"] * 12))
    requests = [GenerationRequest(prompt, max_new_tokens=40, adapter="pirate"),
                GenerationRequest(prompt, max_new_tokens=40),
                GenerationRequest(long, max_new_tokens=16, adapter="pirate")]
    plain, _ = answers(model, requests, None, tokenizer=tokenizer, adapters=adapters, prefill_chunk=16)
    fast, stats = answers(model, requests, NGRAM, tokenizer=tokenizer, adapters=adapters, prefill_chunk=16)
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert stats["speculative_steps_with_chunk"] > 0 and stats["speculative_accepted"] > 0, stats


def test_packed_verification_counts_each_rows_own_positions(llama: Any) -> None:
    """One copying row drafts, the other rows do not: the packed forward holds the copying row's ``k + 1``
    positions and one for each other row (not every row widened), and each cache keeps what it accepted."""
    from deploykit.engine.forwards import Forwards
    from deploykit.engine.kvcache import growing_cache, with_cache
    from deploykit.engine.mixed import Layout

    seen: list[int] = []
    forward = llama.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    rows = [RequestHandle(GenerationRequest((5, 6, 7, 5, 6), max_new_tokens=8), id=str(i)) for i in range(3)]
    for h in rows:
        h.tokens.append(7)
    fw = Forwards(llama, None, None)
    cache, mask = growing_cache(llama.config), torch.ones(3, 5, dtype=torch.long)
    llama(input_ids=torch.tensor([[5, 6, 7, 5, 6]] * 3), attention_mask=mask, use_cache=True, **with_cache(llama, cache))
    llama.forward = counting
    try:
        logits, _, wide = fw.mixed(rows, None, 0, cache, mask, [[5, 6, 7], [], []])
    finally:
        del llama.forward
    assert seen == [4 + 1 + 1] and logits.shape[0] == 6  # not 3 rows x 4
    assert wide.tolist() == [[1] * 9, [1] * 6 + [0] * 3, [1] * 6 + [0] * 3]
    with torch.inference_mode():  # the copying row's positions are its own: they equal a forward of it alone
        alone = llama(input_ids=torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6, 7]])).logits[0, 5:].float()
    torch.testing.assert_close(logits[:4], alone, atol=1e-4, rtol=1e-4)
    assert Layout(3, cache, wide, None, [4, 1, 1]).packed == 6


def test_a_draft_stops_before_the_first_token_the_grammar_forbids(tmp_path: Path) -> None:
    from chatmodel import build_chat_model

    from deploykit.engine.batching import grammars_for

    base = build_chat_model(tmp_path / "chat")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    row = grammars_for(model, tokenizer, {int(tokenizer.eos_token_id)}).matcher(Constraint(json.dumps(schema)))
    ok = tokenizer('{"a": 12', add_special_tokens=False)["input_ids"]
    bad = tokenizer('x', add_special_tokens=False)["input_ids"]
    assert row.allowed_prefix(ok + bad + ok) == len(ok)
    assert row.allowed_prefix(bad) == 0 and row.allowed_prefix(ok) == len(ok)  # the state was rolled back each time


def test_the_plan_counts_the_verification_positions_in_the_kv_cache() -> None:
    from deploykit.model.structure import Block, Structure
    from deploykit.placement.inventory import Gpu, Inventory
    from deploykit.placement.planner import plan
    from deploykit.spec.schema import Spec

    blocks = tuple(Block(name=f"layers.{i}", modules=(f"layers.{i}",), kind="embedding" if i == 0 else "layer",
                         weight_bytes=1000, flops_per_token=1, kv_bytes_per_token=0 if i == 0 else 2,
                         logits_bytes_per_token=0) for i in range(4))
    toy = Structure(architecture="Toy", model_type="toy", dtype="float16", blocks=blocks, embedding_block=0)
    inventory = Inventory(gpus=(Gpu(0, 1 << 20),))

    def planned(**extra: Any) -> Any:
        return plan(toy, Spec.model_validate({"model": {"path": "/m"}, "serving": {"max_concurrent": 4},
                                              "placement": {"gpus": [0], "reserve": 0, "kv_cache": {"tokens": 100}},
                                              **extra}), inventory)

    plain, fast = planned(), planned(speculative={"method": "ngram", "num_tokens": 5})
    assert plain.kv_cache_tokens == 100 and fast.kv_cache_tokens == 100 + 4 * 6  # 4 rows x (5 drafts + 1)
    assert fast.devices[0].bytes - plain.devices[0].bytes == 4 * 6 * 2 * 3
    assert any("speculative decoding" in note for note in fast.notes)
