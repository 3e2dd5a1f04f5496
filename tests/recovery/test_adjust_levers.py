"""The recovery ladder reaches the lean-trainer levers, in the order of what they give up, and
never overrides a quality lever the job set itself."""

from __future__ import annotations

import pytest

from finetune_operator import api
from finetune_operator.planning.plan import Plan
from finetune_operator.planning.search import plan_job
from finetune_operator.recovery.adjust import LADDER, pinned_spec

from .test_adjust import FULL, LORA, POLICY, POOLS, changed_fields, decide, gpu_oom, spec_of


def _first(spec: api.FineTuneJobSpec) -> api.PlanStatus:
    plan = plan_job(spec, POOLS, POLICY)
    assert isinstance(plan, Plan), plan
    return plan.to_status()


def test_lever_rungs_come_in_the_order_of_what_they_give_up():
    names = [r.name for r in LADDER]
    assert names.index("gradientCheckpointing") < names.index("chunkedLoss") < names.index("microBatch")
    assert names.index("activationOffloading") < names.index("optimizer8bit")
    assert names.index("offload") < names.index("optimizerInBackward") < names.index("moreGPUs")
    assert names.index("moreGPUs") < names.index("masterWeights") < names.index("method")
    assert set(api.DEFAULT_ADJUSTMENTS) >= {"chunkedLoss", "activationOffloading", "optimizerInBackward", "masterWeights"}


def test_one_ladder_the_api_and_recovery_share():
    # The ladder is written once (api.ADJUSTMENTS, each lever's rung placed by its registry entry):
    # recovery climbs exactly it (hostMemory is the host-OOM remedy), the default allows all but `method`.
    assert [r.name for r in LADDER] == [a for a in api.ADJUSTMENTS if a != "hostMemory"]
    assert api.DEFAULT_ADJUSTMENTS == [a for a in api.ADJUSTMENTS if a != "method"]
    assert api.ADJUSTMENTS == ("gradientCheckpointing", "chunkedLoss", "microBatch", "sharding",
                               "activationOffloading", "optimizer8bit", "offload", "optimizerInBackward", "moreGPUs",
                               "masterWeights", "sequenceParallel", "hostMemory", "method")
    assert api.RecoverySpec.model_fields["allowed_adjustments"].default == api.DEFAULT_ADJUSTMENTS


def test_chunked_loss_rung_alone_rescues_a_long_sequence_lora():
    extra = {"training__sequenceLength": 8192}
    failed = _first(spec_of(LORA, **extra))  # the plain loss (the job turns the levers off)
    assert failed.loss_chunks == 1
    spec = spec_of(LORA, recovery={"allowedAdjustments": ["chunkedLoss"]}, **extra)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry, step.why
    assert changed_fields(failed, step.plan) == {"loss_chunks"}
    assert step.plan.loss_chunks > 1 and "loss chunks 1 ->" in step.changes


def test_master_weights_rung_alone_moves_an_auto_job_to_bf16_weights():
    pinned = {"resources__strategy": "fsdp", "resources__gpus": 2}
    failed = _first(spec_of(FULL, **pinned))
    assert failed.master_weights == "fp32"
    spec = spec_of(FULL, levers_off=False, recovery={"allowedAdjustments": ["masterWeights"]},
                   training__lossChunks=1, training__optimizerInBackward=False, training__activationOffloading=False,
                   **pinned)
    step = decide(spec, gpu_oom(failed), failed)
    assert step.retry, step.why
    assert changed_fields(failed, step.plan) <= {"master_weights", "update_rounding"}
    assert step.plan.master_weights == "bf16" and "master weights fp32 -> bf16" in step.changes
    assert step.plan.lever_savings_bytes["master_weights"] > 0


def test_a_job_that_asks_for_fp32_master_weights_keeps_them():
    pinned = {"resources__strategy": "fsdp", "resources__gpus": 2}
    failed = _first(spec_of(FULL, **pinned))  # masterWeights: fp32, set by the job
    spec = spec_of(FULL, recovery={"allowedAdjustments": ["masterWeights"]}, **pinned)
    step = decide(spec, gpu_oom(failed), failed)
    assert not step.retry
    assert pinned_spec(spec, failed, {"master_weights"}).training.master_weights == "fp32"


@pytest.mark.parametrize("knob,field,auto", [
    ("loss_chunks", "loss_chunks", "auto"),
    ("activation_offloading", "activation_offloading", None),
    ("optimizer_in_backward", "optimizer_in_backward", None),
    ("master_weights", "master_weights", "auto"),
])
def test_a_lever_rung_frees_its_lever_and_pins_the_others(knob, field, auto):
    spec = spec_of(FULL, levers_off=False)
    failed = _first(spec_of(FULL))
    freed = pinned_spec(spec, failed, {knob}).training
    assert getattr(freed, field) == auto
    for other in ("loss_chunks", "activation_offloading", "optimizer_in_backward", "master_weights"):
        if other != field:
            assert getattr(freed, other) == getattr(failed, other)


def test_the_optimizer_in_backward_rung_keeps_an_explicit_no():
    spec = spec_of(FULL)  # optimizerInBackward: false, set by the job
    failed = _first(spec)
    assert pinned_spec(spec, failed, {"optimizer_in_backward"}).training.optimizer_in_backward is False
