"""After a GPU out-of-memory failure: the estimate calibrated by what was observed, then the
ladder climbed rung by rung, each planned with the failed plan's optimizer and its counterpart."""

from __future__ import annotations

import math
from typing import Sequence

from .. import api
from ..planning.plan import Infeasible, Plan, PlanKey
from ..planning.policy import ClusterPolicy
from ..planning.pools import GiB, NodePool
from ..planning.search import choose_cheapest_or_startable, cost_window_of, plan_job
from ..sizing import ModelArchitecture
from .classify import Failure
from .history import excluded_keys
from .ladder import LADDER
from .next_step import AfterFailure, NextStep, describe_change
from .pinning import pinned_spec
from finetune_trainer import optimizers


# After an OOM the next plan must fit the calibrated estimate with this much to spare,
# on top of the job's own headroom: the observation bounds the truth from below only.
CALIBRATION_MARGIN = 1.05


def calibration_factor(failure: Failure, failed: api.PlanStatus) -> float:
    """How much the raw estimate of the failed plan under-predicted, at least (>= 1).

    The plan's required figure already carries the calibration it was planned with; the
    raw estimate is that divided back out, so repeated failures do not compound the factor.
    When the process saw less GPU memory than the pool promises (a MIG slice, memory held
    by another process, a driver reserve larger than the catalog's), the estimate is scaled
    by that shortfall too, so that the next plan fits in what was really there: otherwise
    nothing is learned, and the same settings would be proposed again.
    """
    old = failed.calibration or 1.0
    planned = int(failed.gpu_memory_gi_b * GiB)
    capacity = failure.capacity_bytes or planned
    raw_required = failed.required_gi_b * GiB / old
    factor = capacity / raw_required if raw_required > 0 else 1.0
    if 0 < capacity < planned:
        factor = max(factor, old * planned / capacity)
    peak = failed.predicted_peak_gi_b * GiB
    if failure.peak_allocated_bytes and peak > 0:
        observed = failure.peak_allocated_bytes + (failure.tried_to_allocate_bytes or 0)
        factor = max(factor, observed / peak)
    # The old factor was learned from an earlier failure and still holds; never go below it.
    return max(factor * CALIBRATION_MARGIN, old, 1.0)


def after_gpu_oom(after: AfterFailure, failure: Failure) -> NextStep:
    spec, failed, excluded, floor = after.spec, after.failed, after.excluded, after.floor
    pools, policy, what, architecture = after.pools, after.policy, after.what, after.architecture
    factor = max(calibration_factor(failure, failed), floor)
    allowed = set(spec.recovery.allowed_adjustments)
    keys = excluded_keys(excluded)
    planner = _Planner(pools, policy, keys, factor, architecture)
    free: set[str] = set()
    tried: list[str] = []
    last: Infeasible | None = None
    for rung in LADDER:
        if rung.name not in allowed:
            continue
        if rung.name == "method" and spec.method != "lora":
            continue  # only LoRA -> QLoRA; full fine-tuning is never silently turned into adapters
        free |= rung.knobs
        tried.append(rung.name)
        result = _best_of_optimizers(planner, spec, failed, free)
        if isinstance(result, Plan):
            change = describe_change(failed, result)
            why = f"{what}; the estimate under-predicted, calibrated x{factor:.2f}"
            return NextStep(True, result, change, why)
        last = result
    detail = f": {last.message}" if last is not None else ""
    return NextStep(
        False,
        None,
        "",
        f"{what}; nothing fits with the estimate calibrated x{factor:.2f} after trying {', '.join(tried) or 'no adjustments'}{detail}",
    )


class _Planner:
    """plan_job with the ladder's fixed arguments, remembering answers: successive rungs ask
    the same question again (a rung whose optimizer choice keeps the failed plan's optimizer
    repeats the previous rung's search)."""

    def __init__(self, pools: Sequence[NodePool], policy: ClusterPolicy, exclude: tuple[PlanKey, ...],
                 calibration: float, architecture: ModelArchitecture | None) -> None:
        self.pools, self.policy, self.exclude = pools, policy, exclude
        self.calibration, self.architecture = calibration, architecture
        self._answers: dict[str, Plan | Infeasible] = {}

    def plan(self, spec: api.FineTuneJobSpec) -> Plan | Infeasible:
        question = spec.model_dump_json()
        answer = self._answers.get(question)
        if answer is None:
            answer = self._answers[question] = plan_job(
                spec, self.pools, self.policy, exclude=self.exclude, calibration=self.calibration,
                architecture=self.architecture,
            )
        return answer


def _optimizer_choices(failed: api.PlanStatus, free: set[str]) -> tuple[str, ...]:
    """The optimizers the plan may use: the failed plan's first (no change), then, from the
    optimizer rung on, its counterpart."""
    if "optimizer" not in free:
        return (failed.optimizer,)
    return (failed.optimizer, optimizers.kind(failed.optimizer).counterpart)


def _best_of_optimizers(planner: _Planner, spec: api.FineTuneJobSpec, failed: api.PlanStatus,
                        free: set[str]) -> Plan | Infeasible:
    found: list[tuple[Plan, int]] = []
    last: Infeasible | None = None
    for optimizer in _optimizer_choices(failed, free):
        result = planner.plan(pinned_spec(spec, failed, free, optimizer=optimizer))
        if isinstance(result, Plan):
            found.append((result, int(optimizer != failed.optimizer)))
        else:
            last = result
    if not found:
        assert last is not None
        return last
    return _preferred(found, planner.policy)


def _preferred(found: list[tuple[Plan, int]], policy: ClusterPolicy) -> Plan:
    """The planner's own choice rule over finished plans (cost, then starting now, then fewer
    GPUs, nodes and changes, where `extra` counts the changes the planner did not see, such as
    the optimizer). On a full tie the earlier plan wins: the one that keeps the optimizer."""

    def cost(pe: tuple[Plan, int]) -> float:
        return pe[0].cost_per_step if pe[0].cost_per_step is not None else math.inf

    return choose_cheapest_or_startable(
        found, cost=cost, startable=lambda pe: not pe[0].needs_scale_up,
        tie_break=lambda pe: (pe[0].needs_scale_up, pe[0].gpus, pe[0].nodes, len(pe[0].changes) + pe[1], cost(pe)),
        window=cost_window_of(policy))[0]
