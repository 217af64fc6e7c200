"""The pure parts of a gated rollout, as tables: the manifest's rollout fields (each error located), golden
files, the split of new requests, the gate decisions and the comparison of two generations' scores."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploykit.control.live.gates import (
    NO_BASELINE,
    GateResult,
    first_failure,
    golden_gates,
    traffic_gates,
)
from deploykit.control.live.rollout import choose_strategy
from deploykit.control.live.traffic import Split, TrafficLog, TrafficWindow, p95
from deploykit.engine.scoring import CaseScore, compare
from deploykit.errors import ManifestError
from deploykit.spec.golden import GoldenError, parse_golden
from deploykit.spec.manifest import check_on_host, parse_manifests
from deploykit.spec.schema import Gates

HEAD = """\
apiVersion: deploykit/v1
kind: ModelDeployment
metadata: {name: chat}
spec:
  model: {path: ./model}
  rollout:
"""


def _issues(rollout: str, tmp_path: Path, extra: str = "") -> list[tuple[int, str, str]]:
    text = HEAD + rollout + extra
    try:
        loaded = parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    except ManifestError as exc:
        return [(i.line or 0, i.field or "", i.message) for i in exc.issues]
    return [(i.line or 0, i.field or "", i.message) for i in check_on_host(loaded[0])
            if i.field != "spec.model.path"]


GOLDEN_GATES = "    gates: {golden: g.jsonl, max_nll_increase: 0.1}\n"


@pytest.mark.parametrize(("rollout", "line", "field", "says"), [
    ("    strategy: canary\n    canary: {steps: [10, 5, 100]}\n", 8, "spec.rollout.canary.steps", "increase"),
    ("    strategy: canary\n    canary: {steps: [10, 50]}\n", 8, "spec.rollout.canary.steps", "must be 100"),
    ("    strategy: canary\n    canary: {steps: [0, 100]}\n", 8, "spec.rollout.canary.steps.0", "greater than"),
    ("    strategy: canary\n    canary: {step_seconds: soon}\n", 8, "spec.rollout.canary.step_seconds", "duration"),
    ("    strategy: blue-green\n    canary: {steps: [100]}\n", 8, "spec.rollout.canary", "need strategy canary"),
    ("    strategy: recreate\n" + GOLDEN_GATES, 8, "spec.rollout.gates", "set strategy to canary"),
    ("    strategy: auto\n" + GOLDEN_GATES, 8, "spec.rollout.gates", "set strategy to canary"),
    ("    strategy: blue-green\n    gates: {max_ttft_p95: 2s}\n", 8, "spec.rollout.gates.max_ttft_p95",
     "blue-green moves every request"),
    ("    strategy: canary\n    gates: {max_nll_increase: 0.1}\n", 8, "spec.rollout.gates.max_nll_increase",
     "add golden"),
    ("    strategy: canary\n    gates: {golden: g.jsonl}\n", 8, "spec.rollout.gates.golden", "set one of them"),
    ("    strategy: canary\n    gates: {min_top1_agreement: 1.5, golden: g.jsonl}\n", 8,
     "spec.rollout.gates.min_top1_agreement", "less than or equal to 1"),
    ("    strategy: canary\n    gates: {max_ttft_p95: fast}\n", 8, "spec.rollout.gates.max_ttft_p95", "duration"),
    ("    strategy: canary\n    gates: {min_golden_tokens: 100}\n", 8, "spec.rollout.gates.min_golden_tokens",
     "add golden"),
    ("    strategy: blue-green\n    gates: {max_ttft_p95_ratio: 1.5}\n", 8, "spec.rollout.gates.max_ttft_p95_ratio",
     "blue-green moves every request"),
    ("    strategy: canary\n    gates: {max_error_rate_increase: 2}\n", 8,
     "spec.rollout.gates.max_error_rate_increase", "less than or equal to 1"),
])
def test_rollout_fields_are_checked_and_located(rollout: str, line: int, field: str, says: str,
                                                tmp_path: Path) -> None:
    (tmp_path / "g.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    issues = _issues(rollout, tmp_path)
    assert [(i[0], i[1]) for i in issues] == [(line, field)], issues
    assert says in issues[0][2]


@pytest.mark.parametrize(("model", "extra", "field", "says"), [
    ("{path: ./model}", "  cluster: {address: local}\n", "spec.rollout.strategy", "Ray cluster"),
    ("{path: ./model, task: feature-extraction}", "", "spec.rollout.gates.golden", "feature-extraction"),
    ("{path: ./m.gguf}", "  engine: {name: llama.cpp}\n", "spec.rollout.strategy", "llama.cpp engine"),
])
def test_engines_that_cannot_score_or_split_refuse_at_the_field(model: str, extra: str, field: str, says: str,
                                                               tmp_path: Path) -> None:
    (tmp_path / "g.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    text = HEAD.replace("{path: ./model}", model) + "    strategy: canary\n" + GOLDEN_GATES + extra
    with pytest.raises(ManifestError) as caught:
        parse_manifests(text.encode(), source="m.yaml", base_dir=tmp_path)
    assert [(i.field, says in i.message) for i in caught.value.issues] == [(field, True)], caught.value.issues


@pytest.mark.parametrize(("content", "says"), [
    (None, "does not exist"),
    ("", "no cases"),
    ("\n\n", "no cases"),
    ('{"prompt": "a", "completion": "b"}\nnot json\n', "line 2: not JSON"),
    ('["a"]\n', "line 1: a case must be a JSON object"),
    ('{"prompt": "a"}\n', "line 1: completion must be a non-empty string"),
    ('{"prompt": "a", "messages": [], "completion": "b"}\n', "exactly one of prompt and messages"),
    ('{"messages": [{"role": "user"}], "completion": "b"}\n', "messages must be"),
    ('{"prompt": "a", "completion": "b", "answer": "c"}\n', "unknown key 'answer'"),
])
def test_a_bad_golden_file_is_a_located_error_at_validate_time(content: str | None, says: str,
                                                              tmp_path: Path) -> None:
    if content is not None:
        (tmp_path / "g.jsonl").write_text(content)
    issues = _issues("    strategy: canary\n" + GOLDEN_GATES, tmp_path)
    assert [(i[0], i[1]) for i in issues] == [(8, "spec.rollout.gates.golden")]
    assert says in issues[0][2], issues


def test_golden_cases_parse() -> None:
    cases = parse_golden('{"prompt": "a", "completion": "b"}\n\n'
                         '{"messages": [{"role": "user", "content": "hi"}], "completion": "hello"}\n')
    assert [(c.prompt, c.messages, c.completion) for c in cases] == [
        ("a", None, "b"), (None, ({"role": "user", "content": "hi"},), "hello")]
    with pytest.raises(GoldenError) as caught:
        parse_golden('{"prompt": 3, "completion": "b"}')
    assert caught.value.line == 1


@pytest.mark.parametrize(("requested", "fits", "chosen"), [
    ("canary", True, "canary"), ("canary", False, None),  # a canary never falls back to recreate
    ("blue-green", False, None), ("auto", False, "recreate"),
])
def test_a_canary_needs_room_beside(requested: str, fits: bool, chosen: str | None) -> None:
    assert choose_strategy(requested, fits_beside=fits) == chosen


@pytest.mark.parametrize("percent", [0, 1, 10, 33, 50, 90, 100])
def test_the_split_gives_each_step_its_share_to_within_one_request(percent: int) -> None:
    split = Split(percent)
    picks = [split.next_is_new() for _ in range(1000)]
    for n in (10, 37, 100, 1000):
        assert abs(sum(picks[:n]) - n * percent / 100) <= 1, (n, sum(picks[:n]))


@pytest.mark.parametrize(("values", "expected"), [
    ((), None), ((1.0,), 1.0), (tuple(float(i) for i in range(1, 21)), 19.0),
    (tuple(float(i) for i in range(1, 101)), 95.0), ((5.0, 1.0, 3.0), 5.0),
])
def test_p95_by_nearest_rank(values: tuple[float, ...], expected: float | None) -> None:
    assert p95(values) == expected


def test_a_tally_counts_only_the_requests_recorded_while_it_is_open() -> None:
    log = TrafficLog()
    log.record(ttft=0.1, failed=False)
    tally = log.tally()
    log.record(ttft=None, failed=True)
    log.record(ttft=0.3, failed=False)
    tally.close()
    log.record(ttft=0.5, failed=True)
    window = tally.window()
    assert (window.requests, window.failures, window.ttft_p95) == (2, 1, 0.3)
    assert log.total == 4


def test_a_tally_keeps_the_exact_nearest_rank_p95_as_requests_end() -> None:
    import random

    rng = random.Random(7)
    log = TrafficLog()
    tally = log.tally()
    seen: list[float] = []
    for _ in range(500):
        value = rng.choice((None, round(rng.expovariate(3.0), 4)))
        log.record(ttft=value, failed=False)
        if value is not None:
            seen.append(value)
        assert tally.window().ttft_p95 == p95(tuple(seen))


def _recorded_and_read(log: TrafficLog, tally, times: int) -> float:  # type: ignore[no-untyped-def]
    import time

    started = time.perf_counter()
    for i in range(times):
        log.record(ttft=0.001 * (i % 97), failed=i % 50 == 0)
        tally.window()
    return time.perf_counter() - started


def test_recording_and_reading_a_step_does_not_grow_with_the_requests_before() -> None:
    """A record (on the event loop) and a canary's read of its step are O(log n) of the step, never a scan
    of the log under its lock: with 100k requests recorded before, 2000 of each cost about what they cost
    with none (a scan of the log would make them hundreds of times slower)."""
    log = TrafficLog()
    tally = log.tally()
    fresh = min(_recorded_and_read(log, tally, 2000) for _ in range(3))
    for i in range(100_000):
        log.record(ttft=0.001 * (i % 89), failed=False)
    step = log.tally()  # a step begun after them
    tally.close()
    loaded = min(_recorded_and_read(log, step, 2000) for _ in range(3))
    assert loaded < 20 * fresh + 0.05, (loaded, fresh)
    assert step.window().requests == 6000 and log.total == 112_000


@pytest.mark.parametrize(("gates", "window", "failed"), [
    (Gates(max_error_rate=0.02), TrafficWindow(100, 2, ()), None),
    (Gates(max_error_rate=0.02), TrafficWindow(100, 3, ()), "gate max_error_rate: 0.030 > 0.02"),
    (Gates(max_error_rate=0.0), TrafficWindow(0, 0, ()), None),  # no requests: nothing against it
    (Gates(max_ttft_p95=0.5), TrafficWindow(3, 0, (0.1, 0.2, 0.4)), None),
    (Gates(max_ttft_p95=0.5), TrafficWindow(3, 0, (0.1, 0.2, 0.9)), "gate max_ttft_p95: 0.900s > 0.5s"),
    (Gates(max_error_rate=0.5, max_ttft_p95=1.0), TrafficWindow(2, 0, (2.0, 0.1)), "gate max_ttft_p95: 2.000s > 1s"),
    (Gates(), TrafficWindow(2, 2, (9.0,)), None),  # no traffic gate set: nothing checked
])
def test_traffic_gates(gates: Gates, window: TrafficWindow, failed: str | None) -> None:
    result = first_failure(traffic_gates(gates, window))
    assert (result.describe() if result else None) == failed


def _case(ref: tuple[int, ...], nll: tuple[float, ...], top1: tuple[int, ...]) -> CaseScore:
    return CaseScore(ref, nll, top1)


SERVING = [_case((1, 2), (1.0, 1.0), (1, 2)), _case((3,), (2.0,), (3,)), _case((4, 5), (1.0, 3.0), (4, 5))]


@pytest.mark.parametrize(("new", "failed"), [
    (SERVING, None),
    ([_case((1, 2), (1.5, 1.5), (1, 2)), _case((3,), (2.5,), (3,)), _case((4, 5), (1.5, 3.5), (4, 5))],
     "gate max_nll_increase: +0.50 nats per token, 95% CI [+0.50, +0.50] over 3 cases: upper bound > 0.10"),
    # the mean is within the limit, but three cases cannot show that it is: the upper bound decides
    ([_case((1, 2), (1.0, 1.0), (1, 2)), _case((3,), (2.0,), (3,)), _case((4, 5), (1.1, 3.1), (4, 5))],
     "gate max_nll_increase: +0.03 nats per token, 95% CI [-0.11, +0.18] over 3 cases: upper bound > 0.10"),
    ([_case((1, 2), (1.0, 1.0), (1, 9)), _case((3,), (2.0,), (9,)), _case((4, 5), (1.0, 3.0), (4, 5))],
     "gate min_top1_agreement: 0.600 < 0.9"),
    ([_case((1, 2, 3), (1.0, 1.0, 1.0), (1, 2, 3)), _case((3,), (2.0,), (3,)),  # another tokenizer
      _case((4, 5), (1.0, 3.0), (4, 5))], "gate min_top1_agreement: 0.500 < 0.9"),
])
def test_golden_gates(new: list[CaseScore], failed: str | None) -> None:
    comparison = compare(SERVING, new)
    assert comparison.cases == 3
    result = first_failure(golden_gates(Gates(golden=Path("g"), max_nll_increase=0.1, min_top1_agreement=0.9),
                                        comparison))
    assert (result.describe() if result else None) == failed


def test_the_nll_increase_is_the_mean_of_per_case_differences_not_pooled_over_tokens() -> None:
    """One long case does not outweigh the others: each case counts once, with its mean NLL per token."""
    serving = [_case(tuple(range(100)), (1.0,) * 100, tuple(range(100))), _case((1,), (1.0,), (1,)),
               _case((2,), (1.0,), (2,))]
    new = [_case(tuple(range(100)), (1.0,) * 100, tuple(range(100))), _case((1,), (2.0,), (1,)),
           _case((2,), (2.0,), (2,))]
    comparison = compare(serving, new)
    assert comparison.differences == (0.0, 1.0, 1.0)
    assert comparison.nll_increase == pytest.approx(2 / 3)  # pooled over tokens it would be 2/102
    low, high = comparison.interval
    assert low < 2 / 3 < high  # t(0.975, 2) = 4.303: 2/3 +- 4.303 * 0.577 / sqrt(3)
    assert high == pytest.approx(2 / 3 + 4.302653 * (1 / 3) ** 0.5 / 3 ** 0.5, rel=1e-5)
    result = golden_gates(Gates(golden=Path("g"), max_nll_increase=0.1), comparison)[0]
    assert result.to_dict()["per_case"] == [0.0, 1.0, 1.0] and result.to_dict()["interval"] == [low, high]


def test_one_case_gives_no_interval_and_never_passes() -> None:
    comparison = compare([_case((1,), (1.0,), (1,))], [_case((1,), (1.0,), (1,))])
    result = golden_gates(Gates(golden=Path("g"), max_nll_increase=0.1), comparison)[0]
    assert not result.passed and result.to_dict()["interval"] == [None, None]


@pytest.mark.parametrize(("gates", "new", "serving", "failed"), [
    (Gates(max_error_rate_increase=0.05), TrafficWindow(20, 2, ()), TrafficWindow(20, 1, ()), None),
    (Gates(max_error_rate_increase=0.05), TrafficWindow(20, 4, ()), TrafficWindow(20, 1, ()),
     "gate max_error_rate_increase: +0.150 > 0.05 (new 0.200 of 20 requests, serving 0.050 of 20)"),
    # nothing to compare with: the relative gates fail, saying so, rather than pass on no evidence
    (Gates(max_error_rate_increase=0.0), TrafficWindow(5, 1, ()), TrafficWindow(0, 0, ()),
     "gate max_error_rate_increase: no baseline: the serving generation finished 0 requests in the window to "
     "compare with, fewer than the 1 needed (limit 0)"),
    (Gates(max_ttft_p95_ratio=1.5), TrafficWindow(5, 0, (0.2,)), TrafficWindow(0, 0, ()),
     "gate max_ttft_p95_ratio: no baseline: the serving generation finished 0 requests in the window to "
     "compare with, fewer than the 1 needed (limit 1.5)"),
    (Gates(max_ttft_p95_ratio=1.5), TrafficWindow(5, 0, (0.2,)), TrafficWindow(4, 0, ()),  # no first token
     "gate max_ttft_p95_ratio: no baseline: none of the serving generation's 4 requests in the window had a "
     "first token (limit 1.5)"),
    (Gates(max_ttft_p95_ratio=1.5), TrafficWindow(5, 0, ()), TrafficWindow(4, 0, (0.2,)), None),  # nothing new
    (Gates(max_ttft_p95_ratio=1.5), TrafficWindow(2, 0, (0.2, 0.3)), TrafficWindow(2, 0, (0.2, 0.25)), None),
    (Gates(max_ttft_p95_ratio=1.5), TrafficWindow(2, 0, (0.2, 0.8)), TrafficWindow(2, 0, (0.2, 0.25)),
     "gate max_ttft_p95_ratio: 3.20x > 1.5x (new 0.800s, serving 0.250s)"),
])
def test_relative_traffic_gates_compare_with_the_serving_generation(gates: Gates, new: TrafficWindow,
                                                                    serving: TrafficWindow,
                                                                    failed: str | None) -> None:
    result = first_failure(traffic_gates(gates, new, serving))
    assert (result.describe() if result else None) == failed


def test_relative_gates_without_a_serving_window_fail_with_no_baseline() -> None:
    """``steps: [100]`` (the serving generation takes no request): the decision is recorded with the gate."""
    gates = Gates(max_error_rate=0.5, max_error_rate_increase=0.1, max_ttft_p95_ratio=2.0)
    results = traffic_gates(gates, TrafficWindow(10, 0, (0.1,)), None)
    assert [(r.gate, r.passed) for r in results] == [("max_error_rate", True), ("max_error_rate_increase", False),
                                                      ("max_ttft_p95_ratio", False)]
    assert results[1].to_dict() == {"gate": "max_error_rate_increase", "value": None, "limit": 0.1, "passed": False,
                                    "detail": "no baseline: the serving generation finished 0 requests in the "
                                              "window to compare with, fewer than the 1 needed"}
    failed = first_failure(results)
    assert failed is not None and failed.describe().startswith("gate max_error_rate_increase: no baseline")
    # a few stragglers (requests that started before the step) are no baseline for a step that needs 10
    few = traffic_gates(gates, TrafficWindow(10, 0, (0.1,)), TrafficWindow(2, 0, (0.1,)), min_baseline=10)
    assert [r.passed for r in few] == [True, False, False] and NO_BASELINE in (few[1].detail or "")
    enough = traffic_gates(gates, TrafficWindow(10, 0, (0.1,)), TrafficWindow(10, 0, (0.1,)), min_baseline=10)
    assert [r.passed for r in enough] == [True, True, True]


def test_the_issue_example_reads_as_documented() -> None:
    assert GateResult("max_nll_increase", 0.84, 0.10, False).describe() == "gate max_nll_increase: +0.84 nats > 0.10"


def test_deploykit_golden_says_what_it_records() -> None:
    """Its references are the serving model's own greedy answers: a regression check, not a quality measure."""
    from click.testing import CliRunner

    from deploykit.cli import main

    shown = CliRunner().invoke(main, ["golden", "--help"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "own greedy answers" in text and "regression check" in text and "not that the answers are" in text
    assert "min_golden_tokens" in text
