"""The lifecycle state machine, driven through whole job histories without a cluster."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator import api, lifecycle
from finetune_operator.lifecycle import starting
from finetune_operator.children import SUSPENDED_BY_ANNOTATION, SUSPENDED_BY_US, Child, child_of
from finetune_operator.rendering.pytorchjob import PYTORCH_JOB
from finetune_operator.planning.policy import load_policy
from finetune_operator.planning.pools import GiB, load_catalog
from finetune_trainer import contract

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
POLICY = load_policy({"allowedRegions": ["eu-de-berlin", "eu-fr-paris"]})
POOLS = load_catalog((REPO / "examples" / "pools.yaml").read_text())


def example(name: str, **spec_changes: Any) -> api.FineTuneJob:
    doc = yaml.safe_load((REPO / "examples" / name).read_text())
    doc["metadata"].update(namespace="team-a", uid="uid-1", generation=1)
    for path, value in spec_changes.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return api.parse_job(doc)


class DuplicateCreate(AssertionError):
    pass


class World:
    """A strict stand-in for the cluster: the job's status and the objects the operator created.

    Strict where the invariants live: creating a name that exists is an error (the API server
    answers 409; the lifecycle must never ask), and the children the lifecycle sees are read
    back from what it created, as the shell reads them from the cluster."""

    def __init__(self, job: api.FineTuneJob) -> None:
        self.job = job
        self.objects: dict[str, dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.now = T0
        self.events: list[lifecycle.Event] = []
        self.creates = 0
        self.pools = POOLS

    def children(self) -> list[Child]:
        found = [child_of(o, PYTORCH_JOB) for k, o in self.objects.items() if k.startswith("PyTorchJob/")]
        return [c for c in found if c is not None]

    def step(self) -> lifecycle.Decision:
        decision = lifecycle.step(lifecycle.Observed(
            job=self.job, now=self.now, policy=POLICY, pools=self.pools, children=self.children(), pods=list(self.pods)))
        for ref in decision.delete:
            if self.objects.pop(f"{ref.kind}/{ref.name}", None) is not None and ref.kind == "PyTorchJob":
                self.pods = []
        for obj in decision.create:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            if key in self.objects:
                raise DuplicateCreate(key)
            self.creates += 1
            self.objects[key] = copy.deepcopy(obj)
        if decision.set_suspend is not None:
            pj = self.objects[f"PyTorchJob/{self.job.metadata.name}-a{decision.status.current_attempt}"]
            pj["spec"]["runPolicy"]["suspend"] = decision.set_suspend
            pj["metadata"].setdefault("annotations", {})[SUSPENDED_BY_ANNOTATION] = SUSPENDED_BY_US
            if not decision.set_suspend:
                del pj["metadata"]["annotations"][SUSPENDED_BY_ANNOTATION]
        self.events += decision.events
        self.job = self.job.model_copy(update={"status": decision.status})
        return decision

    def current(self) -> dict[str, Any]:
        return self.objects[f"PyTorchJob/{self.job.metadata.name}-a{self.job.status.current_attempt}"]

    def set_condition(self, state: str) -> None:
        self.current().setdefault("status", {})["conditions"] = [{"type": state, "status": "True"}]

    def pod(self, status: dict[str, Any], name: str = "p") -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {"finetune.dev/attempt": str(self.job.status.current_attempt)}},
                "status": status}

    def oom(self, peak_fraction: float = 0.99) -> None:
        plan = self.job.status.plan
        capacity = int(plan.gpu_memory_gi_b * GiB)
        report = contract.FailureReport(
            reason="GPUOutOfMemory", phase="backward", step=0, exit_code=75,
            peak_allocated_bytes=int(capacity * peak_fraction), device_total_bytes=capacity,
            micro_batch_size=plan.micro_batch_size)
        self.pods = [self.pod({"phase": "Failed", "containerStatuses": [
            {"name": "pytorch", "state": {"terminated": {"exitCode": 75, "message": report.to_termination_message()}}}]})]
        self.set_condition("Failed")

    def wait_backoff(self) -> None:
        if self.job.status.next_attempt_time is not None:
            self.now = self.job.status.next_attempt_time + timedelta(seconds=1)


def conditions(job: api.FineTuneJob) -> dict[str, str]:
    return {c.type: c.status for c in job.status.conditions}


def test_plan_launch_run_succeed():
    world = World(example("llama-8b-lora.yaml"))
    first = world.step()
    assert world.job.status.phase == "Launching"
    assert [o["kind"] for o in first.create] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]
    assert conditions(world.job)["Planned"] == "True" and world.job.status.current_attempt == 1
    assert world.job.status.plan.region == "eu-de-berlin"
    world.set_condition("Running")
    world.step()
    assert world.job.status.phase == "Running" and conditions(world.job)["Running"] == "True"
    world.set_condition("Succeeded")
    world.step()
    assert world.job.status.phase == "Succeeded" and conditions(world.job)["Succeeded"] == "True"
    assert world.job.status.completion_time is not None
    assert world.job.status.attempts[0].outcome == "Succeeded"
    assert world.creates == 3
    assert [e.reason for e in world.events] == ["Planned", "Running", "Succeeded"]


def test_a_repeated_step_creates_nothing_new():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.step()  # the operator restarted and looks again: same attempt, nothing new
    assert world.creates == 3 and world.job.status.current_attempt == 1


def test_gpu_oom_recovers_with_a_documented_change_and_the_same_global_batch():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    first_plan = world.job.status.plan
    world.set_condition("Running")
    world.step()
    world.oom()
    decision = world.step()
    status = world.job.status
    assert status.phase == "Recovering" and status.current_attempt == 2
    assert conditions(world.job)["Recovering"] == "True"
    recovering = next(c for c in status.conditions if c.type == "Recovering")
    assert "GPU OOM in backward at step 0" in recovering.message
    assert status.attempts[0].outcome == "GPUOutOfMemory"
    assert {r.kind for r in decision.delete} == {"PyTorchJob", "ConfigMap", "NetworkPolicy"}
    new_plan = status.plan
    assert (new_plan.node_pool, new_plan.micro_batch_size, new_plan.gradient_checkpointing, new_plan.strategy) != (
        first_plan.node_pool, first_plan.micro_batch_size, first_plan.gradient_checkpointing, first_plan.strategy)
    assert new_plan.calibration > 1.0
    assert new_plan.micro_batch_size * new_plan.gradient_accumulation * new_plan.gpus == 64
    assert new_plan.region in ("eu-de-berlin",)
    # Nothing is created before the backoff has passed.
    assert world.step().create == []
    world.wait_backoff()
    relaunch = world.step()
    assert [o["kind"] for o in relaunch.create] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]
    assert relaunch.create[-1]["metadata"]["name"] == "support-bot-a2"
    world.set_condition("Succeeded")
    world.step()
    assert world.job.status.phase == "Succeeded"
    assert [a.outcome for a in world.job.status.attempts] == ["GPUOutOfMemory", "Succeeded"]


def test_repeated_ooms_stop_at_max_attempts_and_never_repeat_a_plan():
    world = World(example("llama-8b-lora.yaml", recovery={"maxAttempts": 2, "backoff": {"initialSeconds": 0}}))
    world.step()
    for _ in range(2):
        world.wait_backoff()
        world.step()
        world.oom()
        world.step()
    status = world.job.status
    assert status.phase == "Failed"
    assert len(status.attempts) == 2
    assert conditions(world.job)["Failed"] == "True"
    failed = next(c for c in status.conditions if c.type == "Failed")
    assert "all 2 attempts are used" in failed.message
    keys = [(a.plan.node_pool, a.plan.gpus, a.plan.strategy, a.plan.micro_batch_size, a.plan.gradient_checkpointing,
             a.plan.optimizer, a.plan.offload) for a in status.attempts]
    assert len(set(keys)) == len(keys), keys
    assert all(a.plan.region in ("eu-de-berlin",) for a in status.attempts)


def test_an_always_failing_world_ends_failed_with_the_full_history():
    world = World(example("llama-8b-lora.yaml", recovery={"maxAttempts": 6, "backoff": {"initialSeconds": 0}}))
    world.step()
    for _ in range(6):
        if world.job.status.phase == "Failed":
            break
        world.wait_backoff()
        world.step()
        world.oom()
        world.step()
    status = world.job.status
    assert status.phase == "Failed"
    assert all(a.outcome == "GPUOutOfMemory" for a in status.attempts)
    assert "nothing fits with the estimate calibrated" in status.attempts[-1].message
    calibrations = [a.plan.calibration for a in status.attempts]
    assert calibrations == sorted(calibrations) and calibrations[-1] > 1


def test_data_error_is_not_retried():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    report = contract.FailureReport(reason="DataError", phase="data", step=0, exit_code=65, message="line 3: not JSON")
    world.pods = [world.pod({"phase": "Failed", "containerStatuses": [
        {"name": "pytorch", "state": {"terminated": {"exitCode": 65, "message": report.to_termination_message()}}}]})]
    world.set_condition("Failed")
    world.step()
    assert world.job.status.phase == "Failed" and world.job.status.attempts[0].outcome == "DataError"
    assert "retry cannot fix" in next(c for c in world.job.status.conditions if c.type == "Failed").message


def test_nothing_fits_stays_pending_and_names_the_nearest_miss():
    # fp32 master weights: with bf16 weights the 8B would fit one H100.
    world = World(example("llama-8b-full.yaml", resources={"maxGPUs": 1, "offload": "none", "gpuTypes": ["H100-80GB"]},
                          training__masterWeights="fp32"))
    decision = world.step()
    assert world.job.status.phase == "Pending" and decision.create == []
    planned = next(c for c in world.job.status.conditions if c.type == "Planned")
    assert planned.status == "False" and planned.reason == "NoFit"
    assert "maxGPUs" in planned.message
    assert decision.requeue_after == lifecycle.REPLAN_AFTER_SECONDS


def test_region_outside_policy_never_plans():
    world = World(example("llama-8b-lora.yaml", placement={"regions": ["us-east-virginia"]}))
    world.step()
    assert world.job.status.phase == "Pending" and world.creates == 0


def test_suspend_and_resume():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": True})})
    decision = world.step()
    assert decision.set_suspend is True and world.job.status.phase == "Suspended"
    assert world.current()["spec"]["runPolicy"]["suspend"] is True
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": False})})
    decision = world.step()
    assert decision.set_suspend is False and world.job.status.phase == "Launching"
    assert conditions(world.job)["Suspended"] == "False"


def test_invalid_job_fails_with_the_field_named():
    status = api.FineTuneJobStatus()
    decision = lifecycle.invalid(status, [api.FieldProblem(path="spec.model.architecture.configMapRef", message="no such ConfigMap")], T0, 1)
    assert decision.status.phase == "Failed" and decision.status.observed_generation == 1
    validated = next(c for c in decision.status.conditions if c.type == "Validated")
    assert validated.status == "False" and validated.reason == "Invalid"
    assert "spec.model.architecture.configMapRef" in validated.message


def test_condition_transition_time_moves_only_on_change():
    status = api.FineTuneJobStatus()
    lifecycle.set_condition(status, "Running", "True", "Running", "a", T0, 1)
    lifecycle.set_condition(status, "Running", "True", "Running", "b", T0 + timedelta(minutes=5), 1)
    assert status.conditions[0].last_transition_time == T0 and status.conditions[0].message == "b"
    lifecycle.set_condition(status, "Running", "False", "Failed", "c", T0 + timedelta(minutes=9), 1)
    assert status.conditions[0].last_transition_time == T0 + timedelta(minutes=9)


def test_a_source_the_pods_cannot_read_is_invalid_before_planning():
    # Object storage the cluster policy does not list (POLICY has no objectStorage).
    job = example("llama-8b-lora.yaml", model={
        "name": "m", "architecture": {"preset": "llama-3.1-8b"},
        "source": {"s3": {"endpoint": "https://s3.elsewhere.example", "bucket": "models", "key": "llama/",
                          "credentialsSecretRef": {"name": "s3"}}}})
    world = World(job)
    decision = world.step()
    assert world.job.status.phase == "Failed" and decision.create == []
    validated = next(c for c in world.job.status.conditions if c.type == "Validated")
    assert validated.reason == "Invalid" and "spec.model.source.s3.endpoint" in validated.message


def test_a_long_job_name_still_finds_its_pods():
    from finetune_operator.rendering.names import label_value

    name = "a-very-long-fine-tune-job-name-" + "x" * 60
    doc_job = example("llama-8b-lora.yaml")
    job = doc_job.model_copy(update={"metadata": doc_job.metadata.model_copy(update={"name": name})})
    world = World(job)
    decision = world.step()
    pj = decision.create[-1]
    template = pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert template["metadata"]["labels"]["finetune.dev/job"] == label_value(name) != name
    assert template["metadata"]["annotations"]["finetune.dev/job-name"] == name


def test_an_unknown_preset_is_invalid_not_unplannable():
    world = World(example("llama-8b-lora.yaml", model={
        "name": "m", "architecture": {"preset": "llama-9000"}, "source": {"pvc": {"claimName": "models"}}}))
    world.step()
    assert world.job.status.phase == "Failed"
    validated = next(c for c in world.job.status.conditions if c.type == "Validated")
    assert "spec.model.architecture.preset" in validated.message and "llama-3.1-8b" in validated.message


def test_a_configmap_architecture_is_sized_from_its_config_json():
    job = example("llama-8b-lora.yaml", model={
        "name": "m", "architecture": {"configMapRef": {"name": "cfg"}}, "source": {"pvc": {"claimName": "models"}}})
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "tie_word_embeddings": True, "rope_theta": 500000.0}
    decision = lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=POLICY, pools=POOLS, model_config=config))
    assert decision.status.phase == "Launching"
    assert 2.0 < decision.status.plan.breakdown["weights"] < 3.0  # a 1.2B model, not 8B
    broken = dict(config, num_attention_heads=3)
    decision = lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=POLICY, pools=POOLS, model_config=broken))
    assert decision.status.phase == "Failed"
    assert "spec.model.architecture.configMapRef" in decision.status.conditions[0].message


# ---------------------------------------------------------------------------
# the children are the truth: a status that lost track is rebuilt, never restarted
# ---------------------------------------------------------------------------


def _running_on_attempt_2() -> World:
    world = World(example("llama-8b-lora.yaml", recovery={"backoff": {"initialSeconds": 0}}))
    world.step()
    world.set_condition("Running")
    world.step()
    world.oom()
    world.step()
    world.wait_backoff()
    world.step()
    world.set_condition("Running")
    world.step()
    assert world.job.status.current_attempt == 2 and world.job.status.phase == "Running"
    return world


def test_a_status_that_lost_its_current_attempt_is_rebuilt_from_the_running_child():
    world = _running_on_attempt_2()
    history = world.job.status.attempts
    world.job = world.job.model_copy(update={"status": world.job.status.model_copy(update={"current_attempt": None})})
    decision = world.step()  # a DuplicateCreate here would be a second run beside attempt 2
    assert decision.create == [] and world.job.status.current_attempt == 2
    assert world.job.status.attempts == history
    assert "StatusRebuilt" in [e.reason for e in decision.events]


def test_a_wiped_status_is_rebuilt_from_the_child_and_its_plan_annotation():
    world = _running_on_attempt_2()
    plan = world.job.status.plan
    world.job = world.job.model_copy(update={"status": api.FineTuneJobStatus()})
    decision = world.step()
    status = world.job.status
    assert decision.create == [] and status.current_attempt == 2 and status.phase == "Running"
    assert status.plan == plan
    assert [a.attempt for a in status.attempts] == [2]


def test_a_leftover_child_of_another_attempt_is_deleted():
    world = _running_on_attempt_2()
    leftover = copy.deepcopy(world.current())
    leftover["metadata"]["name"] = "support-bot-a1"
    leftover["metadata"]["labels"]["finetune.dev/attempt"] = "1"
    world.objects["PyTorchJob/support-bot-a1"] = leftover
    decision = world.step()
    assert lifecycle.ObjectRef("kubeflow.org/v1", "PyTorchJob", "support-bot-a1") in decision.delete
    assert lifecycle.ObjectRef("kubeflow.org/v1", "PyTorchJob", "support-bot-a2") not in decision.delete


def test_without_children_the_history_goes_on_after_its_newest_attempt():
    world = _running_on_attempt_2()
    world.objects.clear()
    world.pods = []
    world.job = world.job.model_copy(update={"status": world.job.status.model_copy(update={"current_attempt": None})})
    decision = world.step()
    assert [o["metadata"]["name"] for o in decision.create] == ["support-bot-a2"] * 3


def test_a_current_attempt_without_a_record_is_not_trusted():
    world = _running_on_attempt_2()
    world.job = world.job.model_copy(update={"status": world.job.status.model_copy(update={"current_attempt": 7})})
    decision = world.step()
    assert decision.create == [] and world.job.status.current_attempt == 2


# ---------------------------------------------------------------------------
# queues, foreign objects, bounded waits
# ---------------------------------------------------------------------------


def test_a_child_suspended_by_a_queue_is_never_resumed_by_us():
    world = World(example("llama-8b-lora.yaml", queueName="gpu-queue"))
    created = world.step().create
    assert created[-1]["spec"]["runPolicy"]["suspend"] is True  # created suspended: the queue admits it
    for _ in range(3):
        decision = world.step()
        assert decision.set_suspend is None
    assert world.job.status.phase == "Queued" and conditions(world.job)["Queued"] == "True"
    assert [e.reason for e in world.events].count("Queued") == 1
    world.current()["spec"]["runPolicy"]["suspend"] = False  # Kueue admits
    world.set_condition("Running")
    world.step()
    assert world.job.status.phase == "Running" and conditions(world.job)["Queued"] == "False"


def test_a_suspended_child_without_our_mark_is_queued_even_without_a_queue_name():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.current()["spec"]["runPolicy"]["suspend"] = True  # e.g. Kueue's manageJobsWithoutQueueName
    decision = world.step()
    assert decision.set_suspend is None and world.job.status.phase == "Queued"


def test_suspending_a_queued_job_deletes_its_child_and_resume_queues_it_again():
    world = World(example("llama-8b-lora.yaml", queueName="gpu-queue"))
    world.step()
    world.current()["spec"]["runPolicy"]["suspend"] = False
    world.set_condition("Running")
    world.step()
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": True})})
    decision = world.step()
    assert decision.set_suspend is None and world.job.status.phase == "Suspended"
    assert {r.kind for r in decision.delete} == {"PyTorchJob", "ConfigMap", "NetworkPolicy"} and world.objects == {}
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": False})})
    decision = world.step()
    assert decision.create[-1]["metadata"]["name"] == "support-bot-a1"
    assert decision.create[-1]["spec"]["runPolicy"]["suspend"] is True


def test_a_foreign_object_with_the_attempts_name_blocks_without_create_or_delete():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.objects.clear()  # the first create "failed"; someone else's object holds the name
    foreign = (lifecycle.ObjectRef("v1", "ConfigMap", "support-bot-a1"),)
    decision = lifecycle.step(lifecycle.Observed(job=world.job, now=world.now, policy=POLICY, pools=POOLS,
                                                 foreign=foreign))
    assert decision.create == [] and decision.delete == []
    blocked = next(c for c in decision.status.conditions if c.type == "Blocked")
    assert blocked.status == "True" and blocked.reason == "NameConflict" and "support-bot-a1" in blocked.message


def _pending_pod(world: World, since: datetime) -> dict[str, Any]:
    return world.pod({"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
        "lastTransitionTime": since.isoformat().replace("+00:00", "Z")}]})


def test_unschedulable_pods_are_reported_then_the_attempt_moves_to_another_pool():
    world = World(example("llama-8b-lora.yaml", placement={"regions": ["eu-de-berlin", "eu-fr-paris"]}))
    world.step()
    first_pool = world.job.status.plan.node_pool
    world.pods = [_pending_pod(world, world.now)]
    world.now += timedelta(seconds=60)
    world.step()
    running = next(c for c in world.job.status.conditions if c.type == "Running")
    assert running.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in running.message
    world.now += timedelta(seconds=POLICY.unschedulable_timeout_seconds)
    decision = world.step()
    status = world.job.status
    assert status.current_attempt == 2 and status.plan.node_pool != first_pool
    assert status.attempts[0].outcome == "Unschedulable"
    assert decision.create[-1]["metadata"]["name"] == "support-bot-a2"
    assert lifecycle.ObjectRef("kubeflow.org/v1", "PyTorchJob", "support-bot-a1") in decision.delete


def test_a_pool_full_of_other_work_is_a_queue_the_attempt_moves_only_to_a_pool_with_room():
    """Past the bound, pods that wait because every GPU is in use wait on (no give-up, no move to a pool
    that must wait too); as soon as a pool in the allowed regions has room, the attempt moves there."""
    world = World(example("llama-8b-lora.yaml", placement={"regions": ["eu-de-berlin", "eu-fr-paris"]}))
    world.pools = [p.model_copy(update={"free_gpus": 0, "free_gpus_per_node": []}) for p in POOLS]
    world.step()
    first_pool = world.job.status.plan.node_pool
    world.pods = [_pending_pod(world, world.now)]
    world.now += timedelta(seconds=POLICY.unschedulable_timeout_seconds * 2)
    replans = []
    real_replan = starting.replan_after_loss
    starting.replan_after_loss = lambda *a, **k: replans.append(1) or real_replan(*a, **k)
    try:
        decision = world.step()
    finally:
        starting.replan_after_loss = real_replan
    assert replans == []  # no pool has room: nothing to plan (a busy cluster has many such waits)
    assert decision.delete == [] and decision.create == [] and world.job.status.current_attempt == 1
    assert world.job.status.phase not in ("Failed",)
    running = next(c for c in world.job.status.conditions if c.type == "Running")
    assert running.reason == "Unschedulable" and "busy with other jobs" in running.message
    # A later look changes nothing: no status write for every waiting job on every resync.
    before = world.job.status.model_dump()
    world.now += timedelta(seconds=30)
    world.step()
    assert world.job.status.model_dump() == before
    roomy = next(p for p in POOLS if p.name != first_pool and p.region in ("eu-de-berlin", "eu-fr-paris")
                 and p.gpu_type in ("H100-80GB", "A100-80GB"))
    world.pools = [p.model_copy(update={"free_gpus": p.max_gpus, "free_gpus_per_node": [p.gpus_per_node] * p.max_nodes})
                   if p.name == roomy.name else p for p in world.pools]
    world.now += timedelta(seconds=30)
    decision = world.step()
    status = world.job.status
    assert status.current_attempt == 2 and status.plan.node_pool == roomy.name
    assert status.attempts[0].outcome == "Unschedulable"
    assert any(e.reason == "Unschedulable" and f"moving to {roomy.name}" in e.message for e in decision.events)


def test_a_queued_job_is_never_moved_for_unschedulable_pods():
    world = World(example("llama-8b-lora.yaml", queueName="q"))
    world.step()
    world.current()["spec"]["runPolicy"]["suspend"] = False
    world.pods = [_pending_pod(world, world.now)]
    world.now += timedelta(seconds=POLICY.unschedulable_timeout_seconds * 3)
    decision = world.step()
    assert decision.create == [] and world.job.status.current_attempt == 1


def test_pods_that_cannot_start_fail_the_job_after_the_bound_quoting_the_reason():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.pods = [world.pod({"phase": "Pending", "containerStatuses": [{"name": "pytorch", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "Back-off pulling image \"trainer:nope\""}}}]})]
    world.step()
    assert world.job.status.phase == "Launching"
    world.now += timedelta(seconds=POLICY.start_timeout_seconds + 1)
    world.step()
    failed = next(c for c in world.job.status.conditions if c.type == "Failed")
    assert world.job.status.phase == "Failed" and failed.reason == "ConfigError" and "ImagePullBackOff" in failed.message


def test_failed_pod_evidence_is_kept_in_status_when_the_pod_is_gone():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.set_condition("Running")
    world.oom()
    world.current()["status"]["conditions"] = [{"type": "Running", "status": "True"}]  # the job has not noticed yet
    world.step()
    assert world.job.status.attempts[0].failed_pods[0].kind == "GPUOutOfMemory"
    world.pods = []  # deleted (cleanup, eviction) before the attempt is judged
    world.set_condition("Failed")
    world.step()
    assert world.job.status.attempts[0].outcome == "GPUOutOfMemory" and world.job.status.current_attempt == 2


def test_a_refused_create_blocks_then_fails_after_the_bound():
    job = example("llama-8b-lora.yaml")
    world = World(job)
    world.step()
    status = world.job.status
    decision = lifecycle.create_refused(world.job, status, POLICY, world.now, "PyTorchJob", "support-bot-a1",
                                        'admission webhook "quota" denied: exceeded quota token=abc123secret')
    blocked = next(c for c in decision.status.conditions if c.type == "Blocked")
    assert blocked.reason == "CreateRejected" and "exceeded quota" in blocked.message
    assert "abc123secret" not in blocked.message
    assert decision.status.phase != "Failed"
    later = world.now + timedelta(seconds=POLICY.create_retry_seconds + 1)
    decision = lifecycle.create_refused(world.job, decision.status, POLICY, later, "PyTorchJob", "support-bot-a1", "exceeded quota")
    assert decision.status.phase == "Failed"
    assert next(c for c in decision.status.conditions if c.type == "Failed").reason == "CreateRejected"


def test_an_attempt_whose_pods_vanished_without_a_trace_runs_again():
    world = World(example("llama-8b-lora.yaml", recovery={"backoff": {"initialSeconds": 0}}))
    world.step()
    world.set_condition("Running")
    world.step()
    world.pods = []  # deleted (a drain, a person) while the operator was restarting: no evidence
    world.set_condition("Failed")
    world.step()
    status = world.job.status
    assert status.phase == "Recovering" and status.attempts[0].outcome == "Evicted"
    assert status.plan.node_pool == status.attempts[0].plan.node_pool  # the same plan: it was not at fault


def test_a_pod_deleted_while_running_is_an_eviction():
    world = World(example("llama-8b-lora.yaml", recovery={"backoff": {"initialSeconds": 0}}))
    world.step()
    world.set_condition("Running")
    deleted = world.pod({"phase": "Running"})
    deleted["metadata"]["deletionTimestamp"] = "2026-11-30T10:00:05Z"
    world.pods = [deleted]
    world.step()
    assert world.job.status.attempts[0].failed_pods[0].kind == "Evicted"
    world.set_condition("Failed")
    world.step()
    assert world.job.status.phase == "Recovering" and world.job.status.attempts[0].outcome == "Evicted"


def test_a_failed_attempt_whose_only_pod_shows_no_failure_runs_again():
    """The failed pod was evicted and deleted while the operator restarted; the training operator
    already made a new pod in its place, which shows nothing: an eviction, not Unknown."""
    world = World(example("llama-8b-lora.yaml", recovery={"backoff": {"initialSeconds": 0}}))
    world.step()
    world.pods = [world.pod({"phase": "Pending"})]
    world.current().setdefault("status", {})["conditions"] = [
        {"type": "Failed", "status": "True", "message": "PyTorchJob x is failed because 1 Master replica(s) failed."}]
    world.step()
    assert world.job.status.phase == "Recovering" and world.job.status.attempts[0].outcome == "Evicted"
    assert "1 Master replica(s) failed" in world.job.status.attempts[0].message


def test_an_attempt_running_far_past_its_predicted_time_is_restarted_as_hung():
    world = World(example("llama-8b-lora.yaml", recovery={"backoff": {"initialSeconds": 0}}))
    world.step()
    world.set_condition("Running")
    world.step()
    predicted = world.job.status.plan.estimated_hours * 3600
    bound = max(POLICY.hung_min_seconds, POLICY.hung_after_factor * predicted)
    world.now += timedelta(seconds=bound - 60)
    world.step()
    assert world.job.status.phase == "Running"
    world.now += timedelta(seconds=120)
    world.step()
    status = world.job.status
    assert status.phase == "Recovering" and status.attempts[0].outcome == "Hung"
    assert "taken as hung" in status.attempts[0].message
    assert status.plan.node_pool == status.attempts[0].plan.node_pool and status.current_attempt == 2
