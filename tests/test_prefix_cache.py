"""The prefix cache and chunked prefill of the padded loop (deploykit.engine.prefixcache, prefill), on real
tiny models: answers with and without the cache are the same (greedy tokens, logprobs within 1e-4, seeded
sampling and penalties), a conversation's next turn and a shared system prompt are read from it, it stays
within its bytes and lets them go when the engine closes, and a long prompt read in chunks lets a running
stream keep producing tokens where reading it whole stalls it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from deploykit.engine.batching import Engine, GenerationRequest, GenerationResult
from deploykit.engine.prefixcache import BLOCK, PrefixCache
from helpers import wait_until

SYSTEM = [7 + i % 200 for i in range(3 * BLOCK + 5)]  # a shared "system prompt": 3 whole blocks and a part


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


@contextmanager
def engine(model: Any, **kwargs: Any) -> Iterator[Engine]:
    e = Engine(model, None, **kwargs)
    try:
        yield e
    finally:
        e.close(timeout=30)


def run(e: Engine, prompt: list[int], **kwargs: Any) -> GenerationResult:
    return e.submit(GenerationRequest(prompt_ids=prompt, **kwargs)).result(timeout=60)


def test_cached_answers_equal_uncached(llama: Any) -> None:
    """The same requests, one at a time, through an engine with the cache and one without."""
    first = SYSTEM + [30, 31, 32]
    asks = [dict(max_new_tokens=12, logprobs=3),
            dict(max_new_tokens=12, temperature=0.9, top_p=0.8, seed=5, logprobs=2),
            dict(max_new_tokens=12, temperature=1.3, seed=11, presence_penalty=0.7, frequency_penalty=0.4,
                 logit_bias=[(40, 3.0)], logprobs=1)]
    with engine(llama, prefix_cache_bytes=8 << 20) as cached, engine(llama) as plain:
        run(cached, first, max_new_tokens=4)  # keeps the system prompt and its answer
        for i, ask in enumerate(asks):
            prompt = SYSTEM + [60 + i, 61, 62, 63]
            a, b = run(cached, prompt, **ask), run(plain, prompt, **ask)
            assert a.cached_tokens == len(SYSTEM) and b.cached_tokens == 0  # to the token, past its whole blocks
            assert a.token_ids == b.token_ids
            assert a.logprobs is not None and b.logprobs is not None
            for x, y in zip(a.logprobs, b.logprobs):
                assert abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert cached.stats()["prefix_cache_hits"] == 3


def test_a_conversation_reads_its_earlier_turns(llama: Any) -> None:
    """Turn 2 re-sends turn 1's prompt and answer: all of it is cached but the last answer token."""
    turn1 = SYSTEM + [90, 91, 92]
    with engine(llama, prefix_cache_bytes=8 << 20) as cached, engine(llama) as plain:
        answer = run(cached, turn1, max_new_tokens=20).token_ids
        turn2 = turn1 + answer + [93, 94, 95]
        a, b = run(cached, turn2, max_new_tokens=8), run(plain, turn2, max_new_tokens=8)
        assert a.token_ids == b.token_ids
        assert a.cached_tokens == len(turn1) + len(answer) - 1  # the last token had no KV yet


