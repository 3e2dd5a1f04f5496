"""The learned memory calibration: the rule (bounded EWMA), what a run teaches once, and plans of the
same kind applying it (shown in the plan's reason, which `kubectl describe` prints)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from finetune_operator import calibration as C
from finetune_operator import lifecycle
from finetune_trainer import contract
from test_lifecycle import POLICY, POOLS, T0, World, example

IMAGE = POLICY.trainer_image  # the examples name no spec.image: their runs ran the trainer image


@given(st.lists(st.floats(0.01, 100.0), min_size=1, max_size=30))
def test_the_factor_stays_within_bounds_and_counts_every_run(ratios):
    learned = None
    for ratio in ratios:
        learned = C.update(learned, ratio)
        assert C.MIN_FACTOR <= learned.factor <= C.MAX_FACTOR
    assert learned.runs == len(ratios)
    assert C.Learned.from_json(learned.to_json()).factor == round(learned.factor, 4)


def test_first_run_sets_it_later_runs_move_it_and_less_never_goes_below_one():
    first = C.update(None, 1.2)
    assert first.factor == 1.2 and first.runs == 1
    second = C.update(first, 1.0)
    assert abs(second.factor - (1.2 + C.EWMA_WEIGHT * (1.0 - 1.2))) < 1e-9
    assert C.update(None, 0.7).factor == 1.0 and C.update(None, 3.0).factor == 1.5


def _succeed(world: World, peak_fraction: float) -> None:
    plan = world.job.status.plan
    report = contract.SuccessReport(steps=10, peak_allocated_bytes=int(plan.predicted_peak_gi_b * (1 << 30) * peak_fraction))
    world.pods = [world.pod({"phase": "Succeeded", "containerStatuses": [
        {"name": "pytorch", "state": {"terminated": {"exitCode": 0, "message": report.to_termination_message()}}}]})]
    world.set_condition("Succeeded")


def test_a_successful_run_teaches_its_kind_once():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.set_condition("Running")
    world.step()
    _succeed(world, 1.1)
    decision = world.step()
    plan = world.job.status.plan
    kind = C.Kind(plan.gpu_type, "llama", plan.method, plan.strategy, IMAGE)
    assert world.job.status.phase == "Succeeded"
    assert world.job.status.attempts[-1].observed_peak_gi_b is not None
    assert list(decision.learned) == [kind.key] and abs(decision.learned[kind.key].factor - 1.1) < 0.01
    assert world.step().learned == {}  # terminal: nothing learned twice


def test_a_later_plan_of_the_same_kind_applies_the_correction_and_says_so():
    job = example("llama-8b-lora.yaml")
    first = lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=POLICY, pools=POOLS))
    plan = first.status.plan
    kind = C.Kind(plan.gpu_type, "llama", plan.method, plan.strategy, IMAGE)
    table = {kind.key: C.Learned(1.25, 3, 1.3)}
    later = lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=POLICY, pools=POOLS, learned=table))
    applied = later.status.plan
    assert (applied.gpu_type, applied.strategy) == (plan.gpu_type, plan.strategy)  # still the cheapest that fits
    assert applied.calibration == 1.25 and applied.required_gi_b > plan.required_gi_b * 1.2
    assert "learned from 3 run(s) of lora ddp llama on H100-80GB" in applied.reason
    planned = next(c for c in later.status.conditions if c.type == "Planned")
    assert "learned from 3 run(s)" in planned.message  # what kubectl describe shows
    # Another kind's correction does not touch this plan.
    other = {C.Kind("NO-SUCH-GPU", "llama", "lora", "fsdp", IMAGE).key: C.Learned(1.5, 9, 1.5)}
    same = lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=POLICY, pools=POOLS, learned=other))
    assert same.status.plan.calibration == plan.calibration == 1.0
