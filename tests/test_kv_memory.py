"""The padded loop's KV cache holds no more than the KV budget the plan leaves it, while its batch grows
(rows join, buffers grow) and shrinks (rows end at different lengths).

Measured, not computed from deploykit's own accounting: as every forward enters the model's first decoder
layer (a forward pre-hook, on the engine's thread), every CPU tensor alive in the process (found by the
garbage collector; views counted once, by their storage) that was not there before the engine started:
the KV cache, whatever old buffers are still referenced, the step's inputs and hidden states. The peak
must stay within the budget (margin: none; what is not KV here is a few KiB of inputs, masks and
activations, against the one layer in transit that admission counts beside the buffers' headroom), and
must come near it (so that the budget is what limits the batch). Before, a row that left kept every
layer's old buffer alive beside the rows copied out of it until the next forward replaced them (twice the
batch's KV at the next step's start, three times per layer while it grew), and admission did not count
the buffers' 64 positions of headroom.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deploykit.engine.batching import Engine, GenerationRequest
from test_batching import CharTokenizer

BUDGET = 1 << 20  # the engine's KV budget (what the plan leaves the input device's tier)


def storages(exclude: set[int]) -> dict[int, int]:
    """data pointer -> bytes of every live CPU tensor storage not in ``exclude``."""
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude and storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
    return out


def test_the_batch_cache_stays_within_its_kv_budget(tiny_model: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    rng = random.Random(4)
    requests = [GenerationRequest(tuple(rng.randrange(4, 256) for _ in range(rng.randrange(10, 60))),
                                  max_new_tokens=rng.randrange(4, 40)) for _ in range(16)]
    before = set(storages(set()))
    peak, samples = [0], [0]

    def sample(*_: Any) -> None:
        samples[0] += 1
        peak[0] = max(peak[0], sum(storages(before).values()))

    hook = model.model.layers[0].register_forward_pre_hook(sample)
    eng = Engine(model, CharTokenizer(), kv_cache_bytes=BUDGET, max_batch_size=16)
    try:
        results = [h.result(timeout=300) for h in [eng.submit(r) for r in requests]]
    finally:
        eng.close(timeout=30)
        hook.remove()
    assert all(r.error is None for r in results)
    assert samples[0] >= max(r.max_new_tokens for r in requests)  # every step of the longest request
    assert BUDGET // 2 < peak[0] <= BUDGET, f"peak {peak[0]} bytes against a KV budget of {BUDGET}"


def _plan(device_map: dict[str, Any], devices: list[tuple[Any, str, int, int | None]], prefix: int = 0) -> Any:
    from deploykit.placement.plan import DevicePlan, Plan

    return Plan(name="m", architecture="LlamaForCausalLM", dtype="float16", balance="memory", device_map=device_map,
                devices=tuple(DevicePlan(d, tier, held, held, budget, ("x",)) for d, tier, held, budget in devices),
                bottleneck_factor=None, total_bytes=sum(h for _, _, h, _ in devices), prefix_cache_bytes=prefix)


MiB = 1 << 20
LAYERS4 = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.layers.2": 1,
           "model.layers.3": 1, "model.norm": 1, "lm_head": 1}


@pytest.mark.parametrize(("device_map", "devices", "prefix", "shares", "budget", "tiers"), [
    # one GPU: all of it there, what the GPU has left
    ({**{k: 0 for k in LAYERS4}}, [(0, "gpu", 600 * MiB, 1000 * MiB)], 0, {0: 1.0}, 400 * MiB, {}),
    # two GPUs, 1 layer and 3: GPU 1 holds 3/4 of the KV and has 300 MiB left: 400 MiB in all, not GPU 0's 900
    (LAYERS4, [(0, "gpu", 100 * MiB, 1000 * MiB), (1, "gpu", 700 * MiB, 1000 * MiB)], 0,
     {0: 0.25, 1: 0.75}, 400 * MiB, {}),
    # the prefix cache too: 3/4 of its 40 MiB on GPU 1
    (LAYERS4, [(0, "gpu", 100 * MiB, 1000 * MiB), (1, "gpu", 700 * MiB, 1000 * MiB)], 40 * MiB,
     {0: 0.25, 1: 0.75}, 360 * MiB, {"gpu0": 10 * MiB, "gpu1": 30 * MiB}),
    # layers offloaded to the CPU run on GPU 0: their KV is there
    ({**LAYERS4, "model.layers.1": "cpu", "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": 0,
      "lm_head": 0}, [(0, "gpu", 200 * MiB, 1000 * MiB), ("cpu", "cpu", 600 * MiB, 4000 * MiB)], 0,
     {0: 1.0}, 800 * MiB, {}),
    # no GPU: CPU and disk tiers both run on the CPU
    ({**{k: "cpu" for k in LAYERS4}, "model.layers.3": "disk"},
     [("cpu", "cpu", 300 * MiB, 500 * MiB), ("disk", "disk", 100 * MiB, None)], 8 * MiB,
     {"cpu": 1.0}, 192 * MiB, {"cpu": 8 * MiB}),
])
def test_the_kv_cache_is_charged_to_the_devices_that_hold_it(device_map: dict[str, Any], devices: list[Any],
                                                              prefix: int, shares: dict[Any, float], budget: int,
                                                              tiers: dict[str, int]) -> None:
    from deploykit.control.budget.tiers import plan_tiers
    from deploykit.control.live.pool import kv_cache_budget
    from deploykit.placement.kv import kv_shares

    plan = _plan(device_map, devices, prefix)
    assert kv_shares(plan) == shares
    assert kv_cache_budget(plan) == budget  # what the generation's engine is given
    held = {("cpu" if d == "cpu" else f"gpu{d}"): h for d, tier, h, _ in devices if tier != "disk"}
    assert plan_tiers(plan) == {t: held.get(t, 0) + tiers.get(t, 0) for t in held.keys() | tiers.keys()}
