"""After a host out-of-memory kill: more pod memory within what the node has; when that is
exhausted, host-memory levers and offload turned off."""

from __future__ import annotations

from ..planning.plan import Plan
from ..planning.pools import GiB
from ..planning.search import plan_job
from .history import excluded_keys, host_bytes, is_repeat
from .next_step import AfterFailure, NextStep
from .pinning import pinned_spec, replan_pinned
from finetune_trainer.memory_levers import LEVERS


# Host memory grows by this factor per host OOM, up to what the node offers.
HOST_MEMORY_GROWTH = 1.5
# Share of a node's memory a training pod may take (the kubelet, system daemons and the
# eviction threshold need the rest).
HOST_MEMORY_NODE_SHARE = 0.90


def after_host_oom(after: AfterFailure) -> NextStep:
    spec, failed, excluded, floor = after.spec, after.failed, after.excluded, after.floor
    pools, policy, what, architecture = after.pools, after.policy, after.what, after.architecture
    allowed = set(spec.recovery.allowed_adjustments)
    pool = next((p for p in pools if p.name == failed.node_pool), None)
    current = host_bytes(failed)
    node_limit = int(pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE) if pool is not None else 0
    raise_failed = ""  # why raising pod memory did not work, when it was tried and the node had room
    if pool is not None and "hostMemory" in allowed and current < node_limit:
        same = replan_pinned(spec, failed, pools, policy, architecture, calibration=floor)
        if not isinstance(same, Plan):
            raise_failed = f"; the plan can no longer be placed with more pod memory: {same.message}"
        elif same.pool.name != failed.node_pool:
            raise_failed = f"; the plan no longer fits its pool {failed.node_pool}"
        if isinstance(same, Plan) and same.pool.name == failed.node_pool:
            bigger = min(node_limit, int(current * HOST_MEMORY_GROWTH))
            plan = same.model_copy(update={"host_memory_bytes": max(bigger, same.host_memory_bytes)})
            # Strictly more than it failed with, by construction (current < node_limit);
            # checked all the same, against every run of this plan that failed before.
            if not is_repeat(plan.key, plan.host_memory_bytes, excluded):
                change = (f"raised pod memory {current / GiB:.0f} -> {plan.host_memory_bytes / GiB:.0f} GiB"
                          f" (node has {pool.host_memory_bytes / GiB:.0f} GiB)")
                return NextStep(True, plan, change, what)
    for lever in LEVERS:
        # A lever that keeps state in host memory (activation offloading) is turned off.
        if not (lever.host_memory and lever.rung in allowed and lever.in_use(failed)):
            continue
        candidate = pinned_spec(spec, failed, set())
        candidate = candidate.model_copy(update={"training": candidate.training.model_copy(update=dict(lever.off))})
        result = plan_job(candidate, pools, policy, exclude=excluded_keys(excluded), calibration=floor,
                          architecture=architecture)
        if isinstance(result, Plan):
            return NextStep(True, result, f"turned off {lever.label}: host memory is exhausted", what)
    if "offload" in allowed and failed.offload != "none":
        candidate = pinned_spec(spec, failed, set())
        candidate = candidate.model_copy(
            update={"resources": candidate.resources.model_copy(update={"offload": "none"})}
        )
        result = plan_job(candidate, pools, policy, exclude=excluded_keys(excluded), calibration=floor,
                          architecture=architecture)
        if isinstance(result, Plan):
            return NextStep(True, result, f"turned offload off ({failed.offload} -> none): host memory is exhausted", what)
        tried = f"; without offload it does not fit: {result.message}"
    else:
        tried = "; nothing else is allowed"
    if pool is None:
        return NextStep(False, None, "", f"{what}; node pool {failed.node_pool} is gone{tried}")
    if "hostMemory" not in allowed:
        return NextStep(False, None, "", f"{what}; raising pod memory is not allowed{tried}")
    if raise_failed:
        # The node had room: say what really stopped it, not the node's limit.
        return NextStep(False, None, "", f"{what}{raise_failed}{tried}")
    return NextStep(False, None, "", f"{what}; pod memory is at the node's limit ({node_limit / GiB:.0f} GiB){tried}")
