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
                                 tie_break: Callable[[T], Any], window: float,
                                 wait: Callable[[T], float] | None = None) -> T:
    """The planner's choice rule, for its own candidates and for recovery's finished plans:
    the best `tie_break` among items within COST_TIE of the cheapest; when that one must wait
    for its pool and the policy prefers starting now (`window` wider than COST_TIE, see
    `cost_window_of`), the cheapest within `window` that can start now; when none can, and
    `wait` says how long each would wait (capacity.py's queue share), the one within `window`
    that waits least, if it waits less than the cheapest: a burst of jobs then fills every
    allowed pool instead of queueing on the cheapest while the others idle."""
    lowest = min(cost(i) for i in items)
    best = min((i for i in items if cost(i) <= lowest * (1 + COST_TIE)), key=tie_break)
    if not startable(best) and window > COST_TIE:
        within = [i for i in items if cost(i) <= lowest * (1 + window)]
        now = [i for i in within if startable(i)]
        if now:
            return min(now, key=lambda i: (cost(i), tie_break(i)))
        if wait is not None:
            sooner = min(within, key=lambda i: (wait(i), cost(i), tie_break(i)))
            if wait(sooner) < wait(best):
                return sooner
    return best


def cost_window_of(policy: ClusterPolicy) -> float:
    """Costs within this fraction of the cheapest are weighed against starting now."""
    return max(COST_TIE, policy.start_time_cost_margin) if policy.placement_preference == "startTime" else COST_TIE


