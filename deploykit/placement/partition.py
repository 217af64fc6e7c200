"""The exact partition core: split a sequence of blocks into contiguous runs, one per device (or per
node), minimising the largest load-to-ratio, then, among the optimal splits, sum(load^2 / ratio) (the
most even one). Small pure functions over plain lists, tested against brute force.

``longest_prefix`` is how many leading blocks some budgets can hold (greedy fill is optimal);
``min_max_partition`` splits blocks over GPUs under their budgets; ``min_max_stages`` splits blocks over
pipeline stages under what each node can hold. Both share ``_two_stage_split``, the dynamic programme.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

_INF = float("inf")


def _prefix(values: Sequence[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def longest_prefix(sizes: Sequence[int], budgets: Sequence[int], *, min_first: int = 0) -> int:
    """How many leading blocks the devices can hold as contiguous runs (greedy fill is optimal).

    Returns -1 when the first device cannot hold the first ``min_first`` blocks.
    """
    pos = 0
    for k, budget in enumerate(budgets):
        used = 0
        while pos < len(sizes) and used + sizes[pos] <= budget:
            used += sizes[pos]
            pos += 1
        if k == 0 and pos < min_first:
            return -1
    return pos


def min_max_partition(loads: Sequence[int], sizes: Sequence[int], ratios: Sequence[float],
                      budgets: Sequence[int], *, min_first: int = 0) -> tuple[list[int], float]:
    """Split all blocks into len(ratios) contiguous (possibly empty) runs.

    Minimises max(sum(loads of run k) / ratios[k]) subject to sum(sizes of run k) <= budgets[k] and
    the first run holding at least ``min_first`` blocks; among optimal splits, minimises
    sum(load_k^2 / ratio_k). Returns (the end index of each run, the optimal max). Raises ValueError
    when no split is feasible.
    """
    n = len(loads)
    lp, sp = _prefix(loads), _prefix(sizes)

    def run_ok(a: int, b: int, k: int) -> bool:
        return sp[b] - sp[a] <= budgets[k] and (k > 0 or b >= min_first)

    def value(a: int, b: int, k: int) -> float:
        return (lp[b] - lp[a]) / ratios[k]

    def pairs(k: int) -> Iterator[tuple[int, int]]:
        for b in range(n + 1):
            for a in range(b, -1, -1):
                if sp[b] - sp[a] > budgets[k]:
                    break  # longer runs only get bigger
                if run_ok(a, b, k):
                    yield a, b

    return _two_stage_split(n, lp, ratios, pairs)


def _two_stage_split(n: int, lp: Sequence[int], ratios: Sequence[float],
                     pairs: Callable[[int], Iterable[tuple[int, int]]]) -> tuple[list[int], float]:
    """The exact split both planners share: run k may be [a, b) for each (a, b) of ``pairs(k)`` (in the
    order given, which breaks ties). Stage 1 finds the smallest max(load_k / ratio_k); stage 2, among
    splits that reach it, the smallest sum(load_k^2 / ratio_k). Returns (end of each run, optimum)."""
    m = len(ratios)
    best = [[_INF] * (n + 1) for _ in range(m + 1)]  # best[k][b]: smallest max of runs 0..k-1 over [0, b)
    best[0][0] = 0.0
    for k in range(m):
        for a, b in pairs(k):
            if best[k][a] != _INF:
                best[k + 1][b] = min(best[k + 1][b], max(best[k][a], (lp[b] - lp[a]) / ratios[k]))
    optimum = best[m][n]
    if optimum == _INF:
        raise ValueError("no feasible split")
    cost = [[_INF] * (n + 1) for _ in range(m + 1)]
    back = [[0] * (n + 1) for _ in range(m + 1)]
    cost[0][0] = 0.0
    for k in range(m):
        for a, b in pairs(k):
            load = lp[b] - lp[a]
            if cost[k][a] == _INF or load / ratios[k] > optimum:
                continue
            c = cost[k][a] + load * load / ratios[k]
            if c < cost[k + 1][b]:
                cost[k + 1][b], back[k + 1][b] = c, a
    ends = [n]
    for k in range(m, 1, -1):
        ends.append(back[k][ends[-1]])
    return ends[::-1], optimum


def min_max_stages(loads: Sequence[int], ratios: Sequence[float], max_end: Sequence[Sequence[int]],
                   *, min_first: int = 0) -> tuple[list[int], float]:
    """Split all blocks into len(ratios) contiguous, non-empty runs, run k = [a, b) allowed when
    b <= max_end[k][a] (what node k can hold starting at block a; monotone in b), the first run holding
    at least ``min_first`` blocks. Minimises max(load_k / ratio_k), then sum(load_k^2 / ratio_k) among
    the optimal splits. Returns (end of each run, optimal max); ValueError when infeasible."""
    n = len(loads)
    lp = _prefix(loads)

    def ok(a: int, b: int, k: int) -> bool:
        return a < b <= max_end[k][a] and (k > 0 or b >= min_first)

    def pairs(k: int) -> Iterator[tuple[int, int]]:
        for a in range(n):
            for b in range(a + 1, min(n, max_end[k][a]) + 1):
                if ok(a, b, k):
                    yield a, b

    return _two_stage_split(n, lp, ratios, pairs)
