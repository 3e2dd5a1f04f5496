"""The adjustment ladder (recovery/adjust.py), with the example catalog and real sizing.

Every scenario plans a real first attempt from an example job, fails it the way a pod
would, and checks what `decide_next` proposes next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator import api
from finetune_operator.planning.plan import Plan, plan_key_of
from finetune_operator.planning.policy import load_policy
from finetune_operator.planning.pools import GiB, load_catalog
from finetune_operator.planning.search import plan_job
from finetune_operator.recovery.adjust import (
    CALIBRATION_MARGIN,
    HOST_MEMORY_GROWTH,
    HOST_MEMORY_NODE_SHARE,
    FailedRun,
    calibration_factor,
    decide_next,
    describe_change,
    failed_runs,
    is_repeat,
    learned_calibration,
    pinned_spec,
    replan_after_loss,
    replan_pinned,
)
from finetune_operator.recovery.classify import Failure, FailureKind

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy({"allowedRegions": ["eu-de-berlin", "eu-fr-paris"]})
POOLS = load_catalog((REPO / "examples" / "pools.yaml").read_text())


# The ladder's older rungs are checked on jobs that turn the lean-trainer levers off (the planner
# would otherwise use them from the first plan on); test_adjust_levers.py checks the lever rungs.
LEVERS_OFF = {"training__masterWeights": "fp32", "training__optimizerInBackward": False,
              "training__lossChunks": 1, "training__activationOffloading": False}


def spec_of(name: str, levers_off: bool = True, **changes: Any) -> api.FineTuneJobSpec:
    """An example job's spec with `a__b=value` changes (as in tests/operator/test_lifecycle.py)."""
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"].update(namespace="team-a", uid="uid-1", generation=1)
    if levers_off:
        changes = {**LEVERS_OFF, **changes}
    for path, value in changes.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return api.parse_job(doc).spec


def first_plan(spec: api.FineTuneJobSpec) -> api.PlanStatus:
    plan = plan_job(spec, POOLS, POLICY)
    assert isinstance(plan, Plan), plan
    return plan.to_status()


def gpu_oom(plan: api.PlanStatus, peak_fraction: float | None = 0.99) -> Failure:
    """What the trainer reports: the peak it reached on a GPU of the plan's capacity."""
    capacity = int(plan.gpu_memory_gi_b * GiB)
    peak = None if peak_fraction is None else int(capacity * peak_fraction)
    return Failure(FailureKind.GPU_OUT_OF_MEMORY, "CUDA out of memory", "report", phase="backward", step=3,
                   peak_allocated_bytes=peak, capacity_bytes=capacity)


HOST_OOM = Failure(FailureKind.HOST_OUT_OF_MEMORY, "OOMKilled", "kubelet", exit_code=137)
EVICTED = Failure(FailureKind.EVICTED, "PreemptionByScheduler: preempted", "pod")
NODE_LOST = Failure(FailureKind.NODE_LOST, "DeletionByTaintManager", "pod")
DATA_ERROR = Failure(FailureKind.DATA_ERROR, "line 3: not JSON", "report")


def decide(spec: api.FineTuneJobSpec, failure: Failure, failed: api.PlanStatus, *, attempts_made: int = 1,
           failed_keys=(), pools=POOLS, **kw: Any):
    return decide_next(spec, failure, failed, attempts_made=attempts_made, failed_keys=list(failed_keys),
                       pools=pools, policy=POLICY, **kw)


# Plan fields that are not knobs of the ladder (they follow from the knobs or the estimate).
_DERIVED = {"gradient_accumulation", "predicted_peak_gi_b", "required_gi_b", "breakdown", "peak_phase",
            "calibration", "estimated_hours", "estimated_cost", "needs_scale_up", "reason", "host_memory_gi_b",
            "gpus", "lever_savings"}


def changed_fields(old: api.PlanStatus, new: Plan) -> set[str]:
    a, b = old.model_dump(), new.to_status().model_dump()
    return {k for k in a if k not in _DERIVED and a[k] != b[k]}


# ---------------------------------------------------------------------------
# GPU OOM: the ladder
# ---------------------------------------------------------------------------

LORA = "llama-8b-lora.yaml"
FULL = "llama-8b-full.yaml"
SHORT_LORA = {"training__sequenceLength": 1024}  # its first plan has micro-batch 4: room to halve


