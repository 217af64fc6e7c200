"""A rollout's gates as plain decisions: given the limits of ``spec.rollout.gates`` and what was measured,
which gates pass and which fail, with the value and the limit as a reader should see them
(``gate max_nll_increase: +0.84 nats > 0.10``). Pure; tested as tables in tests/test_canary_parts.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .traffic import TrafficWindow

if TYPE_CHECKING:
    from ...engine.scoring import GoldenComparison
    from ...spec.schema import Gates


@dataclass(frozen=True)
class GateResult:
    """One gate checked: its name, the measured value (None: nothing to measure, e.g. no requests in the
    step), its limit, and whether it passed. ``interval``: the 95% confidence interval of the value (the
    golden NLL increase, whose upper bound decides), ``per_case``: the paired per-case differences it comes
    from, ``detail``: what a relative gate compared."""

    gate: str
    value: float | None
    limit: float
    passed: bool
    interval: tuple[float, float] | None = None
    per_case: tuple[float, ...] = ()
    detail: str | None = None

    def describe(self) -> str:
        if self.value is None and not self.passed and self.detail:  # a relative gate with no baseline
            return f"gate {self.gate}: {self.detail} (limit {self.limit:g})"
        return _describe(self) + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"gate": self.gate, "value": self.value, "limit": self.limit,
                                  "passed": self.passed}
        if self.interval is not None:
            out["interval"] = [_finite(v) for v in self.interval]
            out["per_case"] = [round(d, 6) for d in self.per_case]
        if self.detail:
            out["detail"] = self.detail
        return out


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity: an unbounded end is null


def _describe(result: GateResult) -> str:
    gate, value, limit, passed = result.gate, result.value, result.limit, result.passed
    if value is None:
        return f"gate {gate}: nothing measured (limit {limit:g})"
    if gate == "max_nll_increase" and result.interval is not None:
        low, high = result.interval
        return (f"gate {gate}: {value:+.2f} nats per token, 95% CI [{low:+.2f}, {high:+.2f}] over "
                f"{len(result.per_case)} cases: upper bound {'<=' if passed else '>'} {limit:.2f}")
    if gate == "max_nll_increase":
        return f"gate {gate}: {value:+.2f} nats {'<=' if passed else '>'} {limit:.2f}"
    if gate == "min_requests":
        return f"gate min_requests: {value:.0f} {'>=' if passed else '<'} {limit:g} requests"
    if gate == "max_ttft_p95":
        return f"gate {gate}: {value:.3f}s {'<=' if passed else '>'} {limit:g}s"
    if gate == "max_ttft_p95_ratio":
        return f"gate {gate}: {value:.2f}x {'<=' if passed else '>'} {limit:g}x"
    if gate == "max_error_rate_increase":
        return f"gate {gate}: {value:+.3f} {'<=' if passed else '>'} {limit:g}"
    op = (">=" if passed else "<") if gate.startswith("min_") else ("<=" if passed else ">")
    return f"gate {gate}: {value:.3f} {op} {limit:g}"


def _at_most(gate: str, value: float | None, limit: float | None, detail: str | None = None) -> list[GateResult]:
    if limit is None:
        return []
    return [GateResult(gate, value, limit, value is None or value <= limit, detail=detail)]


def golden_gates(gates: Gates, comparison: GoldenComparison) -> list[GateResult]:
    """The golden gates the manifest sets, on the two generations' scores. max_nll_increase decides on the
    upper bound of its confidence interval: it passes only when the evidence shows the increase is within
    the limit, not when the mean happens to be."""
    results = []
    if gates.max_nll_increase is not None:
        high = comparison.interval[1]
        results.append(GateResult("max_nll_increase", comparison.nll_increase, gates.max_nll_increase,
                                  high <= gates.max_nll_increase, comparison.interval, comparison.differences))
    if gates.min_top1_agreement is not None:
        value = comparison.top1_agreement
        results.append(GateResult("min_top1_agreement", value, gates.min_top1_agreement,
                                  value >= gates.min_top1_agreement))
    return results


NO_BASELINE = "no baseline"  # how a relative gate's detail begins when it had nothing to compare with


def traffic_gates(gates: Gates, window: TrafficWindow, serving: TrafficWindow | None = None, *,
                  min_baseline: int = 1) -> list[GateResult]:
    """The traffic gates the manifest sets, on one step's requests of the new generation, and the relative
    ones against ``serving``, the serving generation's requests over the same window (the canary checks
    them once the step has its ``min_requests``). An absolute gate with nothing to measure (no first token)
    passes; a relative gate with nothing to compare with (fewer than ``min_baseline`` requests of the serving
    generation in the window, or none with a first token for the ratio) fails, saying "no baseline": a
    relative limit never passes on no evidence."""
    rate = window.error_rate if window.requests else None
    ttft = window.ttft_p95
    results = (_at_most("max_error_rate", rate, gates.max_error_rate)
               + _at_most("max_ttft_p95", ttft, gates.max_ttft_p95))
    count = serving.requests if serving is not None else 0
    needed = max(1, min_baseline)
    base = serving if serving is not None and count >= needed else None
    too_few = (f"{NO_BASELINE}: the serving generation finished {count} request{'' if count == 1 else 's'} in "
               f"the window to compare with, fewer than the {needed} needed")
    if gates.max_error_rate_increase is not None:
        limit = gates.max_error_rate_increase
        if base is None:
            results.append(_no_baseline("max_error_rate_increase", limit, too_few))
        elif rate is not None:
            value = rate - base.error_rate
            detail = f"new {rate:.3f} of {window.requests} requests, serving {base.error_rate:.3f} of {base.requests}"
            results += _at_most("max_error_rate_increase", value, limit, detail)
        else:
            results += _at_most("max_error_rate_increase", None, limit)
    if gates.max_ttft_p95_ratio is not None:
        limit = gates.max_ttft_p95_ratio
        base_ttft = base.ttft_p95 if base is not None else None
        if ttft is None:  # the new generation's requests have no first token: nothing to measure
            results += _at_most("max_ttft_p95_ratio", None, limit)
        elif base is None:
            results.append(_no_baseline("max_ttft_p95_ratio", limit, too_few))
        elif not base_ttft:
            results.append(_no_baseline("max_ttft_p95_ratio", limit, f"{NO_BASELINE}: none of the serving "
                                        f"generation's {count} requests in the window had a first token"))
        else:
            results += _at_most("max_ttft_p95_ratio", ttft / base_ttft, limit,
                                f"new {ttft:.3f}s, serving {base_ttft:.3f}s")
    return results


def _no_baseline(gate: str, limit: float, detail: str) -> GateResult:
    return GateResult(gate, None, limit, False, detail=detail)


def first_failure(results: list[GateResult]) -> GateResult | None:
    return next((r for r in results if not r.passed), None)
