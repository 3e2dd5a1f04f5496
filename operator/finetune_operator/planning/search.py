"""The plan search: the cheapest way to run a job that fits in memory, inside the allowed regions.

The pieces, one concern each:
  space.py       the job's space (pools x GPUs x nodes x strategy x offload x checkpointing x
                 micro-batch), what is feasible
  estimates.py   sizing estimates as the planner reads them, cached per setup
  candidates.py  groups of the space sized (largest fitting micro-batch) and costed
  bound.py       branch and bound: which groups need sizing at all (bench/planner.py: 45
                 estimates per plan instead of 237; a 1000-job burst of the scale benchmark's
                 jobs plans in a third of the CPU time that sizing every group takes)
  choice.py      the choice rule: cheapest, or one that starts now within the policy's margin
  explain.py     the plan's reason and runners-up
  diagnose.py    why nothing fits, and what would
Chosen: the lowest cost to finish (throughput.py; pools without a price are ranked at the
highest price among the pools considered, so a known-cheap pool never loses to an unknown one).
Costs within `COST_TIE` of the cheapest count as equal: the model is not more precise than that.
Among equals: pools with enough free GPUs now first, then fewer GPUs, fewer nodes, fewer changes
from the plain setup the job asked for (no offload, no checkpointing unless asked, ddp), then the
exact cost. With placementPreference startTime, a plan that can start now wins over a cheaper one
that must wait, within the policy's startTimeCostMargin.

`exhaustive_plan` sizes every micro-batch of every group; tests and bench/planner.py check that
`plan_job` chooses the same plan.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from .. import api
from ..sizing import ModelArchitecture
from .candidates import choose, find
from .choice import COST_TIE, choose_cheapest_or_startable, cost_window_of
from .diagnose import infeasible
from .estimates import EstimateFacts, Estimates, Estimator, default_estimator, estimate_facts
from .explain import to_plan
from .plan import Infeasible, PlanningResult, plan_key_of
from .policy import ClusterPolicy
from .pools import NodePool
from .space import pools_for, ask_from_spec
from .throughput import job_work

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
    ask_or_error = ask_from_spec(spec, policy, architecture)
    if isinstance(ask_or_error, Infeasible):
        return ask_or_error
    ask = ask_or_error
    excluded = {plan_key_of(e) for e in exclude}
    estimates = Estimates(ask, estimator or default_estimator())
    work = job_work(
        ask.arch, method=ask.method, lora_rank=ask.lora_rank, lora_targets=ask.lora_targets, precision=ask.precision,
        sequence_length=ask.sequence_length, global_batch_size=ask.global_batch_size,
    )
    if not ask.regions:
        wanted = ", ".join(spec.placement.regions)
        allowed = ", ".join(policy.allowed_regions) or "none"
        return Infeasible(
            message=f"no region is allowed: spec.placement.regions ({wanted}) and the cluster policy's"
            f" allowed regions ({allowed}) have no region in common",
            allowed_regions=[],
        )
    considered, no_pool = pools_for(ask, pools)
    if no_pool is not None:
        return no_pool
    found, stats = find(ask, considered, work, estimates, excluded, calibration or 1.0, exhaustive=exhaustive)
    if not found:
        return infeasible(ask, pools, considered, work, estimates, excluded, calibration or 1.0, stats)
    winner, others = choose(found, ask.cost_window)
    g = winner.group
    savings = estimates.savings(g.world, g.strategy, g.offload, g.checkpointing, winner.micro, g.levers)
    return to_plan(ask, winner, others, stats, calibration or 1.0, exhaustive, savings)
