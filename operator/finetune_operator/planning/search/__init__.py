"""The plan search, one module per stage in the order it works (planner.py says which):
what the job asks, enumerate, estimate, filter what fits, choose, then explain or diagnose."""

from .choose import COST_TIE, choose_cheapest_or_startable, cost_window_of
from .estimate import EstimateFacts, Estimator, estimate_facts
from .planner import exhaustive_plan, plan_job

__all__ = [
    "COST_TIE",
    "EstimateFacts",
    "Estimator",
    "choose_cheapest_or_startable",
    "cost_window_of",
    "estimate_facts",
    "exhaustive_plan",
    "plan_job",
]
