"""What a job's attempt history rules out and teaches the next plan: the runs that ran out of
memory (never proposed again as they ran) and the largest calibration learned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .. import api
from ..planning.plan import PlanKey, plan_key_of
from ..planning.pools import GiB
from .classify import FailureKind


# Attempt outcomes (status.attempts[].outcome) that are the plan's own fault.
MEMORY_OUTCOMES: dict[str, FailureKind] = {
    FailureKind.GPU_OUT_OF_MEMORY.value: FailureKind.GPU_OUT_OF_MEMORY,
    FailureKind.HOST_OUT_OF_MEMORY.value: FailureKind.HOST_OUT_OF_MEMORY,
}
MEMORY_KINDS = frozenset(MEMORY_OUTCOMES.values())


@dataclass(frozen=True)
class FailedRun:
    """A plan that ran out of memory, as it ran: never to be proposed again as it was."""

    key: PlanKey
    host_memory_bytes: int  # the pod memory it ran with
    kind: FailureKind  # GPU_OUT_OF_MEMORY or HOST_OUT_OF_MEMORY

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"FailedRun: {self.kind.value} is not a memory failure; only those exclude a plan")

    def repeated_by(self, key: PlanKey, host_memory_bytes: int) -> bool:
        """Whether running `key` with `host_memory_bytes` of pod memory would repeat this failure."""
        if self.kind is FailureKind.HOST_OUT_OF_MEMORY:
            # Pod memory is per node: another split is another run for host memory.
            return key == self.key and host_memory_bytes <= self.host_memory_bytes
        # GPU memory does not depend on how the GPUs are spread over nodes.
        return _unsplit(key) == _unsplit(self.key)

    def keys(self) -> tuple[PlanKey, ...]:
        """The keys the planner must not propose again because of this failure."""
        if self.kind is FailureKind.HOST_OUT_OF_MEMORY:
            return (self.key,)
        return all_splits(self.key)

    @classmethod
    def of(cls, plan: api.PlanStatus, kind: FailureKind) -> "FailedRun":
        return cls(plan_key_of(plan), host_bytes(plan), kind)


Excluded = PlanKey | FailedRun


def failed_runs(attempts: Iterable[api.AttemptStatus]) -> tuple[FailedRun, ...]:
    """The runs of a job's history that ran out of memory (outcome GPU/HostOutOfMemory).

    Evicted, lost and unschedulable attempts are not among them: their plans did not fail."""
    return tuple(
        FailedRun.of(a.plan, MEMORY_OUTCOMES[a.outcome])
        for a in attempts
        if a.plan is not None and a.outcome in MEMORY_OUTCOMES
    )


def learned_calibration(attempts: Iterable[api.AttemptStatus]) -> float:
    """The largest calibration any attempt's plan carried (1.0 when none): the floor for the next plan."""
    return max([1.0] + [a.plan.calibration for a in attempts if a.plan is not None and a.plan.calibration])


def is_repeat(key: PlanKey, host_memory_bytes: int, excluded: Iterable[Excluded]) -> bool:
    """Whether a plan with `key` and `host_memory_bytes` repeats one of `excluded`."""
    for item in excluded:
        if isinstance(item, FailedRun):
            if item.repeated_by(key, host_memory_bytes):
                return True
        elif plan_key_of(item) == key:
            return True
    return False


def host_bytes(plan: api.PlanStatus) -> int:
    return int(round(plan.host_memory_gi_b * GiB))


def _unsplit(key: PlanKey) -> tuple:
    """A key with its nodes x GPUs-per-node replaced by the GPU count."""
    return (key.node_pool, key.nodes * key.gpus_per_node, *key[3:])


def all_splits(key: PlanKey) -> tuple[PlanKey, ...]:
    """`key` with its GPUs spread over nodes in every even way (the key itself first)."""
    gpus = key.nodes * key.gpus_per_node
    others = (key._replace(nodes=n, gpus_per_node=gpus // n) for n in range(1, gpus + 1) if gpus % n == 0)
    return tuple(dict.fromkeys((key, *others)))


def excluded_keys(excluded: Iterable[Excluded]) -> tuple[PlanKey, ...]:
    """What the planner excludes: every key that failed (a host-OOM'd key too: the planner
    would propose it with the pod memory it failed with, or less; a GPU-OOM'd key in every
    split)."""
    keys: list[PlanKey] = []
    for e in excluded:
        keys.extend(e.keys() if isinstance(e, FailedRun) else (plan_key_of(e),))
    return tuple(dict.fromkeys(keys))