def test_concurrent_requests_sharing_a_prefix(llama: Any) -> None:
    """Hits and misses admitted together, greedy and sampled, still answer as alone."""
    with engine(llama, prefix_cache_bytes=8 << 20) as cached, engine(llama) as plain:
        run(cached, SYSTEM + [1], max_new_tokens=2)
        prompts = [SYSTEM + [70 + i] * (i + 1) for i in range(4)] + [[5, 6, 7], [8] * 20]
        asks = [dict(max_new_tokens=10, temperature=0.7 * (i % 2), seed=i) for i in range(len(prompts))]
        handles = [cached.submit(GenerationRequest(prompt_ids=p, **k)) for p, k in zip(prompts, asks)]
        got = [h.result(timeout=60) for h in handles]
        want = [run(plain, p, **k) for p, k in zip(prompts, asks)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        # a hit prefilled with others reads as much of its cached beginning as the batch's longest
        # uncached tail leaves it (the batch stays left-padded)
        assert all(0 < g.cached_tokens <= len(SYSTEM) for g in got[:4]), [g.cached_tokens for g in got]
        assert [g.cached_tokens for g in got[4:]] == [0, 0]


def test_cached_prompts_joining_running_rows_answer_as_alone_and_a_failing_one_fails_alone(llama: Any) -> None:
    """Prompts whose beginning is cached join rows that are decoding (their cached keys read into the batch's
    buffers, below the running rows): every answer is the uncached engine's, and one whose join fails (an id
    beyond the vocabulary) fails alone, the running row and the others going on unchanged."""
    started, gate = threading.Event(), threading.Event()

    def hold(event: int | GenerationResult) -> None:  # the engine's thread waits at the row's first token
        if isinstance(event, int) and not started.is_set():
            started.set()
            gate.wait(30)

    stream = dict(max_new_tokens=300, logit_bias=[(2, -100.0)])  # EOS (id 2) never comes: it runs throughout
    prompts = [SYSTEM + [80 + i] * (i + 1) for i in range(3)]
    with engine(llama, prefix_cache_bytes=8 << 20) as cached, engine(llama) as plain:
        run(cached, SYSTEM + [1], max_new_tokens=3)
        running = cached.submit(GenerationRequest(prompt_ids=[3, 4, 5], **stream), listener=hold)
        assert started.wait(30)
        handles = [cached.submit(GenerationRequest(prompt_ids=p, max_new_tokens=8)) for p in prompts[:2]]
        bad = cached.submit(GenerationRequest(prompt_ids=SYSTEM + [10_000], max_new_tokens=8))
        handles.append(cached.submit(GenerationRequest(prompt_ids=prompts[2], max_new_tokens=8)))
        gate.set()  # they join the row's next step, however slow the machine
        got = [h.result(timeout=60) for h in handles]
        failed = bad.result(timeout=60)
        assert not running.done  # they joined (and failed) beside the running row
        streamed = running.result(timeout=60)
        assert failed.finish_reason == "error" and "index out of range" in (failed.error or "")
        assert [g.cached_tokens for g in got] == [len(SYSTEM)] * 3
        assert [g.token_ids for g in got] == [run(plain, p, max_new_tokens=8).token_ids for p in prompts]
        assert streamed.token_ids == run(plain, [3, 4, 5], **stream).token_ids


def test_the_cache_stays_within_its_bytes_and_is_freed_on_close(llama: Any) -> None:
    per_token = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads of 16, float32
    room = 5 * BLOCK * per_token  # five blocks: two sequences of two blocks, not three
    with engine(llama, prefix_cache_bytes=room) as cached:
        for i in range(4):
            run(cached, [100 + i] * (2 * BLOCK + 3), max_new_tokens=2)
        stats = wait_stats(cached, lambda s: s["prefix_cache_evictions"] >= 1)
        assert 0 < stats["prefix_cache_bytes"] <= room
    assert cached.stats()["prefix_cache_bytes"] == 0  # closed: the kept KV went with the engine


def wait_stats(e: Engine, ready: Any, timeout: float = 10.0) -> dict[str, int]:
    """The engine's stats once ``ready`` holds (a finished row is kept when it leaves the batch, at the
    engine's next step)."""
    wait_until(lambda: ready(e.stats()), timeout=timeout)
    return e.stats()


def test_prefix_cache_unit_lru_and_extension() -> None:
    """A sequence that extends a kept one replaces it; the least recently used goes first."""
    def kv(n: int) -> list[torch.Tensor]:
        return [torch.randn(1, 2, n, 4)]

    per_token = 2 * 2 * 4 * 4
    cache = PrefixCache(max_bytes=4 * BLOCK * per_token)
    a = list(range(2 * BLOCK))
    cache.insert(a, kv(len(a)), kv(len(a)))
    cache.insert(a + [1] * BLOCK, kv(3 * BLOCK), kv(3 * BLOCK))  # extends a: a is dropped
    assert cache.bytes == 3 * BLOCK * per_token
    hit = cache.lookup(a + [9])
    assert hit is not None and hit.tokens == 2 * BLOCK
    assert cache.lookup(a[:BLOCK]) is None  # nothing left to prefill would remain: no hit on a whole prompt
    b = [500] * (2 * BLOCK)
    cache.insert(b, kv(len(b)), kv(len(b)))  # over max_bytes: the older entry goes
    assert cache.evictions == 1 and cache.bytes == 2 * BLOCK * per_token
    assert cache.lookup(a + [9]) is None and cache.lookup(b + [1]) is not None


def test_prefix_cache_unit_matches_to_the_token() -> None:
    """Found by whole blocks, matched to the token: a kept sequence serves every token a prompt shares with
    it (its part block included), up to the prompt's last token; the best of the sequences sharing the
    blocks serves; keys are the kept ones, position for position."""
    def kv(n: int, seed: int) -> list[torch.Tensor]:
        return [torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).expand(1, 2, n, 4) + 1000 * seed]

    cache = PrefixCache(max_bytes=1 << 20)
    a = list(range(2 * BLOCK + 5))  # two whole blocks and a part
    cache.insert(a, kv(len(a), 1), kv(len(a), 1))
    assert cache.bytes == len(a) * 2 * 2 * 4 * 4  # kept whole, its part block too
    hit = cache.lookup(a + [900, 901])
    assert hit is not None and hit.tokens == len(a)
    assert torch.equal(hit.keys[0][0, 0, :, 0], torch.arange(len(a), dtype=torch.float32) + 1000)
    hit = cache.lookup(a)  # the whole kept sequence as a prompt: all but its last token
    assert hit is not None and hit.tokens == len(a) - 1
    hit = cache.lookup(a[:2 * BLOCK + 2] + [77] * 9)  # shares 2 blocks and 2 tokens
    assert hit is not None and hit.tokens == 2 * BLOCK + 2
    longer = a[:2 * BLOCK] + [55] * 12  # same blocks, a longer part that the next prompt shares
    cache.insert(longer, kv(len(longer), 2), kv(len(longer), 2))
    hit = cache.lookup(longer[:-2] + [1])
    assert hit is not None and hit.tokens == 2 * BLOCK + 10 and hit.keys[0][0, 0, -1, 0] == 2000 + 2 * BLOCK + 9
    assert cache.lookup(list(range(BLOCK - 1)) + [5, 5]) is None  # no whole block shared: not found
    cache.insert(a + [3] * 4, kv(len(a) + 4, 3), kv(len(a) + 4, 3))  # extends a (same blocks, longer part): a goes
    assert len(cache._entries) == 2 and cache.lookup(a + [3, 3, 9]).tokens == len(a) + 2
    cache.insert([8] * (BLOCK - 1), kv(BLOCK - 1, 4), kv(BLOCK - 1, 4))  # under one block: not kept
    assert len(cache._entries) == 2