def test_the_first_rung_is_gradient_checkpointing():
    spec = spec_of(LORA)
    failed = first_plan(spec)
    assert not failed.gradient_checkpointing and failed.strategy == "ddp"
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry and step.plan is not None
    assert changed_fields(failed, step.plan) == {"gradient_checkpointing"}
    assert step.changes == "turned on gradient checkpointing"
    assert step.plan.calibration > 1.0 and "calibrated x" in step.why
    # The global batch is kept whatever changes.
    assert step.plan.micro_batch_size * step.plan.gradient_accumulation * step.plan.gpus == spec.training.global_batch_size


@pytest.mark.parametrize("name,changes,rung,knobs", [
    (LORA, SHORT_LORA, "gradientCheckpointing", {"gradient_checkpointing"}),
    (LORA, SHORT_LORA, "microBatch", {"micro_batch_size"}),
    (FULL, {}, "sharding", {"strategy"}),
    (FULL, {"resources__gpus": 2, "resources__strategy": "fsdp"}, "optimizer8bit", {"optimizer"}),
    (FULL, {"resources__gpus": 4, "resources__strategy": "zero3", "resources__offload": "none"}, "offload", {"offload"}),
])
def test_a_rung_alone_changes_only_its_own_knobs(name, changes, rung, knobs):
    spec = spec_of(name, recovery={"allowedAdjustments": [rung]}, **changes)
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry, step.why
    assert changed_fields(failed, step.plan) == knobs


def test_more_gpus_moves_to_a_bigger_gpu_when_nothing_smaller_fits():
    # Replicated QLoRA (ddp) without the sharding and lever rungs: sharded with fsdp (and
    # offloaded), or with its activations on the host, the 4-bit 70B would fit smaller GPUs.
    # Micro-batch 1: left free, the H200 holds 8 x 2048 tokens, over which QLoRA's dequantisation
    # amortises (throughput.py), and is the first plan already (cheaper than the H100 at 1 x 2048).
    rungs = ["gradientCheckpointing", "microBatch", "optimizer8bit", "offload", "moreGPUs"]
    spec = spec_of("llama-70b-qlora.yaml", resources__strategy="ddp", training__microBatchSize=1,
                   recovery={"allowedAdjustments": rungs})
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry
    assert step.plan.gpu_type != failed.gpu_type and step.plan.method == failed.method
    assert step.plan.pool.gpu_memory_bytes > failed.gpu_memory_gi_b * GiB
    assert step.plan.region in POLICY.allowed_regions
    assert f"({failed.node_pool}) ->" in step.changes


def test_rungs_the_job_does_not_allow_are_skipped():
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["microBatch", "sharding"]}, **SHORT_LORA)
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry
    assert not step.plan.gradient_checkpointing  # the first rung was not allowed
    assert changed_fields(failed, step.plan) <= {"micro_batch_size", "strategy"}


def test_nothing_allowed_gives_up_and_says_what_was_tried():
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["hostMemory"]})
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert not step.retry and step.plan is None
    assert "after trying no adjustments" in step.why


def test_when_no_rung_fits_the_reason_names_the_rungs_and_the_nearest_miss():
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["gradientCheckpointing"]})
    failed = first_plan(spec)
    # A peak three times the GPU: no setting of checkpointing alone can fit that.
    step = decide(spec, gpu_oom(failed, 3.0), failed)
    assert not step.retry
    assert "after trying gradientCheckpointing" in step.why and "nothing fits" in step.why


def test_method_is_only_changed_when_listed_and_only_from_lora():
    base = {"allowedAdjustments": ["method"]}
    # Checkpointing on and micro-batch 1 already: the quantized base weights are what is left.
    pinned = {"training__gradientCheckpointing": True, "training__microBatchSize": 1}
    spec = spec_of(LORA, recovery=base, **pinned)
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed, 0.8), failed)
    assert step.retry and step.plan.method == "qlora" and "method lora -> qlora" in step.changes
    # Not listed (the default list leaves it out): never.
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["gradientCheckpointing", "microBatch"]}, **pinned)
    step = decide(spec, gpu_oom(failed, 0.8), failed)
    assert step.plan is None or step.plan.method == "lora"
    # Full fine-tuning is never turned into adapters, even when listed.
    spec = spec_of(FULL, recovery=base)
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert not step.retry and "after trying no adjustments" in step.why


