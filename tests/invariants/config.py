"""How much the model-based test runs, and what it leaves out.

``make test`` runs a few fixed examples (``derandomize``: the same sequences every run); ``make soak SEEDS=N``
sets ``DEPLOYKIT_SOAK_EXAMPLES=N`` and runs N random sequences (``DEPLOYKIT_SOAK_SEED`` fixes the seed of a
run, to replay one that failed). ``KNOWN_OPEN`` names operations whose defect is open (each described in the
notes the generator's failures are kept in, docs/testing.md): they are not drawn until the entry is removed.
``DEPLOYKIT_SOAK_OPEN=1`` draws them anyway (to see a defect fail, or check its fix)."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, Verbosity, settings

# Each entry: an operation (or a combination) the generator would fail on today, and why (docs/testing.md).
KNOWN_OPEN: dict[str, str] = {
    # none open: K1-K4 (docs/testing.md) are fixed, and their sequences replay in tests/test_invariants.py
}


def open_ops() -> frozenset[str]:
    """The operations left out of this run."""
    return frozenset() if os.environ.get("DEPLOYKIT_SOAK_OPEN") == "1" else frozenset(KNOWN_OPEN)


@dataclass(frozen=True)
class Run:
    examples: int
    steps: int
    seed: int | None  # None: derandomized (fixed by the test's name)

    @property
    def soak(self) -> bool:
        return self.seed is not None

    def settings(self) -> settings:
        return settings(max_examples=self.examples, stateful_step_count=self.steps, deadline=None,
                        derandomize=not self.soak, database=None, print_blob=True, report_multiple_bugs=False,
                        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                        suppress_health_check=list(HealthCheck),
                        verbosity=Verbosity.verbose if os.environ.get("DEPLOYKIT_SOAK_VERBOSE") else Verbosity.normal)


def run(*, examples: int, steps: int) -> Run:
    """The bounded run (``examples``, ``steps``) or the soak the environment asks for."""
    soak = os.environ.get("DEPLOYKIT_SOAK_EXAMPLES")
    if not soak:
        return Run(examples, steps, None)
    seed = os.environ.get("DEPLOYKIT_SOAK_SEED")
    return Run(int(soak), int(os.environ.get("DEPLOYKIT_SOAK_STEPS", 2 * steps)),
               int(seed) if seed else random.randrange(2**32))