@pytest.fixture(scope="module")
def long_llama() -> Any:
    """A tiny random Llama with room for prompts of thousands of tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def stream_during_long_prompt(model: Any, chunk: int) -> tuple[list[int], int, float]:
    """A stream runs while a 3,000-token prompt arrives: (its tokens, how many it produced while the
    prompt was read, its median gap between two tokens then: the median, so that one stall of this busy
    machine does not decide)."""
    times: list[float] = []
    started = threading.Event()

    def listen(event: int | GenerationResult) -> None:
        if isinstance(event, int):
            times.append(time.monotonic())
            if len(times) == 5:
                started.set()

    with engine(model, prefill_chunk=chunk) as e:
        stream = e.submit(GenerationRequest(prompt_ids=[3, 4, 5], max_new_tokens=400), listener=listen)
        assert started.wait(30)
        long = e.submit(GenerationRequest(prompt_ids=[(7 * i) % 250 + 3 for i in range(3000)], max_new_tokens=1))
        result = long.result(timeout=120)
        assert result.finish_reason == "length", result.error
        read_from, read_until = long.submitted, long.submitted + (result.time_to_first_token or 0)
        e.cancel(stream)
        tokens = stream.result(timeout=30).token_ids
    during = [t for t in times if read_from <= t <= read_until]
    window = [read_from] + during + [next((t for t in times if t > read_until), read_until)]
    return tokens, len(during), statistics.median(b - a for a, b in zip(window, window[1:]))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: on a busy 2-core machine, two threads wait for each other at every operation, and
    that wait (the same for a forward of 128 tokens as of 3,000) would hide what is measured here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_chunked_prefill_keeps_a_running_stream_flowing(long_llama: Any, one_thread: None) -> None:
    whole_tokens, whole_during, whole_gap = stream_during_long_prompt(long_llama, chunk=100_000)
    chunked_tokens, chunked_during, chunked_gap = stream_during_long_prompt(long_llama, chunk=128)
    shared = min(len(whole_tokens), len(chunked_tokens))
    assert chunked_tokens[:shared] == whole_tokens[:shared]  # the stream's answer does not change
    assert whole_during <= 1  # read whole: the stream waits for all of it (one gap, the whole read)
    assert chunked_during >= 5, (chunked_during, chunked_gap, whole_gap)
    assert chunked_gap < whole_gap / 3, (chunked_gap, whole_gap)


@pytest.mark.parametrize(("serving", "cpu", "held"), [
    ("", "8GiB", 1 << 30),  # the default: a quarter of the KV room, at most 1 GiB
    ("serving: {prefix_cache: {enabled: true}}", "8GiB", 1 << 30),
    ("", "201MiB", 50 << 20),  # a small tier: a quarter of what the weights leave, in whole MiB
    ("", "3MiB", 0),  # a quarter is under 1 MiB: none
    ("serving: {prefix_cache: {max_bytes: 8MiB}}", "8GiB", 8 << 20),
    ("serving: {prefix_cache: {enabled: false}}", "8GiB", 0),
    ("serving: {batching: continuous}", "8GiB", 0),  # transformers' continuous batching keeps none
    ("serving: {batching: continuous, prefix_cache: {enabled: false}}", "8GiB", 0)])
def test_the_plan_and_the_budget_count_the_prefix_cache(model: Any, tmp_path: Any, serving: str, cpu: str,
                                                        held: int) -> None:
    from deploykit.control.budget import plan_tiers
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import load_manifests
    from manifests import manifest_text

    (tmp_path / "m.yaml").write_text(manifest_text(model, cpu=cpu) + (f"  {serving}\n" if serving else ""))
    [loaded] = load_manifests(tmp_path / "m.yaml")
    plan = plan_manifest(loaded, devices="cpu=8GiB")
    assert plan.total_bytes < 1 << 20  # the tiny model: the default's size is all the tier's room
    assert plan.prefix_cache_bytes == held
    assert plan_tiers(plan)["cpu"] == plan.total_bytes + held
    assert ("prefix_cache_bytes" in plan.to_dict()) == bool(held)  # plans without one keep their former shape


def test_a_prefix_cache_that_leaves_the_batch_no_room_is_a_plan_error(model: Any, tmp_path: Any) -> None:
    from deploykit.errors import PlanInfeasible
    from deploykit.placement.planning import plan_manifest
    from deploykit.spec.manifest import load_manifests
    from manifests import manifest_text

    def planned(cpu: str) -> Any:
        (tmp_path / "m.yaml").write_text(manifest_text(model, cpu=cpu) + "  serving: {prefix_cache: {max_bytes: 200MiB}}\n")
        [loaded] = load_manifests(tmp_path / "m.yaml")
        return plan_manifest(loaded, devices="cpu=8GiB")

    with pytest.raises(PlanInfeasible, match=r"max_bytes 200 MiB does not fit.*at most 1[23]\d\.\d MiB") as err:
        planned("201MiB")
    assert err.value.field == "spec.serving.prefix_cache.max_bytes"
    assert planned("1GiB").prefix_cache_bytes == 200 << 20


def test_chunks_are_sized_to_take_about_one_and_a_half_decode_steps_in_whole_row_blocks() -> None:
    from deploykit.engine.prefill import ChunkSizer

    sizer = ChunkSizer(256)
    assert sizer.next(decoding=False) == 256  # nothing else runs: the largest chunk
    assert sizer.next(decoding=True) == 32  # nothing measured yet
    sizer.decoded(0.010)  # a decode step of the running rows: 10 ms
    sizer.read(32, 0.032)  # 1 ms per prompt token
    assert sizer.next(decoding=True) == 16  # 15 tokens take 1.5 steps; 16 at least
    assert sizer.next(True, rows=2) == 18  # 2 running rows beside it: rounded up to whole blocks of 4 rows
    assert sizer.next(True, rows=4) == 16 and sizer.next(True, rows=5) == 19
    for _ in range(30):  # prompt tokens get cheaper (a faster machine, a bigger chunk): chunks grow
        sizer.read(64, 0.016)
    assert 55 <= sizer.next(decoding=True) <= 61  # 1.5 * 10 ms / 0.25 ms
    for _ in range(30):
        sizer.decoded(1.0)  # slow steps: the chunk is bounded by prefill_chunk
    assert sizer.next(decoding=True) == 256
    assert sizer.next(True, rows=3) == 256  # never past the largest chunk
    assert sizer.next(decoding=False) == 256


def test_continuous_batching_refuses_a_prefix_cache_it_would_not_keep(model: Any, tmp_path: Any) -> None:
    """The default is sized where prefixes are kept (none with continuous batching: the plan counts 0, as
    above); a size or switch named for continuous batching would be ignored, so it is refused at the field."""
    from deploykit.errors import ManifestError
    from deploykit.spec.manifest import load_manifests
    from manifests import manifest_text

    (tmp_path / "m.yaml").write_text(manifest_text(model) + "  serving: {batching: continuous, prefix_cache: "
                                                            "{max_bytes: 8MiB}}\n")
    with pytest.raises(ManifestError, match="needs batching: padded") as err:
        load_manifests(tmp_path / "m.yaml")
    assert err.value.issues[0].field.startswith("spec.serving.prefix_cache")


@pytest.mark.parametrize(("budget", "held"), [(None, 1 << 30), (200 << 20, 49 << 20), (3 << 20, 0)])
def test_under_a_host_budget_the_default_prefix_cache_is_sized_within_its_cpu_tier(
        model: Any, tmp_path: Any, budget: int | None, held: int) -> None:
    """`deploykit serve --budget cpu=...`: the default cache takes a quarter of what the budget's CPU tier
    leaves beside the weights (whole MiB), so a default manifest fits the budget it runs in."""
    from deploykit.control.revisions.change import Change
    from deploykit.spec.manifest import load_manifests
    from manifests import manifest_text

    (tmp_path / "m.yaml").write_text(manifest_text(model, cpu="64GiB"))
    [loaded] = load_manifests(tmp_path / "m.yaml")
    plan = Change(loaded, "cpu=64GiB", budget_cpu=budget).plan()
    assert plan.prefix_cache_bytes == held


def test_prefix_cache_unit_keys_entries_by_adapter_slot() -> None:
    """KV computed with an adapter slot is found by that slot only (never the base's or another slot's), and
    ``retain`` drops the slots that left the model."""
    cache = PrefixCache(1 << 20)
    ids = list(range(40))
    kv = [torch.full((1, 2, 40, 4), 1.0)]
    cache.insert(ids, kv, kv, key="pirate~1")
    assert cache.lookup(ids + [99]) is None
    assert cache.lookup(ids + [99], "pirate~2") is None
    hit = cache.lookup(ids + [99], "pirate~1")
    assert hit is not None and hit.tokens == 40
    cache.insert(ids, kv, kv)  # the base's own copy of the same tokens
    assert cache.lookup(ids + [99]) is not None
    cache.retain({""})
    assert cache.lookup(ids + [99], "pirate~1") is None and cache.lookup(ids + [99]) is not None
    assert cache.bytes == 40 * 2 * 4 * 4 * 2
