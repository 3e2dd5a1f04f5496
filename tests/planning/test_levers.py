"""The lean-trainer levers as planner freedoms: used when the job leaves them auto and they make a
plan possible or cheaper, never when it fixes them, never against combinations.py, and named in
the plan with what each saves."""

from __future__ import annotations

from typing import Any

from finetune_operator import api
from finetune_operator.planning import ClusterPolicy, Infeasible, Plan, load_catalog, plan_job

REGION = "eu-de-berlin"
POLICY = ClusterPolicy(allowed_regions=[REGION])


def pools(gpu: str, price: float = 1.0) -> list:
    return load_catalog({"pools": [{"name": "p", "region": REGION, "gpuType": gpu, "gpusPerNode": 8, "maxNodes": 1,
                                    "pricePerGpuHour": price, "hostMemory": "1000Gi"}]})


def full_8b(**training: Any) -> api.FineTuneJobSpec:
    return api.parse_spec({
        "model": {"name": "m", "architecture": {"preset": "llama-3.1-8b"}, "source": {"pvc": {"claimName": "m"}}},
        "dataset": {"source": {"pvc": {"claimName": "d", "path": "t.jsonl"}}},
        "method": "full",
        "training": {"sequenceLength": 2048, "globalBatchSize": 2, "microBatchSize": 2, "maxSteps": 10,
                     "optimizer": "paged-adamw-8bit", "gradientCheckpointing": True, **training},
        "resources": {"gpus": 1, "memoryHeadroom": 0.05},
        "placement": {"regions": [REGION]},
    })


def test_a_24gb_gpu_fits_the_8b_full_fine_tune_only_with_its_levers():
    plan = plan_job(full_8b(), pools("L4-24GB"), POLICY)
    assert isinstance(plan, Plan), plan
    assert plan.master_weights == "bf16" and plan.optimizer_in_backward and plan.gradient_accumulation == 1
    assert plan.lever_savings_bytes["master_weights"] > 0 and "Memory levers save" in plan.reason
    status = plan.to_status()
    assert status.master_weights == "bf16" and status.lever_savings["masterWeights"] > 10
    assert "bf16 master weights" in plan.changes


def test_fixed_levers_are_kept():
    pinned = plan_job(full_8b(masterWeights="fp32", optimizerInBackward=False), pools("L4-24GB"), POLICY)
    if isinstance(pinned, Plan):
        assert pinned.master_weights == "fp32" and not pinned.optimizer_in_backward
    else:
        assert isinstance(pinned, Infeasible)


def test_at_equal_cost_the_plan_gives_up_nothing():
    # On an 80 GB GPU the plain setup fits: no lever that costs quality is used.
    plan = plan_job(full_8b(), pools("H100-80GB"), POLICY)
    assert isinstance(plan, Plan), plan
    assert plan.master_weights == "fp32" and not plan.optimizer_in_backward and not plan.activation_offloading


def test_the_step_in_backward_needs_accumulation_one():
    spec = full_8b().model_copy(update={"training": full_8b().training.model_copy(
        update={"global_batch_size": 8, "micro_batch_size": "auto"})})
    plan = plan_job(spec, pools("L4-24GB"), POLICY)
    assert isinstance(plan, Plan), plan
    assert not plan.optimizer_in_backward or plan.gradient_accumulation == 1
