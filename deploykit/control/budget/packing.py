"""How a directory's deployments pack into a budget (``deploykit plan DIR --budget ...``): pure.

Answers, before anything is served: which deployment can never load (its plan alone exceeds the
budget), whether all fit at once, whether the eager ones fit together at start (if not, loading the
later ones unloads earlier ones or waits), and how many can be held at once at most (the smallest ones).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .tiers import Budget


@dataclass(frozen=True)
class Item:
    name: str
    bytes: Mapping[str, int]  # per budget tier
    priority: int = 0
    eager: bool = True


@dataclass(frozen=True)
class Packing:
    never: tuple[str, ...]  # alone over the budget
    all_fit: bool  # every deployment (never-fitting ones aside) loaded at once
    eager_fit: bool  # the eager ones together
    most_at_once: tuple[str, ...]  # the largest set that fits together: the smallest deployments
    used_by_all: dict[str, int]  # per tier, every deployment that can fit at all

    def to_dict(self) -> dict[str, object]:
        return {"never": list(self.never), "all_fit": self.all_fit, "eager_fit": self.eager_fit,
                "most_at_once": list(self.most_at_once), "used_by_all": self.used_by_all}


def _sum(items: Sequence[Item]) -> dict[str, int]:
    total: dict[str, int] = {}
    for item in items:
        for tier, b in item.bytes.items():
            total[tier] = total.get(tier, 0) + b
    return total


def _fits(budget: Budget, need: Mapping[str, int]) -> bool:
    return not budget.over(need)


def pack(budget: Budget, items: Sequence[Item]) -> Packing:
    never = tuple(i.name for i in items if budget.over(i.bytes))
    able = [i for i in items if i.name not in never]
    most: list[Item] = []
    for item in sorted(able, key=lambda i: (sum(i.bytes.values()), i.name)):
        if _fits(budget, _sum([*most, item])):
            most.append(item)
    return Packing(never, _fits(budget, _sum(able)), _fits(budget, _sum([i for i in able if i.eager])),
                   tuple(i.name for i in most), _sum(able))