def test_the_failed_plan_is_never_proposed_again_even_when_the_caller_did_not_list_it():
    spec = spec_of(LORA)
    plan = first_plan(spec)
    # Figures that teach nothing (a recorded requirement above the GPU, no peak reported):
    # the calibration stays x1, and by the estimate the same plan fits again.
    failed = plan.model_copy(update={"required_gi_b": 2 * plan.gpu_memory_gi_b})
    nothing = gpu_oom(failed, None)
    assert calibration_factor(nothing, failed) == pytest.approx(1.0)
    step = decide(spec, nothing, failed, failed_keys=())
    assert step.retry and step.plan.key != plan_key_of(failed)


def test_a_gpu_smaller_than_promised_scales_the_estimate():
    # The process saw 40 of the pool's 80 GB (a MIG slice, another process): the estimate
    # was not wrong, the GPU was smaller; the next plan must fit in what was really there.
    spec = spec_of(LORA)
    failed = first_plan(spec)
    half = Failure(FailureKind.GPU_OUT_OF_MEMORY, "CUDA out of memory", "log",
                   capacity_bytes=int(failed.gpu_memory_gi_b * GiB / 2))
    assert calibration_factor(half, failed) == pytest.approx(2 * CALIBRATION_MARGIN, rel=1e-3)
    step = decide(spec, half, failed)
    # The planner's own (uncalibrated) figure for the new plan fits in what the process saw.
    assert step.retry and step.plan.required_bytes / step.plan.calibration <= half.capacity_bytes


def test_plans_that_failed_earlier_are_excluded():
    spec = spec_of(LORA)
    failed = first_plan(spec)
    first = decide(spec, gpu_oom(failed), failed).plan
    # Say the plan the ladder would pick had failed before: the next best is proposed.
    earlier = FailedRun(first.key, first.host_memory_bytes, FailureKind.GPU_OUT_OF_MEMORY)
    step = decide(spec, gpu_oom(failed), failed, failed_keys=[earlier])
    assert step.retry and step.plan.key not in (first.key, plan_key_of(failed))


def test_max_attempts_ends_recovery():
    spec = spec_of(LORA, recovery={"maxAttempts": 3})
    failed = first_plan(spec)
    assert decide(spec, gpu_oom(failed), failed, attempts_made=2).retry
    step = decide(spec, gpu_oom(failed), failed, attempts_made=3)
    assert not step.retry and "all 3 attempts are used" in step.why
    # Without spec.recovery.maxAttempts the policy's default holds.
    spec = spec_of(LORA, recovery={})
    step = decide(spec, EVICTED, failed, attempts_made=POLICY.default_max_attempts)
    assert not step.retry and f"all {POLICY.default_max_attempts} attempts" in step.why


def test_a_failure_a_retry_cannot_fix_is_given_up():
    spec = spec_of(LORA)
    failed = first_plan(spec)
    step = decide(spec, DATA_ERROR, failed)
    assert not step.retry and step.plan is None and "a retry cannot fix this" in step.why


# ---------------------------------------------------------------------------
# The optimizer rung is a freedom
# ---------------------------------------------------------------------------

def test_the_optimizer_rung_does_not_pin_8bit():
    spec = spec_of(FULL)
    failed = first_plan(spec)
    assert failed.optimizer == "adamw"
    assert pinned_spec(spec, failed, {"optimizer"}).training.optimizer == "adamw"
    assert pinned_spec(spec, failed, {"optimizer"}, optimizer="adamw-8bit").training.optimizer == "adamw-8bit"


def test_a_later_rung_may_keep_adamw_and_use_zero_with_offload():
    # bitsandbytes' 8-bit optimizers do not run under DeepSpeed ZeRO. With the strategy held at
    # zero3 (sharding not allowed), forcing 8-bit at the optimizer rung left the offload rung
    # nothing; as a freedom, the offload rung keeps AdamW and offloads it.
    spec = spec_of(FULL, resources__gpus=4, resources__strategy="zero3", resources__offload="none",
                   recovery={"allowedAdjustments": ["optimizer8bit", "offload"]})
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry, step.why
    assert (step.plan.optimizer, step.plan.strategy, step.plan.offload) == ("adamw", "zero3", "optimizer")
    assert "optimizer state" not in step.changes


