"""The lifecycle state machine, driven through whole job histories without a cluster."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from finetune_operator import api, lifecycle
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


class World:
    """A tiny stand-in for the cluster: the job's status and the objects the operator created."""

    def __init__(self, job: api.FineTuneJob) -> None:
        self.job = job
        self.objects: dict[str, dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.now = T0
        self.events: list[lifecycle.Event] = []
        self.creates = 0

    def step(self) -> lifecycle.Decision:
        attempt = self.job.status.current_attempt if self.job.status else None
        pj = self.objects.get(f"PyTorchJob/{self.job.metadata.name}-a{attempt}") if attempt else None
        decision = lifecycle.step(lifecycle.Observed(
            job=self.job, now=self.now, policy=POLICY, pools=POOLS, pytorch_job=pj, pods=list(self.pods)))
        for ref in decision.delete:
            self.objects.pop(f"{ref.kind}/{ref.name}", None)
            self.pods = []
        for obj in decision.create:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            if key not in self.objects:
                self.creates += 1
                self.objects[key] = copy.deepcopy(obj)
        if decision.set_suspend is not None:
            pj = self.objects[f"PyTorchJob/{self.job.metadata.name}-a{decision.status.current_attempt}"]
            pj["spec"]["runPolicy"]["suspend"] = decision.set_suspend
        self.events += decision.events
        self.job = self.job.model_copy(update={"status": decision.status})
        return decision

    def current(self) -> dict[str, Any]:
        return self.objects[f"PyTorchJob/{self.job.metadata.name}-a{self.job.status.current_attempt}"]

    def set_condition(self, state: str) -> None:
        self.current().setdefault("status", {})["conditions"] = [{"type": state, "status": "True"}]

    def oom(self, peak_fraction: float = 0.99) -> None:
        plan = self.job.status.plan
        capacity = int(plan.gpu_memory_gi_b * GiB)
        report = contract.FailureReport(
            reason="GPUOutOfMemory", phase="backward", step=0, exit_code=75,
            peak_allocated_bytes=int(capacity * peak_fraction), device_total_bytes=capacity,
            micro_batch_size=plan.micro_batch_size)
        self.pods = [{"metadata": {"name": "p"}, "status": {"phase": "Failed", "containerStatuses": [
            {"name": "pytorch", "state": {"terminated": {"exitCode": 75, "message": report.to_termination_message()}}}]}}]
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
    assert [o["kind"] for o in first.create] == ["ConfigMap", "PyTorchJob"]
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
    assert world.creates == 2
    assert [e.reason for e in world.events] == ["Planned", "Running", "Succeeded"]


def test_a_repeated_step_creates_nothing_new():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    world.step()  # the operator restarted and looks again: same attempt, nothing new
    assert world.creates == 2 and world.job.status.current_attempt == 1


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
    assert {r.kind for r in decision.delete} == {"PyTorchJob", "ConfigMap"}
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
    assert [o["kind"] for o in relaunch.create] == ["ConfigMap", "PyTorchJob"]
    assert relaunch.create[1]["metadata"]["name"] == "support-bot-a2"
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
    world.pods = [{"metadata": {"name": "p"}, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "pytorch", "state": {"terminated": {"exitCode": 65, "message": report.to_termination_message()}}}]}}]
    world.set_condition("Failed")
    world.step()
    assert world.job.status.phase == "Failed" and world.job.status.attempts[0].outcome == "DataError"
    assert "retry cannot fix" in next(c for c in world.job.status.conditions if c.type == "Failed").message


def test_nothing_fits_stays_pending_and_names_the_nearest_miss():
    world = World(example("llama-8b-full.yaml", resources={"maxGPUs": 1, "offload": "none", "gpuTypes": ["H100-80GB"]}))
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
    assert decision.status.phase == "Failed"
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
    job = example("llama-8b-lora.yaml", model={
        "name": "m", "architecture": {"preset": "llama-3.1-8b"}, "source": {"uri": "s3://bucket/llama"}})
    world = World(job)
    decision = world.step()
    assert world.job.status.phase == "Failed" and decision.create == []
    validated = next(c for c in world.job.status.conditions if c.type == "Validated")
    assert validated.reason == "Invalid" and "spec.model.source.uri" in validated.message


def test_a_long_job_name_still_finds_its_pods():
    from finetune_operator.rendering.names import label_value

    name = "a-very-long-fine-tune-job-name-" + "x" * 60
    doc_job = example("llama-8b-lora.yaml")
    job = doc_job.model_copy(update={"metadata": doc_job.metadata.model_copy(update={"name": name})})
    world = World(job)
    decision = world.step()
    pj = decision.create[1]
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
