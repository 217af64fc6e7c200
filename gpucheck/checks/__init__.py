"""The checks, in the order they run, each with the most seconds it may take on one H100.

Each is a module here with ``run(ctx, rec)``; the runner runs each in its own process (and process
group), so a hang or a crash ends that check only. The limits add up to more than the run's deadline
(``runner.DEADLINE_S``): a check never gets more than what is left of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str  # the module in this package
    title: str
    limit_s: int
    needs_models: bool = True  # runs on the models the set-up built


CHECKS: tuple[Check, ...] = (
    Check("setup", "Set-up: the machine, the carried packages, the random-weight models", 120, False),
    Check("pytest_cuda", "`pytest -m cuda`: the suite's CUDA tests", 120, False),
    Check("quantized_kernels", "int8 and int4 linears on CUDA: kernels against dequantizing per call and "
          "against the plan's bytes", 45, False),
    Check("serve_exact", "`deploykit serve` greedy answers equal to `generate` (float32, 16 concurrent), the "
          "model whole on `cuda:0` and split over `cuda:0` and the CPU", 170),
    Check("apply_tiers", "apply with `gpus: [0]`, a CPU tier and a disk tier, against accelerate", 150),
    Check("serve", "`deploykit serve` on the GPU: 16 clients against `transformers serve` and `generate`", 200),
    Check("budget", "the budget with a `gpu0` tier: a load on demand, an eviction, memory returned", 100),
    Check("quantized", "int8 and int4 on the GPU: answers, bytes, speed against bfloat16", 160),
    Check("machine_transformers", "deploykit on the machine's own transformers (plan, apply on the CPU)", 60, False),
    Check("llamacpp", "the llama.cpp engine on the GPU", 10, False),
)


def by_name(name: str) -> Check:
    return next(c for c in CHECKS if c.name == name)
