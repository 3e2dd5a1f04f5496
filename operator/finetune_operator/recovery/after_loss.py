"""After an eviction or a lost node (and for a child to create again): the same plan, or, when it
can no longer be placed, the same settings elsewhere, then a fresh plan."""

from __future__ import annotations

from typing import Sequence

from .. import api
from ..planning.plan import Infeasible, Plan, plan_key_of
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..planning.search import plan_job
from ..sizing import ModelArchitecture
from .history import Excluded, excluded_keys, is_repeat
from .next_step import AfterFailure, NextStep, describe_change
from .pinning import calibration_floor, pinned_spec, replan_pinned


def replan_after_loss(
    spec: api.FineTuneJobSpec,
    recorded: api.PlanStatus,
    *,
    failed: Sequence[Excluded] = (),
    calibration: float | None = None,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
) -> Plan | Infeasible:
    """The plan for an attempt whose recorded plan must be run again (eviction, node loss, a
    child to create again), keeping what was learned: first the recorded plan itself;
    when it cannot be placed any more (its pool is gone or changed), the same settings on
    other GPUs or pools; then a fresh plan of the spec. Never a plan of `failed`
    (`failed_runs(status.attempts)`), never a calibration below the recorded plan's or
    `calibration` (`learned_calibration(status.attempts)`)."""
    floor = calibration_floor(recorded, calibration)
    same = replan_pinned(spec, recorded, pools, policy, architecture, calibration=floor)
    if isinstance(same, Plan) and not is_repeat(same.key, same.host_memory_bytes, failed):
        return same
    keys = excluded_keys(failed)
    elsewhere = plan_job(pinned_spec(spec, recorded, {"gpus", "node_pool"}), pools, policy, exclude=keys,
                         calibration=floor, architecture=architecture)
    if isinstance(elsewhere, Plan):
        return elsewhere
    return plan_job(spec, pools, policy, exclude=keys, calibration=floor, architecture=architecture)


def after_loss(after: AfterFailure) -> NextStep:
    spec, failed, excluded, floor = after.spec, after.failed, after.excluded, after.floor
    pools, policy, what, architecture = after.pools, after.policy, after.what, after.architecture
    plan = replan_after_loss(spec, failed, failed=excluded, calibration=floor, pools=pools, policy=policy,
                             architecture=architecture)
    if isinstance(plan, Infeasible):
        return NextStep(False, None, "", f"{what}; the plan can no longer be placed and nothing else fits: {plan.message}")
    if plan.key == plan_key_of(failed):
        return NextStep(True, plan, "same plan (the failure was not the plan's)", what)
    return NextStep(True, plan, f"the same plan cannot run again: {describe_change(failed, plan)}", what)