def test_the_optimizer_is_kept_when_switching_buys_nothing():
    spec = spec_of(FULL, resources__gpus=4, resources__strategy="fsdp",
                   recovery={"allowedAdjustments": ["optimizer8bit", "offload"]})
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry and step.plan.offload != "none"
    assert step.plan.optimizer == "adamw"


def test_switching_the_optimizer_says_its_state_is_not_carried_over():
    spec = spec_of(FULL, resources__gpus=2, resources__strategy="fsdp", recovery={"allowedAdjustments": ["optimizer8bit"]})
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry and step.plan.optimizer == "adamw-8bit"
    assert "optimizer adamw -> adamw-8bit" in step.changes
    assert "optimizer state is not carried over" in step.changes


def test_an_8bit_plan_may_go_back_to_adamw_for_zero_with_offload():
    # The user asked for 8-bit on two GPUs; what fits after the OOM is ZeRO with the optimizer
    # offloaded, which only AdamW can run: the freedom works both ways.
    spec = spec_of(FULL, resources__gpus=2, resources__strategy="fsdp", training__optimizer="adamw-8bit")
    failed = first_plan(spec)
    assert failed.optimizer == "adamw-8bit"
    step = decide(spec, gpu_oom(failed, 1.2), failed)
    assert step.retry, step.why
    assert step.plan.optimizer == "adamw" and step.plan.strategy.startswith("zero") and step.plan.offload == "optimizer"
    assert "optimizer adamw-8bit -> adamw (optimizer state is not carried over" in step.changes


# ---------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------

def test_calibration_is_capacity_over_the_raw_requirement_with_a_margin():
    spec = spec_of(LORA)
    failed = first_plan(spec)
    no_peak = gpu_oom(failed, None)
    expected = (failed.gpu_memory_gi_b * GiB) / (failed.required_gi_b * GiB) * CALIBRATION_MARGIN
    assert calibration_factor(no_peak, failed) == pytest.approx(expected)


def test_calibration_uses_the_observed_peak_and_the_failed_allocation():
    spec = spec_of(LORA)
    failed = first_plan(spec)
    capacity = int(failed.gpu_memory_gi_b * GiB)
    failure = Failure(FailureKind.GPU_OUT_OF_MEMORY, "oom", "log", capacity_bytes=capacity,
                      peak_allocated_bytes=int(1.5 * capacity), tried_to_allocate_bytes=2 * GiB)
    observed = (int(1.5 * capacity) + 2 * GiB) / (failed.predicted_peak_gi_b * GiB)
    assert calibration_factor(failure, failed) == pytest.approx(observed * CALIBRATION_MARGIN)


def test_a_calibrated_plan_does_not_compound_its_factor():
    # The failed plan's required figure already carries its calibration: dividing it back out
    # gives the same factor for the same observation, never factor x factor.
    spec = spec_of(LORA)
    plain = first_plan(spec)
    calibrated = plan_job(pinned_spec(spec, plain, set()), POOLS, POLICY, calibration=1.1).to_status()
    assert calibrated.calibration == pytest.approx(1.1)
    no_peak_plain, no_peak_cal = gpu_oom(plain, None), gpu_oom(calibrated, None)
    assert plan_key_of(plain) == plan_key_of(calibrated)
    assert calibration_factor(no_peak_cal, calibrated) == pytest.approx(calibration_factor(no_peak_plain, plain), rel=1e-3)


def test_calibration_never_goes_below_what_was_learned():
    # An observation that would say "x2.6" after a plan that had learned x5 keeps x5: the
    # earlier failure still happened.
    spec = spec_of(LORA)
    plan = first_plan(spec)
    failed = plan.model_copy(update={"calibration": 5.0, "required_gi_b": 2 * plan.gpu_memory_gi_b})
    assert calibration_factor(gpu_oom(failed, None), failed) == 5.0


