"""A recorded plan as a spec the planner can be asked again: every knob fixed except those a rung
frees, and the recorded plan rebuilt (to render it again) with at least its calibration."""

from __future__ import annotations

import math
from typing import Sequence

from .. import api
from ..planning.plan import Infeasible, Plan, plan_key_of
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..planning.search import plan_job
from ..sizing import ModelArchitecture
from .history import all_splits, host_bytes
from finetune_trainer.combinations import Choices, allows
from finetune_trainer.memory_levers import LEVERS


def calibration_floor(failed: api.PlanStatus, calibration: float | None) -> float:
    if calibration is not None and not (calibration > 0 and math.isfinite(calibration)):
        raise ValueError(f"calibration: must be a positive number, got {calibration!r}")
    return max(failed.calibration or 1.0, calibration or 1.0, 1.0)


def pinned_spec(spec: api.FineTuneJobSpec, plan: api.PlanStatus, free: set[str],
                *, optimizer: str | None = None) -> api.FineTuneJobSpec:
    """The job's spec with every knob of `plan` fixed, except those in `free` (left to the planner).

    The planner has no `auto` for the optimizer: it is pinned to `optimizer` (default the
    plan's); the ladder frees it by asking once per optimizer (`gpu_oom._optimizer_choices`)."""
    asked = spec.training
    levers: dict[str, object] = {}
    for lever in LEVERS:
        # A lever that costs result quality stays as the job set it (Lever.keeps_explicit); left
        # auto, its rung frees it.
        lever_free = lever.name in free and (
            not lever.keeps_explicit or getattr(asked, lever.name) == lever.auto[lever.name])
        levers.update({field: lever.auto[field] if lever_free else getattr(plan, field) for field in lever.off})
    training = spec.training.model_copy(
        update={
            "micro_batch_size": "auto" if "micro_batch_size" in free else plan.micro_batch_size,
            "gradient_checkpointing": None if "gradient_checkpointing" in free else plan.gradient_checkpointing,
            "optimizer": optimizer or plan.optimizer,
            **levers,
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
        # Keep the plan's strategy and offload where QLoRA can run with them (combinations.py).
        keep = allows(Choices(method="qlora", strategy=plan.strategy, offload=plan.offload))
        resources = resources.model_copy(update={
            "strategy": "auto" if "strategy" in free else (plan.strategy if keep else "ddp"),
            "offload": "auto" if "offload" in free else (plan.offload if keep else "none")})
    return spec.model_copy(update={"method": method, "training": training, "resources": resources})


def replan_pinned(
    spec: api.FineTuneJobSpec,
    plan: api.PlanStatus,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
    *,
    calibration: float | None = None,
) -> Plan | Infeasible:
    """The plan described by a PlanStatus, rebuilt by the planner (to render it again), with
    its pod memory and at least its calibration (or `calibration`, when larger).

    The spec can pin the GPU count but not how the GPUs are spread over nodes: every other
    split is excluded, so the answer is the recorded plan itself or an Infeasible."""
    key = plan_key_of(plan)
    result = plan_job(pinned_spec(spec, plan, set()), pools, policy, calibration=calibration_floor(plan, calibration),
                      architecture=architecture, exclude=all_splits(key)[1:])
    if isinstance(result, Plan):
        wanted = host_bytes(plan)
        if wanted > result.host_memory_bytes:
            result = result.model_copy(update={"host_memory_bytes": wanted})
    return result
