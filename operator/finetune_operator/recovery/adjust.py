"""What the next attempt changes: the adjustment ladder.

For a GPU out-of-memory failure the estimate is first *calibrated* by what was observed:
the attempt needed more than the GPU has, so the true figure is at least
`capacity / predicted`, times a safety margin (and at least `(reported peak + the
allocation that failed) / predicted peak`, when the trainer or the log tail gave them).
Then the planner is asked again, with the calibrated estimate, allowing one more kind
of change per rung, in this documented order:

  1. gradientCheckpointing  turn activation recomputation on
  2. microBatch             smaller micro-batch, more accumulation (the global batch is kept)
  3. sharding               ddp -> fsdp / zero2 -> zero3
  4. optimizer8bit          AdamW states in 8 bits
  5. offload                optimizer (and parameter) states to host memory
  6. moreGPUs               more GPUs, or another pool, in the allowed regions
  7. method                 LoRA -> QLoRA; only when `recovery.allowedAdjustments` lists `method`

Rungs the job does not allow are skipped. Each rung keeps the freedoms of the rungs
before it, and the planner picks the cheapest plan among them, so the answer is the
cheapest change that fits, found as early in the ladder as possible. Plans that already
failed are excluded; placement is never touched, so the regions stay as allowed.

A host out-of-memory kill (OOMKilled, exit 137) raises the pod's memory within what the
node has; when that is exhausted and the plan offloads to host memory, offload is turned
off instead. Eviction and node loss run the same plan again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import api
from ..planning.plan import Infeasible, Plan, PlanKey
from ..planning.policy import ClusterPolicy
from ..planning.pools import GiB, NodePool
from ..planning.search import plan_job
from ..sizing import ModelArchitecture
from .classify import Failure, FailureKind, Remedy

# After an OOM the next plan must fit the calibrated estimate with this much to spare,
# on top of the job's own headroom: the observation bounds the truth from below only.
CALIBRATION_MARGIN = 1.05
# Host memory grows by this factor per host OOM, up to what the node offers.
HOST_MEMORY_GROWTH = 1.5
# Share of a node's memory a training pod may take (the kubelet, system daemons and the
# eviction threshold need the rest).
HOST_MEMORY_NODE_SHARE = 0.90


@dataclass(frozen=True)
class Rung:
    name: str  # as in spec.recovery.allowedAdjustments
    knobs: frozenset[str]  # what this rung lets the planner change


LADDER: tuple[Rung, ...] = (
    Rung("gradientCheckpointing", frozenset({"gradient_checkpointing"})),
    Rung("microBatch", frozenset({"micro_batch_size"})),
    Rung("sharding", frozenset({"strategy"})),
    Rung("optimizer8bit", frozenset({"optimizer"})),
    Rung("offload", frozenset({"offload"})),
    Rung("moreGPUs", frozenset({"gpus", "node_pool"})),
    Rung("method", frozenset({"method"})),
)


@dataclass(frozen=True)
class NextStep:
    """The decision after a failed attempt."""

    retry: bool
    plan: Plan | None  # the next attempt's plan when retry
    changes: str  # what changes, for a person ("turned on gradient checkpointing ...")
    why: str  # the failure and the reasoning, for a person


def calibration_factor(failure: Failure, failed: api.PlanStatus) -> float:
    """How much the raw estimate of the failed plan under-predicted, at least (>= 1).

    The plan's required figure already carries the calibration it was planned with; the
    raw estimate is that divided back out, so repeated failures do not compound the factor.
    """
    old = failed.calibration or 1.0
    capacity = failure.capacity_bytes or int(failed.gpu_memory_gi_b * GiB)
    raw_required = failed.required_gi_b * GiB / old
    factor = capacity / raw_required if raw_required > 0 else 1.0
    peak = failed.predicted_peak_gi_b * GiB
    if failure.peak_allocated_bytes and peak > 0:
        observed = failure.peak_allocated_bytes + (failure.tried_to_allocate_bytes or 0)
        factor = max(factor, observed / peak)
    # The old factor was learned from an earlier failure and still holds; never go below it.
    return max(factor * CALIBRATION_MARGIN, old, 1.0)


def decide_next(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    *,
    attempts_made: int,
    failed_keys: Sequence[PlanKey],
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
) -> NextStep:
    """The next attempt's plan after `failure`, or why there is none.

    `architecture`: the model's, when the spec refers to a ConfigMap (see `plan_job`)."""
    what = failure.describe()
    if failure.remedy is Remedy.GIVE_UP:
        return NextStep(False, None, "", f"{what}; a retry cannot fix this")
    max_attempts = spec.recovery.max_attempts or policy.default_max_attempts
    if attempts_made >= max_attempts:
        return NextStep(False, None, "", f"{what}; all {max_attempts} attempts are used")
    if failure.remedy is Remedy.RETRY_SAME:
        plan = replan_pinned(spec, failed, pools, policy, architecture)
        if isinstance(plan, Plan):
            return NextStep(True, plan, "same plan (the failure was not the plan's)", what)
        return NextStep(False, None, "", f"{what}; the same plan no longer fits: {plan.message}")
    if failure.kind is FailureKind.HOST_OUT_OF_MEMORY:
        return _after_host_oom(spec, failure, failed, pools, policy, what, architecture)
    return _after_gpu_oom(spec, failure, failed, failed_keys, pools, policy, what, architecture)