def test_a_caller_given_calibration_is_a_floor():
    spec = spec_of(FULL)
    failed = first_plan(spec)
    step = decide(spec, gpu_oom(failed, 0.5), failed, calibration=2.2)
    assert step.retry and step.plan.calibration >= 2.2
    with pytest.raises(ValueError):
        decide(spec, gpu_oom(failed), failed, calibration=float("nan"))


# ---------------------------------------------------------------------------
# Host OOM
# ---------------------------------------------------------------------------

# Four L40S with FSDP and offload: the cheapest plan is on l40s-paris (480 GiB nodes).
OFFLOADING = {"resources": {"gpus": 4, "strategy": "fsdp", "offload": "optimizer+params", "maxGPUs": 8}}


def offloading_plan() -> tuple[api.FineTuneJobSpec, api.PlanStatus]:
    spec = spec_of(FULL, **OFFLOADING)
    failed = first_plan(spec)
    assert failed.offload == "optimizer+params" and failed.node_pool == "l40s-paris"
    return spec, failed


def test_host_oom_raises_pod_memory_and_keeps_everything_else():
    spec, failed = offloading_plan()
    step = decide(spec, HOST_OOM, failed)
    assert step.retry and step.plan.key == plan_key_of(failed)
    before = int(round(failed.host_memory_gi_b * GiB))
    assert step.plan.host_memory_bytes == int(before * HOST_MEMORY_GROWTH)
    assert step.changes.startswith("raised pod memory")


def test_host_oom_memory_stops_at_the_nodes_share_then_turns_offload_off_or_gives_up():
    spec, failed = offloading_plan()
    pool = next(p for p in POOLS if p.name == failed.node_pool)
    limit = int(pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE)
    history: list[FailedRun] = []
    seen: list[int] = []
    for _ in range(10):
        step = decide(spec, HOST_OOM, failed, failed_keys=history)
        history.append(FailedRun.of(failed, FailureKind.HOST_OUT_OF_MEMORY))
        if not step.retry or not step.changes.startswith("raised"):
            break
        assert step.plan.host_memory_bytes <= limit
        seen.append(step.plan.host_memory_bytes)
        failed = step.plan.to_status()
    assert seen == sorted(seen) and len(set(seen)) == len(seen) and seen[-1] == limit
    # At the limit: offload off does not fit four L40S, so it says both.
    assert not step.retry
    assert "at the node's limit" in step.why and "without offload it does not fit" in step.why


LORA_OFFLOADING = {"resources__gpus": 8, "resources__strategy": "fsdp", "resources__offload": "optimizer+params"}


def test_host_oom_at_the_limit_turns_offload_off_when_that_fits():
    spec = spec_of(LORA, **LORA_OFFLOADING)
    failed = first_plan(spec)
    pool = next(p for p in POOLS if p.name == failed.node_pool)
    at_limit = failed.model_copy(update={"host_memory_gi_b": pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE / GiB})
    step = decide(spec, HOST_OOM, at_limit)
    assert step.retry, step.why
    assert step.plan.offload == "none" and "turned offload off" in step.changes


def test_host_oom_without_host_memory_allowed_and_without_offload_gives_up():
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["gradientCheckpointing"]})
    failed = first_plan(spec)
    step = decide(spec, HOST_OOM, failed)
    assert not step.retry and "raising pod memory is not allowed" in step.why


def test_a_host_oom_after_a_gpu_oom_keeps_the_calibration():
    # The offload-off path planned uncalibrated and without exclusions before: a plan that
    # had run out of GPU memory could come back, sized by the estimate it had disproved.
    spec = spec_of(LORA, **LORA_OFFLOADING)
    plain = first_plan(spec)
    after_gpu_oom = decide(spec, gpu_oom(plain), plain).plan.to_status()
    assert after_gpu_oom.calibration > 1
    # Both host-OOM remedies: raising memory, and (at the node's limit) offload off.
    raised = decide(spec, HOST_OOM, after_gpu_oom).plan
    assert raised.calibration >= after_gpu_oom.calibration
    pool = next(p for p in POOLS if p.name == after_gpu_oom.node_pool)
    at_limit = after_gpu_oom.model_copy(update={"host_memory_gi_b": pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE / GiB})
    step = decide(spec, HOST_OOM, at_limit, failed_keys=[FailedRun.of(plain, FailureKind.GPU_OUT_OF_MEMORY)])
    assert step.retry and "turned offload off" in step.changes, step.why
    assert step.plan.calibration >= after_gpu_oom.calibration
    assert step.plan.key != plan_key_of(plain)


