"""The choice rule: cheapest first, or a plan that can start now within the policy's cost margin.

One rule for the planner's candidates and for recovery's choice between finished plans.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from .policy import ClusterPolicy

# Costs within this fraction of the cheapest count as equal: the cost model is not more precise.
COST_TIE = 0.01
T = TypeVar("T")


def choose_cheapest_or_startable(items: Sequence[T], *, cost: Callable[[T], float], startable: Callable[[T], bool],
                                 tie_break: Callable[[T], Any], window: float) -> T:
    """The planner's choice rule, for its own candidates and for recovery's finished plans:
    the best `tie_break` among items within COST_TIE of the cheapest; when that one must wait
    for its pool and the policy prefers starting now (`window` wider than COST_TIE, see
    `cost_window_of`), the cheapest within `window` that can start now."""
    lowest = min(cost(i) for i in items)
    best = min((i for i in items if cost(i) <= lowest * (1 + COST_TIE)), key=tie_break)
    if not startable(best) and window > COST_TIE:
        now = [i for i in items if startable(i) and cost(i) <= lowest * (1 + window)]
        if now:
            return min(now, key=lambda i: (cost(i), tie_break(i)))
    return best


def cost_window_of(policy: ClusterPolicy) -> float:
    """Costs within this fraction of the cheapest are weighed against starting now."""
    return max(COST_TIE, policy.start_time_cost_margin) if policy.placement_preference == "startTime" else COST_TIE


