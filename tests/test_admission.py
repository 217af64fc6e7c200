"""The one admission core, seen through the two engines that run here without Ray: the in-process
batching engine and the pipeline engine over stages in this process (``LocalPipeline``). Same
interface (``TextEngine``), same bounded queue, same stop rule, same greedy tokens."""

from __future__ import annotations

import threading

import pytest

from deploykit.cluster.pipeline import LocalPipeline, split_layers
from deploykit.cluster.runtime import PipelineEngine
from deploykit.cluster.stage import StageSpec
from deploykit.engine.admission import EngineClosed, QueueFull
from deploykit.engine.batching import Engine, GenerationRequest
from deploykit.engine.serving import TextEngine

PROMPT = [5, 6, 7, 8]


def in_process(model_dir, **limits):
    from transformers import AutoModelForCausalLM

    return Engine(AutoModelForCausalLM.from_pretrained(model_dir), None, **limits)


def pipeline(model_dir, **limits):
    specs = [StageSpec(i, 2, a, b, str(model_dir)) for i, (a, b) in enumerate(split_layers(4, 2))]
    return PipelineEngine(LocalPipeline(specs), None, set(), **limits)


@pytest.fixture(params=[in_process, pipeline], ids=["in-process", "pipeline"])
def make(request, tiny_model):
    engines = []

    def build(**limits):
        engines.append(request.param(tiny_model("llama"), **limits))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close(30)


def test_one_bounded_queue_for_every_engine(make):
    engine = make(max_batch_size=1, max_queued=1)
    assert isinstance(engine, TextEngine)
    first, release = threading.Event(), threading.Event()

    def hold(item) -> None:  # holds the engine's worker on the first token: the slot stays taken
        if isinstance(item, int) and not first.is_set():
            first.set()
            release.wait(60)

    running = engine.submit(GenerationRequest(PROMPT, 6), hold)
    assert first.wait(60)
    waiting = engine.submit(GenerationRequest(PROMPT, 6))
    assert engine.stats() == {"running": 1, "waiting": 1}
    with pytest.raises(QueueFull):
        engine.submit(GenerationRequest(PROMPT, 6))
    engine.cancel(waiting)  # a cancelled request gives its place back at once
    assert waiting.result(5).finish_reason == "cancelled" and engine.stats()["waiting"] == 0
    last = engine.submit(GenerationRequest(PROMPT, 6))
    release.set()
    done = [running.result(60), last.result(60)]
    assert [(r.finish_reason, r.completion_tokens) for r in done] == [("length", 6), ("length", 6)]
    assert done[0].token_ids == done[1].token_ids  # greedy: the same continuation
    engine.close(30)
    with pytest.raises(EngineClosed):
        engine.submit(GenerationRequest(PROMPT, 6))
    with pytest.raises(ValueError):
        make().submit(GenerationRequest([], 6))


def test_engines_agree_token_for_token(tiny_model):
    """The pipeline engine and the in-process engine share the stop rule and the sampler."""
    engines = [in_process(tiny_model("llama")), pipeline(tiny_model("llama"))]
    try:
        outs = [[e.submit(GenerationRequest(p, 8, stop_token_ids=(3,))).result(60) for p in (PROMPT, [9, 10])]
                for e in engines]
        assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]
    finally:
        for e in engines:
            e.close(30)