def test_host_oom_offload_off_never_proposes_a_plan_that_failed():
    spec = spec_of(LORA, **LORA_OFFLOADING)
    failed = first_plan(spec)
    pool = next(p for p in POOLS if p.name == failed.node_pool)
    at_limit = failed.model_copy(update={"host_memory_gi_b": pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE / GiB})
    off = decide(spec, HOST_OOM, at_limit).plan
    assert off is not None and off.offload == "none"
    # That very plan had run out of GPU memory before: it must not come back.
    step = decide(spec, HOST_OOM, at_limit, failed_keys=[FailedRun(off.key, off.host_memory_bytes, FailureKind.GPU_OUT_OF_MEMORY)])
    assert step.plan is None or step.plan.key != off.key


def test_a_second_host_oom_raises_again_with_the_history():
    spec, failed = offloading_plan()
    once = decide(spec, HOST_OOM, failed).plan.to_status()
    history = [FailedRun.of(failed, FailureKind.HOST_OUT_OF_MEMORY)]
    twice = decide(spec, HOST_OOM, once, failed_keys=history)
    assert twice.retry and twice.plan.host_memory_bytes > once.host_memory_gi_b * GiB
    # A caller that lists every attempt's key (this one's too) gets the same answer: the
    # failed plan's own bare key is this failure, whose kind decide_next knows.
    listed = decide(spec, HOST_OOM, once, failed_keys=[plan_key_of(failed), plan_key_of(once)])
    assert listed.retry and listed.plan.host_memory_bytes == twice.plan.host_memory_bytes


# ---------------------------------------------------------------------------
# Eviction and node loss: the same plan
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("failure", [EVICTED, NODE_LOST], ids=["evicted", "node-lost"])
def test_eviction_and_node_loss_run_the_same_plan(failure):
    spec = spec_of(LORA)
    plain = first_plan(spec)
    failed = decide(spec, gpu_oom(plain), plain).plan.to_status()  # a calibrated plan
    step = decide(spec, failure, failed, failed_keys=[FailedRun.of(plain, FailureKind.GPU_OUT_OF_MEMORY)])
    assert step.retry and step.plan.key == plan_key_of(failed)
    assert step.plan.calibration == pytest.approx(failed.calibration)
    assert step.plan.host_memory_bytes >= int(failed.host_memory_gi_b * GiB) - 2**20
    assert step.changes == "same plan (the failure was not the plan's)"


def test_the_same_plan_keeps_the_pod_memory_a_host_oom_taught():
    spec, failed = offloading_plan()
    raised = decide(spec, HOST_OOM, failed).plan.to_status()
    step = decide(spec, EVICTED, raised, failed_keys=[FailedRun.of(failed, FailureKind.HOST_OUT_OF_MEMORY)])
    assert step.retry and step.plan.key == plan_key_of(raised)
    assert step.plan.host_memory_bytes > failed.host_memory_gi_b * GiB


def test_an_evicted_plan_whose_pool_is_gone_moves_and_keeps_what_was_learned():
    spec = spec_of(LORA)
    plain = first_plan(spec)
    failed = decide(spec, gpu_oom(plain), plain).plan.to_status()
    pools = [p for p in POOLS if p.name != failed.node_pool]
    step = decide(spec, NODE_LOST, failed, pools=pools, failed_keys=[FailedRun.of(plain, FailureKind.GPU_OUT_OF_MEMORY)])
    assert step.retry and step.plan.pool.name != failed.node_pool
    assert step.plan.calibration >= failed.calibration
    assert step.plan.region in spec.placement.regions
    assert step.changes.startswith("the same plan cannot run again")


def test_an_evicted_plan_that_ran_out_of_memory_before_is_not_run_again():
    # Not a history our own answers make (a GPU-OOM'd plan is never proposed again), but the
    # history may come from elsewhere (an older operator): it is never run again.
    spec = spec_of(LORA)
    failed = first_plan(spec)
    step = decide(spec, EVICTED, failed, failed_keys=[FailedRun.of(failed, FailureKind.GPU_OUT_OF_MEMORY)])
    assert step.retry and step.plan.key != plan_key_of(failed)
    assert step.changes.startswith("the same plan cannot run again")


