"""What a remedy is given after a failed attempt (`AfterFailure`), its answer (`NextStep`), and
how the change between two plans reads for a person."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import api
from ..planning.plan import Plan
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..sizing import ModelArchitecture
from .history import Excluded
from .ladder import LEVERS_BY_RUNG


@dataclass(frozen=True)
class AfterFailure:
    """What every remedy (after_loss, gpu_oom, host_oom) starts from: the failed plan and what
    bounds the next one (adjust.decide_next gathers it)."""

    spec: api.FineTuneJobSpec
    failed: api.PlanStatus  # the plan that failed
    excluded: Sequence[Excluded]  # what may not be proposed again, the failed plan included if it ran out of memory
    floor: float  # the calibration the next plan carries at least
    pools: Sequence[NodePool]
    policy: ClusterPolicy
    what: str  # the failure, for a person
    architecture: ModelArchitecture | None


@dataclass(frozen=True)
class NextStep:
    """The decision after a failed attempt."""

    retry: bool
    plan: Plan | None  # the next attempt's plan when retry
    changes: str  # what changes, for a person ("turned on gradient checkpointing ...")
    why: str  # the failure and the reasoning, for a person


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
        # The trainer drops the checkpoint's optimizer state on purpose when the optimizer
        # differs (its states have other shapes and dtypes); a person must know the
        # moments restart from zero.
        parts.append(
            f"optimizer {old.optimizer} -> {new.optimizer} (optimizer state is not carried over on resume:"
            " the weights resume from the checkpoint, the optimizer starts afresh)"
        )
    if new.offload != old.offload:
        parts.append(f"offload {old.offload} -> {new.offload}")
    for lever in LEVERS_BY_RUNG:
        change = lever.change_between(lever.setting_of(old), lever.setting_of(new))
        if change:
            parts.append(change)
    if new.gpus != old.gpus or new.pool.name != old.node_pool:
        parts.append(
            f"GPUs {old.gpus} x {old.gpu_type} ({old.node_pool}) -> {new.gpus} x {new.gpu_type} ({new.pool.name})"
        )
    elif (new.nodes, new.gpus_per_node) != (old.nodes, old.gpus_per_node):
        parts.append(f"nodes {old.nodes} x {old.gpus_per_node} GPUs -> {new.nodes} x {new.gpus_per_node} GPUs")
    if new.method != old.method:
        parts.append(f"method {old.method} -> {new.method}")
    if not parts:
        return "same settings"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
