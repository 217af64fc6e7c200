"""The host as a budget: sizes per tier (``tiers``), the pure scheduler (what to unload for room, what
expired), the ``Host`` that reserves room and unloads, and ``packing`` for ``plan DIR --budget``. Knows
deployments only through what it may ask of them (``host.Held``), never ``Deployment``."""

from .tiers import (
    Budget,
    BudgetError,
    host_budget,
    parse_budget,
    plan_tiers,
    serve_budget,
)

__all__ = ["Budget", "BudgetError", "host_budget", "parse_budget", "plan_tiers", "serve_budget"]