def test_a_caller_listing_every_attempt_still_reruns_an_evicted_plan():
    # lifecycle/ lists every attempt's plan key, the evicted one included.
    spec = spec_of(LORA)
    plain = first_plan(spec)
    failed = decide(spec, gpu_oom(plain), plain).plan.to_status()
    step = decide(spec, EVICTED, failed, failed_keys=[plan_key_of(plain), plan_key_of(failed)])
    assert step.retry and step.plan.key == plan_key_of(failed)
    # The other bare keys still count: the plan that ran out of GPU memory stays excluded.
    step = decide(spec, gpu_oom(failed), failed, failed_keys=[plan_key_of(plain), plan_key_of(failed)])
    assert step.plan is None or step.plan.key not in (plan_key_of(plain), plan_key_of(failed))


# ---------------------------------------------------------------------------
# Helpers for the lifecycle
# ---------------------------------------------------------------------------

def attempt(n: int, plan: api.PlanStatus, outcome: str) -> api.AttemptStatus:
    return api.AttemptStatus(attempt=n, pytorch_job=f"j-a{n}", plan=plan, outcome=outcome)


def test_failed_runs_are_the_memory_failures_of_the_history():
    spec = spec_of(LORA)
    p1 = first_plan(spec)
    p2 = p1.model_copy(update={"micro_batch_size": 2, "calibration": 1.7})
    p3 = p1.model_copy(update={"strategy": "fsdp", "calibration": 1.4})
    history = [attempt(1, p1, "GPUOutOfMemory"), attempt(2, p2, "HostOutOfMemory"), attempt(3, p3, "Evicted"),
               attempt(4, p3, "Running")]
    runs = failed_runs(history)
    assert [(r.key, r.kind) for r in runs] == [(plan_key_of(p1), FailureKind.GPU_OUT_OF_MEMORY),
                                              (plan_key_of(p2), FailureKind.HOST_OUT_OF_MEMORY)]
    assert learned_calibration(history) == 1.7 and learned_calibration([]) == 1.0
    host = int(round(p2.host_memory_gi_b * GiB))
    assert is_repeat(plan_key_of(p1), 10**15, runs)  # a GPU OOM: never again, whatever the pod memory
    assert is_repeat(plan_key_of(p2), host, runs) and not is_repeat(plan_key_of(p2), host + GiB, runs)
    assert not is_repeat(plan_key_of(p3), 0, runs)
    with pytest.raises(ValueError):
        FailedRun(plan_key_of(p3), 0, FailureKind.EVICTED)


def test_replan_after_loss_runs_the_recorded_plan_when_it_can():
    spec = spec_of(LORA)
    recorded = first_plan(spec)
    plan = replan_after_loss(spec, recorded, pools=POOLS, policy=POLICY, calibration=1.2)
    assert isinstance(plan, Plan) and plan.key == plan_key_of(recorded)
    assert plan.calibration == pytest.approx(1.2)


def test_replan_after_loss_moves_with_exclusion_and_calibration():
    spec = spec_of(LORA)
    recorded = first_plan(spec).model_copy(update={"calibration": 1.3})
    pools = [p for p in POOLS if p.name != recorded.node_pool]
    anywhere = replan_after_loss(spec, recorded, pools=pools, policy=POLICY)
    assert isinstance(anywhere, Plan) and anywhere.calibration >= 1.3
    ruled_out = FailedRun(anywhere.key, anywhere.host_memory_bytes, FailureKind.GPU_OUT_OF_MEMORY)
    other = replan_after_loss(spec, recorded, failed=[ruled_out], pools=pools, policy=POLICY, calibration=1.5)
    assert isinstance(other, Plan) and other.key != anywhere.key and other.calibration >= 1.5


def test_replan_pinned_keeps_pod_memory_and_calibration():
    spec, failed = offloading_plan()
    bigger = failed.model_copy(update={"host_memory_gi_b": failed.host_memory_gi_b + 50, "calibration": 1.1})
    plan = replan_pinned(spec, bigger, POOLS, POLICY)
    assert isinstance(plan, Plan), plan
    assert plan.host_memory_bytes == int(round(bigger.host_memory_gi_b * GiB))
    assert plan.calibration == pytest.approx(1.1)
    assert replan_pinned(spec, bigger, POOLS, POLICY, calibration=1.15).calibration == pytest.approx(1.15)