def _after_gpu_oom(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    failed_keys: Sequence[PlanKey],
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    what: str,
    architecture: ModelArchitecture | None,
) -> NextStep:
    factor = calibration_factor(failure, failed)
    allowed = set(spec.recovery.allowed_adjustments)
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
        candidate_spec = pinned_spec(spec, failed, free)
        result = plan_job(candidate_spec, pools, policy, exclude=tuple(failed_keys), calibration=factor,
                          architecture=architecture)
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


def _after_host_oom(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    what: str,
    architecture: ModelArchitecture | None,
) -> NextStep:
    allowed = set(spec.recovery.allowed_adjustments)
    pool = next((p for p in pools if p.name == failed.node_pool), None)
    if pool is None:
        return NextStep(False, None, "", f"{what}; node pool {failed.node_pool} is gone")
    node_limit = int(pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE)
    current = int(failed.host_memory_gi_b * GiB)
    if "hostMemory" in allowed and current < node_limit:
        plan = replan_pinned(spec, failed, pools, policy, architecture)
        if isinstance(plan, Plan):
            bigger = min(node_limit, int(current * HOST_MEMORY_GROWTH))
            plan = plan.model_copy(update={"host_memory_bytes": max(bigger, plan.host_memory_bytes)})
            change = f"raised pod memory {current / GiB:.0f} -> {plan.host_memory_bytes / GiB:.0f} GiB (node has {pool.host_memory_bytes / GiB:.0f} GiB)"
            return NextStep(True, plan, change, what)
    if "offload" in allowed and failed.offload != "none":
        candidate = pinned_spec(spec, failed, set())
        candidate = candidate.model_copy(
            update={"resources": candidate.resources.model_copy(update={"offload": "none"})}
        )
        result = plan_job(candidate, pools, policy, architecture=architecture)
        if isinstance(result, Plan):
            return NextStep(True, result, f"turned offload off ({failed.offload} -> none): host memory is exhausted", what)
    return NextStep(False, None, "", f"{what}; pod memory is at the node's limit ({node_limit / GiB:.0f} GiB) and nothing else is allowed")


def pinned_spec(spec: api.FineTuneJobSpec, plan: api.PlanStatus, free: set[str]) -> api.FineTuneJobSpec:
    """The job's spec with every knob of `plan` fixed, except those in `free` (left to the planner)."""
    training = spec.training.model_copy(
        update={
            "micro_batch_size": "auto" if "micro_batch_size" in free else plan.micro_batch_size,
            "gradient_checkpointing": None if "gradient_checkpointing" in free else plan.gradient_checkpointing,
            # The rung is "use an 8-bit optimizer": the rungs before it already tried without.
            "optimizer": "adamw-8bit" if "optimizer" in free and plan.optimizer == "adamw" else plan.optimizer,
        }
    )
    resources = spec.resources.model_copy(
        update={
            "gpus": "auto" if "gpus" in free else plan.gpus,
            "node_pool": "auto" if "node_pool" in free else plan.node_pool,
            "strategy": "auto" if "strategy" in free else plan.strategy,
            "offload": "auto" if "offload" in free else plan.offload,
        }
    )
    method = plan.method
    if "method" in free and plan.method == "lora":
        method = "qlora"
        resources = resources.model_copy(update={"strategy": "ddp" if "strategy" not in free else "auto", "offload": "none"})
    return spec.model_copy(update={"method": method, "training": training, "resources": resources})


def replan_pinned(
    spec: api.FineTuneJobSpec,
    plan: api.PlanStatus,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
) -> Plan | Infeasible:
    """The plan described by a PlanStatus, rebuilt by the planner (to render it again)."""
    result = plan_job(pinned_spec(spec, plan, set()), pools, policy, calibration=plan.calibration or 1.0,
                      architecture=architecture)
    if isinstance(result, Plan):
        wanted = int(plan.host_memory_gi_b * GiB)
        if wanted > result.host_memory_bytes:
            result = result.model_copy(update={"host_memory_bytes": wanted})
    return result


def describe_change(old: api.PlanStatus, new: Plan) -> str:
    """What differs between two plans, the way a person says it."""
    parts: list[str] = []
    if new.gradient_checkpointing and not old.gradient_checkpointing:
        parts.append("turned on gradient checkpointing")
    elif old.gradient_checkpointing and not new.gradient_checkpointing:
        parts.append("turned off gradient checkpointing")
    if new.micro_batch_size != old.micro_batch_size:
        verb = "halved" if new.micro_batch_size * 2 == old.micro_batch_size else "changed"
        parts.append(
            f"{verb} the micro-batch {old.micro_batch_size} -> {new.micro_batch_size}, "
            f"accumulation {old.gradient_accumulation} -> {new.gradient_accumulation}"
        )
    if new.strategy != old.strategy:
        parts.append(f"sharding {old.strategy} -> {new.strategy}")
    if new.optimizer != old.optimizer:
        parts.append(f"optimizer {old.optimizer} -> {new.optimizer}")
    if new.offload != old.offload:
        parts.append(f"offload {old.offload} -> {new.offload}")
    if new.gpus != old.gpus or new.pool.name != old.node_pool:
        parts.append(
            f"GPUs {old.gpus} x {old.gpu_type} ({old.node_pool}) -> {new.gpus} x {new.gpu_type} ({new.pool.name})"
        )
    if new.method != old.method:
        parts.append(f"method {old.method} -> {new.method}")
    if not parts:
        return "same settings"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
