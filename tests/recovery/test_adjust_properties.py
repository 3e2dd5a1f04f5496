"""Recovery's invariants over random failure sequences (hypothesis).

A job's attempts are played the way the lifecycle plays them: each attempt fails by a
random fate (a GPU OOM with a random observed peak, a host OOM, an eviction, a node lost,
a node lost with its whole pool gone), `decide_next` is asked with the history the status
holds (`failed_runs`, `learned_calibration`), and its answer becomes the next attempt.
Whatever the sequence:

* never a plan that ran out of memory again (a GPU-OOM'd plan never; a host-OOM'd plan
  only with strictly more pod memory), checked against the test's own record;
* the calibration never decreases;
* attempts stay within maxAttempts;
* every plan stays in the allowed regions, keeps the global batch, and changes the
  method only when the job allows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from finetune_operator import api
from finetune_operator.planning.plan import Plan, plan_key_of
from finetune_operator.planning.pools import GiB
from finetune_operator.planning.search import plan_job
from finetune_operator.recovery.adjust import decide_next, failed_runs, learned_calibration
from finetune_operator.recovery.classify import Failure, FailureKind

from .test_adjust import FULL, LORA, LORA_OFFLOADING, POLICY, POOLS, SHORT_LORA, spec_of

JOBS = [
    (LORA, {}),
    (LORA, SHORT_LORA),
    (LORA, LORA_OFFLOADING),
    (FULL, {}),
    (FULL, {"resources__gpus": 2, "resources__strategy": "fsdp"}),
    (FULL, {"resources__gpus": 4, "resources__strategy": "fsdp", "resources__offload": "optimizer+params"}),
    ("llama-70b-qlora.yaml", {}),
    (LORA, {"training__gradientCheckpointing": True, "training__microBatchSize": 1}),
    (FULL, {"resources__gpus": 16, "resources__maxGPUs": 16}),
]
ADJUSTMENTS = ["gradientCheckpointing", "microBatch", "sharding", "optimizer8bit", "offload", "moreGPUs",
               "hostMemory", "method"]


@dataclass(frozen=True)
class Fate:
    kind: FailureKind
    peak_fraction: float | None = None  # GPU OOM: the reported peak over the GPU's capacity
    # GPU OOM: the capacity the process saw over the pool's GPU memory (below 1: a MIG slice,
    # another process holding memory; then the calibration learns nothing)
    capacity_fraction: float = 1.0
    pool_gone: bool = False  # node lost, and its pool with it (a catalog change, a scaled-away pool)


FATES = st.one_of(
    st.builds(Fate, st.just(FailureKind.GPU_OUT_OF_MEMORY),
              st.one_of(st.none(), st.floats(min_value=0.3, max_value=2.0)),
              st.one_of(st.just(1.0), st.floats(min_value=0.1, max_value=1.0))),
    st.just(Fate(FailureKind.HOST_OUT_OF_MEMORY)),
    st.just(Fate(FailureKind.EVICTED)),
    st.just(Fate(FailureKind.NODE_LOST)),
    st.just(Fate(FailureKind.NODE_LOST, pool_gone=True)),
)


def failure_of(fate: Fate, plan: api.PlanStatus) -> Failure:
    if fate.kind is FailureKind.GPU_OUT_OF_MEMORY:
        capacity = int(plan.gpu_memory_gi_b * GiB * fate.capacity_fraction)
        peak = None if fate.peak_fraction is None else int(capacity * fate.peak_fraction)
        return Failure(fate.kind, "CUDA out of memory", "report", phase="forward", step=1,
                       peak_allocated_bytes=peak, capacity_bytes=capacity)
    return Failure(fate.kind, fate.kind.value, "pod")


def unsplit(key) -> tuple:
    return (key.node_pool, key.nodes * key.gpus_per_node, *key[3:])


def host_bytes(plan: api.PlanStatus) -> int:
    return int(round(plan.host_memory_gi_b * GiB))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    job=st.sampled_from(JOBS),
    allowed=st.one_of(st.none(), st.lists(st.sampled_from(ADJUSTMENTS), unique=True)),
    max_attempts=st.integers(min_value=1, max_value=10),
    fates=st.lists(FATES, min_size=1, max_size=10),
)
def test_recovery_invariants_over_random_failures(job, allowed, max_attempts, fates):
    name, changes = job
    recovery: dict = {"maxAttempts": max_attempts}
    if allowed is not None:
        recovery["allowedAdjustments"] = allowed
    spec = spec_of(name, recovery=recovery, **changes)
    allowed_now = set(spec.recovery.allowed_adjustments)
    regions = set(spec.placement.regions) & set(POLICY.allowed_regions)
    pools = list(POOLS)
    first = plan_job(spec, pools, POLICY)
    assert isinstance(first, Plan), first
    attempts = [api.AttemptStatus(attempt=1, pytorch_job="j-a1", plan=first.to_status())]
    # The test's own record of what ran out of memory: (key, pod memory, kind).
    ran_out: list[tuple] = []

    for fate in fates:
        failed = attempts[-1].plan
        if fate.pool_gone:
            pools = [p for p in pools if p.name != failed.node_pool]
        failure = failure_of(fate, failed)
        step = decide_next(
            spec, failure, failed, attempts_made=len(attempts), failed_keys=failed_runs(attempts),
            calibration=learned_calibration(attempts), pools=pools, policy=POLICY,
        )
        attempts[-1] = attempts[-1].model_copy(update={"outcome": fate.kind.value})
        if fate.kind in (FailureKind.GPU_OUT_OF_MEMORY, FailureKind.HOST_OUT_OF_MEMORY):
            ran_out.append((plan_key_of(failed), host_bytes(failed), fate.kind))
        if not step.retry:
            assert step.plan is None and step.why
            event(f"gave up after {fate.kind.value}" + (" (pool gone)" if fate.pool_gone else "")
                  + (": attempts used" if "attempts are used" in step.why else ": nothing fits"))
            break
        event(f"retried after {fate.kind.value}" + (" (pool gone)" if fate.pool_gone else ""))
        new = step.plan
        assert new is not None

        # Attempts bounded by maxAttempts.
        assert len(attempts) + 1 <= max_attempts
        # Never a plan that ran out of memory again (after a GPU OOM, not even spread over
        # nodes differently: the memory per GPU is the same).
        for key, host, kind in ran_out:
            if kind is FailureKind.GPU_OUT_OF_MEMORY:
                assert unsplit(new.key) != unsplit(key), (key, step.changes)
            elif new.key == key:
                assert new.host_memory_bytes > host, (key, new.host_memory_bytes, host)
        # The calibration learned is never lost.
        assert new.calibration >= max(a.plan.calibration for a in attempts) - 1e-9
        # Inside the allowed regions, the global batch kept, the method only when allowed.
        assert new.region in regions and set(new.allowed_regions) <= regions
        assert new.pool.name in {p.name for p in pools}
        assert new.micro_batch_size * new.gradient_accumulation * new.gpus == spec.training.global_batch_size
        if "method" not in allowed_now:
            assert new.method == spec.method
        # An eviction or a lost node runs the same plan while it can be placed and was not ruled out.
        if fate.kind in (FailureKind.EVICTED, FailureKind.NODE_LOST) and not fate.pool_gone:
            assert new.key == plan_key_of(failed), step.changes

        attempts.append(api.AttemptStatus(attempt=len(attempts) + 1, pytorch_job=f"j-a{len(attempts) + 1}",
                                          plan=new.to_status()))
    assert len(attempts) <= max(max_attempts, 1)
    event(f"{len(attempts)} attempts")