def test_describe_change_lists_every_difference():
    spec = spec_of(FULL)
    old = first_plan(spec)
    new = plan_job(spec_of(FULL, resources={"gpus": 2, "strategy": "fsdp"}, training={
        "sequenceLength": 4096, "globalBatchSize": 64, "maxSteps": 100, "optimizer": "adamw-8bit",
        "gradientCheckpointing": True}), POOLS, POLICY)
    text = describe_change(old, new)
    assert "sharding zero1 -> fsdp" in text and "optimizer adamw -> adamw-8bit" in text
    assert "turned on gradient checkpointing" in text and "GPUs 8 x" in text
    assert describe_change(old, plan_job(spec, POOLS, POLICY)) == "same settings"


# ---------------------------------------------------------------------------
# GPUs spread over nodes
# ---------------------------------------------------------------------------

MULTI_NODE = {"resources__gpus": 16, "resources__maxGPUs": 16, "placement__regions": ["eu-de-berlin"]}


def test_replan_pinned_reproduces_the_recorded_split():
    spec = spec_of(FULL, **MULTI_NODE)
    planned = first_plan(spec)
    assert planned.nodes * planned.gpus_per_node == 16 and planned.nodes > 1
    # Another split of the same GPUs, as an earlier attempt may have recorded it: the spec can
    # only pin the count, and the planner prefers fewer nodes.
    recorded = planned.model_copy(update={"nodes": 4, "gpus_per_node": 4})
    plan = replan_pinned(spec, recorded, POOLS, POLICY)
    assert isinstance(plan, Plan) and (plan.nodes, plan.gpus_per_node) == (4, 4)
    assert plan.key == plan_key_of(recorded)
    # Evicted: the same plan, as it was recorded.
    step = decide(spec, EVICTED, recorded)
    assert step.retry and step.plan.key == plan_key_of(recorded)


def test_a_gpu_oom_rules_out_every_split_of_the_plan():
    spec = spec_of(FULL, **MULTI_NODE)
    failed = first_plan(spec)
    run = FailedRun.of(failed, FailureKind.GPU_OUT_OF_MEMORY)
    other_split = plan_key_of(failed)._replace(nodes=4, gpus_per_node=4)
    assert run.repeated_by(other_split, 0)
    assert other_split in run.keys() and plan_key_of(failed) in run.keys()
    # Host memory is per node: another split is another run.
    host_run = FailedRun.of(failed, FailureKind.HOST_OUT_OF_MEMORY)
    assert not host_run.repeated_by(other_split, 0) and host_run.keys() == (plan_key_of(failed),)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry
    assert (step.plan.gpus, step.plan.strategy, step.plan.micro_batch_size, step.plan.gradient_checkpointing,
            step.plan.offload, step.plan.optimizer) != (failed.gpus, failed.strategy, failed.micro_batch_size,
                                                        failed.gradient_checkpointing, failed.offload, failed.optimizer)


def test_describe_change_names_a_new_split():
    spec = spec_of(FULL, **MULTI_NODE)
    old = first_plan(spec)
    new = replan_pinned(spec, old.model_copy(update={"nodes": 4, "gpus_per_node": 4}), POOLS, POLICY)
    assert describe_change(old, new) == f"nodes {old.nodes} x {old.gpus_per_node} GPUs -> 4 x 4 GPUs"


def test_a_host_oom_whose_plan_no_longer_fits_its_pool_says_so_not_the_node_limit():
    """The node had room for more pod memory, but the plan can no longer be placed there (here:
    the pool scaled to zero nodes): the answer names that, not the node's memory limit (chaos)."""
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["hostMemory"]})
    failed = first_plan(spec)
    shrunk = [p.model_copy(update={"max_nodes": 0}) if p.name == failed.node_pool else p for p in POOLS]
    step = decide_next(spec, HOST_OOM, failed, attempts_made=1, failed_keys=[], pools=shrunk, policy=POLICY)
    assert not step.retry and "node's limit" not in step.why
    assert "can no longer be placed" in step.why or "no longer fits its pool" in step.why, step.why
