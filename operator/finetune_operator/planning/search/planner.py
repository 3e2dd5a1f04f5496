"""The plan search, in the order it works: the cheapest way to run a job that fits in memory,
inside the allowed regions (`plan_job`), or why there is none.

  ask.py       0. what the job asks: its fixed settings, the ranges of its `auto` ones, its regions
  space.py     1. enumerate the pools it may use and the groups of its space
  estimate.py  2. estimate each group's cost (all of them) and memory (those sized)
  fit.py       3. filter what fits: the largest micro-batch of a group that fits, as a candidate
  choose.py    4. choose: which groups are sized (branch and bound) and which candidate wins
  explain.py   then the plan, with its reason and runners-up
  diagnose.py  or, when nothing fits, the nearest miss and what would fit
Each stage imports only the ones before it (tests/planning/test_search_stages.py).

`exhaustive_plan` sizes every micro-batch of every group; tests and bench/planner.py check that
`plan_job` chooses the same plan.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from ... import api
from ...sizing import ModelArchitecture
from ..plan import Infeasible, PlanningResult, plan_key_of
from ..policy import ClusterPolicy
from ..pools import NodePool
from .ask import ask_from_spec
from .choose import choose, cost_window_of, find
from .diagnose import infeasible
from .estimate import Estimates, Estimator, default_estimator, work_of
from .explain import to_plan
from .space import pools_for


def plan_job(
    spec: api.FineTuneJobSpec,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    *,
    exclude: Iterable[Any] = (),
    calibration: float | None = None,
    architecture: ModelArchitecture | None = None,
    estimator: Estimator | None = None,
) -> PlanningResult:
    """The cheapest plan that fits, or an Infeasible naming the nearest miss.

    `exclude`: plans that already failed (Plan, PlanKey or PlanStatus), never proposed again.
    `calibration`: factor on the estimate's required bytes, learned from an observed OOM.
    `architecture`: the model's architecture when the spec refers to a ConfigMap the caller has read.
    `estimator`: the memory model (default: `sizing.estimate_memory`); tests pass their own.
    """
    return _plan(spec, pools, policy, exclude, calibration, architecture, estimator, exhaustive=False)


def exhaustive_plan(
    spec: api.FineTuneJobSpec,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    *,
    exclude: Iterable[Any] = (),
    calibration: float | None = None,
    architecture: ModelArchitecture | None = None,
    estimator: Estimator | None = None,
) -> PlanningResult:
    """The same choice by brute force: every micro-batch of every setup is sized. For checks."""
    return _plan(spec, pools, policy, exclude, calibration, architecture, estimator, exhaustive=True)


def _plan(spec, pools, policy, exclude, calibration, architecture, estimator, *, exhaustive: bool) -> PlanningResult:
    if calibration is not None and not (calibration > 0 and math.isfinite(calibration)):
        raise ValueError(f"calibration: must be a positive number, got {calibration!r}")
    calibration = calibration or 1.0
    ask = ask_from_spec(spec, policy, architecture)  # 0. what the job asks
    if isinstance(ask, Infeasible):
        return ask
    excluded = {plan_key_of(e) for e in exclude}
    considered, no_pool = pools_for(ask, pools)  # 1. the pools it may use (the groups: in find)
    if no_pool is not None:
        return no_pool
    estimates = Estimates(ask, estimator or default_estimator())  # 2. memory, sized on demand
    work = work_of(ask)  # 2. cost
    window = cost_window_of(policy)
    found, stats = find(ask, considered, work, estimates, excluded, calibration, window,  # 1-4
                        exhaustive=exhaustive)
    if not found:
        return infeasible(ask, pools, considered, work, estimates, excluded, calibration, window, stats)
    winner, others = choose(found, window)  # 4. the winner
    g = winner.group
    savings = estimates.savings(g.world, g.strategy, g.offload, g.checkpointing, winner.micro, g.levers)
    return to_plan(ask, winner, others, stats, calibration, window, exhaustive, savings)
