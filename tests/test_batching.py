"""The batching engine (deploykit.engine.batching) on real models, no mocks: a tiny random Llama for
the mechanics (greedy equality with ``generate``, requests joining mid-flight, cancel, queue limits,
stop ids and strings, seeded sampling, listeners, stats, the forward lock, a failing batch).

The real SmolLM2-135M-Instruct goes through this engine in tests/test_serve_smollm2.py (concurrent
requests of different lengths included), which already pays for loading it.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from deploykit.engine.batching import Engine, GenerationRequest, GenerationResult, QueueFull
from deploykit.engine.padded import PaddedBackend
from deploykit.errors import DeploykitError
from helpers import Hold
from penalties import Penalties

BACKENDS = ["padded", pytest.param("continuous", marks=pytest.mark.continuous)]
Reference = Callable[[tuple[int, ...], int], list[int]]


class CharTokenizer:
    """What the engine needs of a tokenizer (``decode``, for stop strings), one character per id: every
    tail of the ids decodes to a substring of the whole text, which random ids through a byte-level
    tokenizer would not (half characters)."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[[str], Path]) -> Any:
    """The tiny random Llama (4 layers, vocabulary 256, EOS id 2), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


def generate(model: Any, prompt: list[int] | tuple[int, ...], max_new: int) -> list[int]:
    """Plain single-sequence greedy ``generate``: the generated ids only (EOS included)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.fixture(scope="module")
def reference(llama: Any) -> Reference:
    """Cached ``generate``. Call it before an engine starts: the continuous backend switches the model's
    attention implementation while it runs."""
    return cache(lambda prompt, max_new: generate(llama, prompt, max_new))


def prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` random prompts of 3..39 ids (ids >= 4: no BOS/EOS/pad inside a prompt)."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(4, 256) for _ in range(rng.randrange(3, 40))) for _ in range(n)]


@contextmanager
def engine(model: Any, **kwargs: Any) -> Iterator[Engine]:
    """An engine with the tests' tokenizer, closed however the test ends."""
    eng = Engine(model, CharTokenizer(), **kwargs)
    try:
        yield eng
    finally:
        eng.close(timeout=30)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---- greedy equality ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_greedy_equals_generate(llama: Any, reference: Reference, backend: str) -> None:
    ps = prompts(8)
    expected = [reference(p, 20) for p in ps]
    with engine(llama, backend=backend, max_batch_size=8) as eng:
        handles = [eng.submit(GenerationRequest(p, max_new_tokens=20)) for p in ps]
        for p, want, h in zip(ps, expected, handles):
            res = h.result(timeout=120)
            assert res.token_ids == want
            assert res.finish_reason == ("stop" if len(want) < 20 else "length")
            assert (res.prompt_tokens, res.completion_tokens) == (len(p), len(res.token_ids))
            assert res.time_to_first_token is not None and res.error is None


def test_requests_join_a_running_batch_and_stream(llama: Any, reference: Reference) -> None:
    ps = prompts(6, seed=1)
    expected = [reference(p, 20) for p in ps]
    with engine(llama, max_batch_size=8) as eng:
        first = [eng.submit(GenerationRequest(p, max_new_tokens=20)) for p in ps[:3]]
        streamed = [next(iter(first[0]))]  # a token came out: the batch is running
        late = [eng.submit(GenerationRequest(p, max_new_tokens=20)) for p in ps[3:]]
        streamed += list(first[0])
        assert streamed == first[0].result(timeout=60).token_ids
        assert [h.result(timeout=120).token_ids for h in first + late] == expected


def test_running_rows_and_a_long_prompt_share_forwards_and_equal_generate(llama: Any, reference: Reference) -> None:
    """Mixed steps (deploykit.engine.mixed): a prompt longer than prefill_chunk arrives while rows decode; each
    forward then holds the rows' next tokens and a chunk of it. Every answer, the rows' and the prompt's,
    equals generate's."""
    rows = [p for p in prompts(30, seed=3) if len(reference(p, 40)) == 40][:3]  # none ends early (EOS)
    long = tuple((7 * i) % 250 + 4 for i in range(150))
    expected = [reference(p, 40) for p in rows] + [reference(long, 8)]
    with engine(llama, max_batch_size=8, prefill_chunk=16) as eng:
        hold = Hold()
        running = [eng.submit(GenerationRequest(p, max_new_tokens=40), listener=hold if i == 2 else None)
                   for i, p in enumerate(rows)]
        hold.wait()  # a token came out: the rows decode
        read = eng.submit(GenerationRequest(long, max_new_tokens=8))
        hold.release()
        streamed = list(running[0])
        assert [h.result(timeout=120).token_ids for h in running + [read]] == expected
        assert streamed == expected[0]
        assert read.result().cached_tokens == 0
        assert eng.mixed_steps >= 1


def test_a_small_kv_budget_runs_requests_one_after_another(llama: Any, reference: Reference) -> None:
    ps = prompts(3, seed=2)
    expected = [reference(p, 12) for p in ps]
    order: list[int] = []  # which request each event belonged to, as the engine produced them

    def tag(i: int) -> Callable[[int | GenerationResult], None]:
        return lambda _: order.append(i)

    with engine(llama, max_batch_size=8, kv_cache_bytes=1) as eng:  # no two rows fit: no batching at all
        handles = [eng.submit(GenerationRequest(p, max_new_tokens=12), listener=tag(i)) for i, p in enumerate(ps)]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
    assert order == sorted(order)  # each request ran to its end before the next one started


# ---- cancel, queue limits, stop conditions, sampling ----------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_cancel_frees_the_slot(llama: Any, backend: str) -> None:
    with engine(llama, backend=backend, max_batch_size=2, max_queued=2, context_length=16_384) as eng:
        h = eng.submit(GenerationRequest([5, 6, 7], max_new_tokens=10_000))  # runs until cancelled
        next(iter(h))
        eng.cancel(h)
        res = h.result(timeout=5)
        assert res.finish_reason == "cancelled" and len(res.token_ids) < 10_000
        ok = eng.submit(GenerationRequest([9, 10, 11], max_new_tokens=5)).result(timeout=60)
        assert ok.finish_reason in ("stop", "length") and ok.completion_tokens <= 5
        assert wait_until(lambda: eng.stats() == {"running": 0, "waiting": 0})


def test_queue_full_is_a_deploykit_error_and_cancelled_waiters_make_room(llama: Any) -> None:
    assert issubclass(QueueFull, DeploykitError)
    with engine(llama, max_batch_size=1, max_queued=2) as eng:
        running = eng.submit(GenerationRequest([5, 6], max_new_tokens=10_000))
        next(iter(running))  # decoding: the next two wait
        waiting = [eng.submit(GenerationRequest([5, 6], max_new_tokens=10)) for _ in range(2)]
        with pytest.raises(QueueFull, match="2 requests already waiting"):
            eng.submit(GenerationRequest([5, 6], max_new_tokens=10))
        eng.cancel(waiting[0])  # a cancelled waiter no longer counts
        waiting.append(eng.submit(GenerationRequest([5, 6], max_new_tokens=10)))
        for h in (*waiting, running):
            eng.cancel(h)


def test_stop_ids_stop_strings_and_seeded_sampling(llama: Any, reference: Reference) -> None:
    p = prompts(1, seed=3)[0]
    ref = reference(p, 12)
    assert len(ref) == 12 and 2 not in ref  # the stops below cut a full-length generation
    text = CharTokenizer().decode(ref)
    with engine(llama) as eng:
        r = eng.submit(GenerationRequest(p, max_new_tokens=12, stop_token_ids=[ref[4]])).result(timeout=60)
        assert r.finish_reason == "stop" and r.token_ids == ref[: ref.index(ref[4]) + 1]
        r = eng.submit(GenerationRequest(p, max_new_tokens=12, stop_strings=[text[5:7]])).result(timeout=60)
        end = text.index(text[5:7]) + 2  # ends on the token that completes the stop string
        assert r.finish_reason == "stop" and r.token_ids == ref[:end]
        sampled = GenerationRequest(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=42)
        a, b = eng.submit(sampled), eng.submit(sampled)  # one batch, one seed: the same tokens
        c = eng.submit(GenerationRequest(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7))
        assert a.result(timeout=60).token_ids == b.result(timeout=60).token_ids
        assert c.result(timeout=60).token_ids != a.result().token_ids


@pytest.mark.parametrize(("version", "refused"), [("5.17.0", True), ("5.23.0", True), ("5.24.0", False),
                                                   ("5.24.1.dev0", False), ("6.0.0", False)])
def test_the_continuous_backend_names_the_transformers_it_needs(version: str, refused: bool) -> None:
    from deploykit.engine.continuous import continuous_refusal

    refusal = continuous_refusal(version)
    assert (refusal is not None) == refused
    if refusal:
        assert "needs transformers 5.24 or later" in refusal and f"transformers {version} is installed" in refusal
        assert "spec.serving.batching: continuous" in refusal and "batching: padded" in refusal


def test_on_an_older_transformers_the_continuous_backend_is_refused_and_padded_serves(llama: Any,
                                                                                     reference: Reference) -> None:
    """What ``make test-lowest`` (transformers 5.17) checks: the engine refuses the continuous backend with
    the reason before touching the model, and the padded loop serves the same model."""
    import transformers

    from deploykit.engine.continuous import continuous_refusal

    refusal = continuous_refusal(transformers.__version__)
    if refusal is None:
        pytest.skip(f"transformers {transformers.__version__} runs the continuous backend")
    with pytest.raises(ValueError, match="needs transformers 5.24 or later"):
        with engine(llama, backend="continuous"):
            pass
    p = prompts(1, seed=7)[0]
    with engine(llama, backend="padded") as eng:
        assert eng.submit(GenerationRequest(p, max_new_tokens=8)).result(timeout=60).token_ids == reference(p, 8)


@pytest.mark.continuous
def test_the_continuous_backend_refuses_sampling(llama: Any) -> None:
    with engine(llama, backend="continuous") as eng:
        with pytest.raises(ValueError, match="greedy-only"):
            eng.submit(GenerationRequest([5, 6], temperature=0.7))
        assert eng.stats() == {"running": 0, "waiting": 0}


@pytest.mark.continuous
def test_the_continuous_backend_sizes_its_cache_when_the_budget_is_the_whole_host(llama: Any,
                                                                                   reference: Reference) -> None:
    """The budget deploykit passes is what the device tier has left after the weights (most of the host):
    the paged cache, allocated up front, takes at most 1 GiB of it and the manager answers."""
    p = prompts(1, seed=9)[0]
    expected = reference(p, 8)
    with engine(llama, backend="continuous", kv_cache_bytes=1 << 40) as eng:
        assert eng.submit(GenerationRequest(p, max_new_tokens=8)).result(timeout=120).token_ids == expected


@pytest.mark.continuous
def test_the_continuous_backend_refuses_a_request_longer_than_its_cache(llama: Any, reference: Reference) -> None:
    """transformers' manager ends its thread on a request its paged cache cannot hold: refused at submit."""
    p = prompts(1, seed=10)[0]
    expected = reference(p, 8)
    with engine(llama, backend="continuous", max_batch_size=1, context_length=128) as eng:  # 2 pages of 64
        with pytest.raises(ValueError, match="exceeds the 128 tokens"):
            eng.submit(GenerationRequest(list(range(4, 104)), max_new_tokens=64))
        assert eng.submit(GenerationRequest(p, max_new_tokens=8)).result(timeout=120).token_ids == expected


def transformers_footprint(model: Any, cfg: Any) -> int:
    """The footprint transformers' own ``PagedAttentionMemoryHandler`` computes for ``cfg.num_blocks`` (what
    ``_check_footprint`` compares with the memory it sees when the manager starts), with the sector geometry
    its ``PagedAttentionCache`` computes, built on the meta device."""
    from dataclasses import replace

    from transformers.generation.continuous_batching.cache import (PagedAttentionCache,
                                                                   PagedAttentionMemoryHandler)
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    text, keeps = model.config.get_text_config(), model._supports_logits_to_keep()
    geometry = PagedAttentionCache(text, replace(cfg, num_blocks=1), device="meta", dtype=model.dtype,
                                   distributed_helper=DistributedHelper(None, None),
                                   model_supports_logits_to_keep=keeps)
    block = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * cfg.page_size * 2  # bf16 K, V
    handler = PagedAttentionMemoryHandler(
        config=text, cb_config=cfg, dtype=model.dtype, bytes_per_sector=geometry.bytes_per_sector,
        tokens_per_sector=geometry.tokens_per_sector, bytes_per_block=block,
        attn_types=list(geometry.cache_allocators), model_supports_logits_to_keep=keeps)
    return int(handler.compute_memory_footprint(cfg.max_batch_tokens, handler.num_sectors_from_config()))


@pytest.mark.continuous
@pytest.mark.parametrize("budget,tokens", [(131_000_000_000, 16 * 8192), (3_000_000_000, None)])
def test_the_continuous_cache_fits_transformers_footprint_within_the_budget(budget: int, tokens: int | None) -> None:
    """A Llama-3.2-1B-shaped model (bfloat16, on the meta device) and what a GPU tier has left: the paged
    cache's footprint by transformers' arithmetic (K and V read back per cached token, masks, activations)
    stays within the budget, and the cache holds no more than 16 requests of 8192 tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deploykit.engine.continuous import cache_config

    config = AutoConfig.from_pretrained(Path(__file__).parents[1] / "gpucheck" / "configs" / "llama-3.2-1b.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    cfg, size = cache_config(model, page_size=64, max_batch_size=16, max_queued=64, budget=budget,
                             context_length=8192)
    footprint = transformers_footprint(model, cfg)
    assert footprint == size.footprint and footprint <= min(budget, size.budget)
    if tokens is not None:  # the engine's own limit, not the memory, sizes it
        assert size.tokens == tokens == cfg.num_blocks * 64
    else:  # the budget sizes it: one block more would not fit
        assert size.tokens < 16 * 8192 and footprint > budget - (footprint // cfg.num_blocks) * 2


def test_bad_requests_are_refused_at_submit(llama: Any) -> None:
    with engine(llama) as eng:
        for bad in (GenerationRequest([]), GenerationRequest([5], max_new_tokens=-1)):
            with pytest.raises(ValueError):
                eng.submit(bad)
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(GenerationRequest([5]))


def test_a_failing_batch_fails_its_requests_not_the_engine(llama: Any, reference: Reference) -> None:
    p = prompts(1, seed=5)[0]
    expected = reference(p, 6)
    with engine(llama) as eng:
        bad = eng.submit(GenerationRequest([5, 10_000], max_new_tokens=4)).result(timeout=60)  # id > vocab
        assert bad.finish_reason == "error" and bad.error and bad.token_ids == []
        assert eng.submit(GenerationRequest(p, max_new_tokens=6)).result(timeout=60).token_ids == expected


def padded_head_model(tiny_model: Callable[[str], Path]) -> tuple[Any, int]:
    """The tiny Llama with 44 output ids beyond its embedding (as padded heads have), never chosen unless a
    logit_bias of +100 lifts one; and its embedding's vocabulary size."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    rows = model.config.vocab_size
    head = torch.nn.Linear(model.config.hidden_size, rows + 44, bias=True)
    with torch.no_grad():
        head.weight[:rows] = model.get_output_embeddings().weight
        head.weight[rows:] = 0.0
        head.bias.zero_()
        head.bias[rows:] = -50.0
    model.lm_head = head
    return model, rows


def test_a_row_that_fails_a_decode_step_fails_alone(tiny_model: Callable[[str], Path]) -> None:
    """A model whose output vocabulary is larger than its embedding (as padded heads are): a request that
    makes it choose an id beyond the embedding fails at its next decode step, a step it shares with
    another request, which goes on and still equals ``generate``."""
    model, rows = padded_head_model(tiny_model)
    p = prompts(1, seed=11)[0]
    expected = generate(model, p, 40)
    assert max(expected) < rows
    with engine(model, max_batch_size=4) as eng:
        good = eng.submit(GenerationRequest(p, max_new_tokens=40))
        next(iter(good))  # decoding: the bad request joins a running batch
        bad = eng.submit(GenerationRequest(p, max_new_tokens=12, logit_bias=((rows + 7, 100.0),)))
        failed = bad.result(timeout=60)
        assert failed.finish_reason == "error" and "index out of range" in (failed.error or "")
        assert failed.token_ids == [rows + 7]  # chosen at the join, fatal at the first shared decode step
        assert good.result(timeout=60).token_ids == expected
        assert eng.submit(GenerationRequest(p, max_new_tokens=40)).result(timeout=60).token_ids == expected


def test_a_row_that_fails_a_mixed_step_fails_alone(tiny_model: Callable[[str], Path]) -> None:
    """The same bad request joins rows that share their forwards with a long prompt being read (mixed
    steps): the forward fails, the rows' and the prompt's caches drop what it appended, the bad row fails
    alone, and the other row and the prompt still equal ``generate``."""
    model, rows = padded_head_model(tiny_model)
    p = prompts(1, seed=11)[0]
    long = tuple((7 * i) % 250 + 4 for i in range(200))
    expected, read_expected = generate(model, p, 40), generate(model, long, 6)
    with engine(model, max_batch_size=4, prefill_chunk=16) as eng:
        hold = Hold()
        good = eng.submit(GenerationRequest(p, max_new_tokens=40), listener=hold)
        hold.wait()
        read = eng.submit(GenerationRequest(long, max_new_tokens=6))  # read a chunk per forward of the rows
        bad = eng.submit(GenerationRequest(p, max_new_tokens=12, logit_bias=((rows + 7, 100.0),)))
        hold.release()
        failed = bad.result(timeout=60)
        assert failed.finish_reason == "error" and "index out of range" in (failed.error or "")
        assert good.result(timeout=60).token_ids == expected
        assert read.result(timeout=60).token_ids == read_expected
        assert eng.mixed_steps >= 1


def test_a_prompt_that_fails_a_mixed_step_fails_alone(llama: Any, reference: Reference) -> None:
    """A long prompt holding an id beyond the vocabulary arrives while a row decodes: the mixed forward
    fails, the row's step runs again alone, the prompt's chunk alone then fails it alone, and the row still
    equals ``generate`` (a failed mixed step that retried the pair would loop for ever)."""
    p = next(p for p in prompts(30, seed=5) if len(reference(p, 200)) == 200)  # no EOS: the row runs on
    expected = reference(p, 200)
    bad = tuple(300 if i == 20 else (7 * i) % 250 + 4 for i in range(100))
    with engine(llama, max_batch_size=4, prefill_chunk=16) as eng:
        hold, seen = Hold(), []
        good = eng.submit(GenerationRequest(p, max_new_tokens=200), listener=hold)
        hold.wait()
        failing = eng.submit(GenerationRequest(bad, max_new_tokens=4),  # its end, seen on the engine's thread
                             listener=lambda e: isinstance(e, GenerationResult) and seen.append(good.done))
        hold.release()
        failed = failing.result(timeout=60)
        assert seen == [False]  # failed while the row decodes, not once the row had left the batch
        assert failed.finish_reason == "error" and "index out of range" in (failed.error or "")
        assert good.result(timeout=60).token_ids == expected


def test_when_the_retry_alone_fails_too_the_rows_fail_and_the_engine_goes_on(llama: Any, reference: Reference,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch-wide failure (out of memory) can fail the rows' retry as well: they fail, the engine lives."""
    from deploykit.engine.forwards import Forwards

    ps = prompts(3, seed=12)
    expected = reference(ps[2], 8)
    pairs = {"decode": 0}
    decode = Forwards.decode

    def failing(self: Any, rows: Any, cache: Any, mask: Any) -> Any:
        # The second step that decodes both rows fails, whenever the second row joined (a step count
        # alone would depend on the scheduler's timing).
        pairs["decode"] += len(rows) == 2
        if pairs["decode"] == 2 and len(rows) == 2:
            raise MemoryError("the batch step")
        return decode(self, rows, cache, mask)

    def no_room(self: Any, *args: Any) -> Any:
        raise MemoryError("the retry")

    monkeypatch.setattr(Forwards, "decode", failing)
    monkeypatch.setattr(Forwards, "decode_apart", no_room)
    with engine(llama, max_batch_size=4) as eng:
        hold = Hold()
        first = [eng.submit(GenerationRequest(ps[0], max_new_tokens=30), listener=hold)]
        hold.wait()
        first.append(eng.submit(GenerationRequest(ps[1], max_new_tokens=30)))  # joins while the first decodes
        hold.release()
        results = [h.result(timeout=60) for h in first]
        assert [r.finish_reason for r in results] == ["error", "error"]
        assert all("the retry" in (r.error or "") for r in results)
        assert eng.submit(GenerationRequest(ps[2], max_new_tokens=8)).result(timeout=60).token_ids == expected


# ---- listeners, stats, the forward lock, threads -----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_listener_gets_every_id_in_order_then_one_result(llama: Any, reference: Reference, backend: str) -> None:
    ps = prompts(3, seed=6)
    expected = [reference(p, 15) for p in ps]
    events: list[list[int | GenerationResult]] = [[] for _ in ps]
    threads: set[str] = set()

    def listener(i: int) -> Callable[[int | GenerationResult], None]:
        def on(event: int | GenerationResult) -> None:
            threads.add(threading.current_thread().name)
            events[i].append(event)
        return on

    with engine(llama, backend=backend) as eng:
        handles = [eng.submit(GenerationRequest(p, max_new_tokens=15), listener=listener(i))
                   for i, p in enumerate(ps)]
        results = [h.result(timeout=60) for h in handles]
    for want, got, res in zip(expected, events, results):
        assert got[:-1] == want == res.token_ids  # every id, in order, before the result
        assert got[-1] is res  # then exactly one result, the handle's own
    assert threads == {f"deploykit-engine-{backend}"}  # called from the engine's thread, never the caller's


def test_a_cancelled_request_tells_its_listener_once(llama: Any) -> None:
    events: list[int | GenerationResult] = []
    first = threading.Event()

    def on(event: int | GenerationResult) -> None:
        events.append(event)
        first.set()

    with engine(llama) as eng:
        h = eng.submit(GenerationRequest([5, 6, 7], max_new_tokens=10_000), listener=on)
        assert first.wait(30)
        eng.cancel(h)
        eng.cancel(h)  # twice: still one result
        res = h.result(timeout=5)
        assert wait_until(lambda: eng.stats()["running"] == 0)  # the row has left the batch
    results = [e for e in events if isinstance(e, GenerationResult)]
    assert results == [res] and res.finish_reason == "cancelled"
    assert events[-1] is res and events[:-1] == res.token_ids


def test_stats_count_running_and_waiting_requests(llama: Any) -> None:
    with engine(llama, max_batch_size=2) as eng:
        assert eng.stats() == {"running": 0, "waiting": 0}
        running = [eng.submit(GenerationRequest([5 + i, 6], max_new_tokens=10_000)) for i in range(2)]
        for h in running:
            next(iter(h))
        waiting = [eng.submit(GenerationRequest([7, 8], max_new_tokens=10_000)) for _ in range(3)]
        assert eng.stats() == {"running": 2, "waiting": 3}
        eng.cancel(waiting[0])
        assert eng.stats() == {"running": 2, "waiting": 2}  # cancelled waiters are not counted
        for h in waiting[1:]:
            eng.cancel(h)
        eng.cancel(running[0])
        assert wait_until(lambda: eng.stats() == {"running": 1, "waiting": 0})
        eng.cancel(running[1])
        assert wait_until(lambda: eng.stats() == {"running": 0, "waiting": 0})


def test_a_forward_lock_forces_padded_and_guards_every_forward(llama: Any, reference: Reference) -> None:
    p = prompts(1, seed=7)[0]
    expected = reference(p, 8)
    lock = threading.Lock()
    with engine(llama, backend="continuous", forward_lock=lock) as eng:
        assert eng.backend == "padded" and isinstance(eng._batcher, PaddedBackend)
        with lock:  # held by someone else (offload hooks, another engine): no forward may run
            h = eng.submit(GenerationRequest(p, max_new_tokens=8))
            assert wait_until(lambda: eng.stats() == {"running": 1, "waiting": 0})  # in the batch, at the forward
            assert h.tokens == [] and not h.done
        assert h.result(timeout=60).token_ids == expected


def test_asyncio_clients_through_call_soon_threadsafe(llama: Any, reference: Reference) -> None:
    """What the server does: submit on the event loop, receive through ``call_soon_threadsafe``."""
    ps = prompts(5, seed=4)
    expected = [reference(p, 8) for p in ps]

    async def one(eng: Engine, p: tuple[int, ...]) -> list[int | GenerationResult]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue[int | GenerationResult]()

        def put(event: int | GenerationResult) -> None:  # engine thread -> event loop
            loop.call_soon_threadsafe(queue.put_nowait, event)

        eng.submit(GenerationRequest(p, max_new_tokens=8), listener=put)
        events = [await queue.get()]
        while not isinstance(events[-1], GenerationResult):
            events.append(await queue.get())
        return events

    async def main(eng: Engine) -> list[list[int | GenerationResult]]:
        return await asyncio.gather(*(one(eng, p) for p in ps))

    with engine(llama) as eng:
        outs = asyncio.run(main(eng))
    for want, events in zip(expected, outs):
        assert events[:-1] == want



# ---- per-request logits work, and one bad request among good ones ------------------------------------

def test_penalties_and_logit_bias_match_a_logits_processor(llama: Any) -> None:
    from transformers import LogitsProcessorList

    cases = [(0.0, 1.5, {}), (1.2, 0.0, {}), (-0.8, 0.7, {}), (0.0, 0.0, {7: 100.0}), (0.5, 0.5, {9: -100.0, 11: 5.0})]
    p = prompts(1, seed=11)[0]
    expected = []
    for presence, frequency, bias in cases:
        with torch.inference_mode():
            out = llama.generate(torch.tensor([list(p)]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList(
                                     [Penalties(len(p), presence, frequency, bias)]))
        expected.append(out[0, len(p):].tolist())
    assert len({tuple(e) for e in expected} | {tuple(generate(llama, p, 12))}) > 3  # the settings matter
    with engine(llama) as eng:
        handles = [eng.submit(GenerationRequest(p, max_new_tokens=12, presence_penalty=presence,
                                                frequency_penalty=frequency, logit_bias=tuple(bias.items())))
                   for presence, frequency, bias in cases]
        assert [h.result(timeout=60).token_ids for h in handles] == expected


def test_logprobs_are_the_models_own_before_bias(llama: Any) -> None:
    p = list(prompts(1, seed=12)[0])
    with engine(llama) as eng:
        got = eng.submit(GenerationRequest(p, max_new_tokens=5, logprobs=3, prompt_logprobs=2,
                                           logit_bias=((7, 100.0),))).result(timeout=60)
    ids = torch.tensor([p + got.token_ids])
    with torch.inference_mode():
        logp = torch.log_softmax(llama(ids).logits[0].float(), -1)
    assert got.token_ids == [7] * 5  # the bias chose the tokens ...
    assert got.logprobs is not None and got.prompt_logprobs is not None
    for step, lp in enumerate(got.logprobs):  # ... the logprobs are the model's own
        row = logp[len(p) - 1 + step]
        assert lp.token == 7 and abs(lp.logprob - float(row[7])) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert [lp.token for lp in got.prompt_logprobs] == p[1:]
    assert max(abs(lp.logprob - float(logp[i, p[i + 1]])) for i, lp in enumerate(got.prompt_logprobs)) < 1e-4


def test_max_new_tokens_zero_answers_the_prompt_logprobs_only(llama: Any) -> None:
    with engine(llama) as eng:
        got = eng.submit(GenerationRequest([5, 6, 7], max_new_tokens=0, prompt_logprobs=0)).result(timeout=60)
    assert got.finish_reason == "length" and got.token_ids == []
    assert got.prompt_logprobs is not None and [lp.token for lp in got.prompt_logprobs] == [6, 7]


def test_one_failing_request_does_not_fail_the_batch(llama: Any, reference: Reference) -> None:
    good = prompts(3, seed=13)
    expected = [reference(p, 8) for p in good]
    with engine(llama) as eng:
        gate = threading.Event()  # hold the engine so that all requests join one step
        eng.submit(GenerationRequest([5], max_new_tokens=1), listener=lambda _: gate.wait(30))
        handles = [eng.submit(GenerationRequest(p, max_new_tokens=8)) for p in good[:2]]
        bad_prompt = eng.submit(GenerationRequest([5, 10_000], max_new_tokens=4))  # prefill fails
        bad_bias = eng.submit(GenerationRequest(good[2], max_new_tokens=8, logit_bias=((10_000, 1.0),)))  # sampling
        handles.append(eng.submit(GenerationRequest(good[2], max_new_tokens=8)))
        gate.set()
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        for bad in (bad_prompt, bad_bias):
            assert bad.result(timeout=60).finish_reason == "error"
