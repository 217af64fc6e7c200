"""A rollout's gates as plain decisions: given the limits of ``spec.rollout.gates`` and what was measured,
which gates pass and which fail, with the value and the limit as a reader should see them
(``gate max_nll_increase: +0.84 nats > 0.10``). Pure; tested as tables in tests/test_canary_parts.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .traffic import TrafficWindow, p95

if TYPE_CHECKING:
    from ...engine.scoring import GoldenComparison
    from ...spec.schema import Gates


@dataclass(frozen=True)
class GateResult:
    """One gate checked: its name, the measured value (None: nothing to measure, e.g. no requests in the
    step), its limit, and whether it passed."""

    gate: str
    value: float | None
    limit: float
    passed: bool

    def describe(self) -> str:
        if self.value is None:
            return f"gate {self.gate}: nothing measured (limit {self.limit:g})"
        if self.gate == "max_nll_increase":
            return f"gate {self.gate}: {self.value:+.2f} nats {'<=' if self.passed else '>'} {self.limit:.2f}"
        if self.gate == "min_requests":
            return f"gate min_requests: {self.value:.0f} {'>=' if self.passed else '<'} {self.limit:g} requests"
        if self.gate == "max_ttft_p95":
            return f"gate {self.gate}: {self.value:.3f}s {'<=' if self.passed else '>'} {self.limit:g}s"
        op = (">=" if self.passed else "<") if self.gate.startswith("min_") else ("<=" if self.passed else ">")
        return f"gate {self.gate}: {self.value:.3f} {op} {self.limit:g}"

    def to_dict(self) -> dict[str, object]:
        return {"gate": self.gate, "value": self.value, "limit": self.limit, "passed": self.passed}


def _at_most(gate: str, value: float | None, limit: float | None) -> list[GateResult]:
    if limit is None:
        return []
    return [GateResult(gate, value, limit, value is None or value <= limit)]


def golden_gates(gates: Gates, comparison: GoldenComparison) -> list[GateResult]:
    """The golden gates the manifest sets, on the two generations' scores."""
    results = _at_most("max_nll_increase", comparison.nll_increase, gates.max_nll_increase)
    if gates.min_top1_agreement is not None:
        value = comparison.top1_agreement
        results.append(GateResult("min_top1_agreement", value, gates.min_top1_agreement,
                                  value >= gates.min_top1_agreement))
    return results


def traffic_gates(gates: Gates, window: TrafficWindow) -> list[GateResult]:
    """The traffic gates the manifest sets, on one step's requests of the new generation (the canary checks
    them once the step has its ``min_requests``; a gate with nothing to measure, e.g. no first token, passes)."""
    rate = window.error_rate if window.requests else None
    return (_at_most("max_error_rate", rate, gates.max_error_rate)
            + _at_most("max_ttft_p95", p95(window.ttfts), gates.max_ttft_p95))


def first_failure(results: list[GateResult]) -> GateResult | None:
    return next((r for r in results if not r.passed), None)
