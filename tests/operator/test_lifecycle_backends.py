"""The lifecycle is the same on both backends (PyTorchJob and TrainJob): a strict world that plays the
training operator for either kind, read back through the backend seam (children.child_of), and Kueue
holding queued children, read from its Workload (children.admission_of)."""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator import api, lifecycle
from finetune_operator.children import SUSPENDED_BY_ANNOTATION, SUSPENDED_BY_US, Admission, admission_of, child_of
from finetune_operator.planning.policy import load_policy
from finetune_operator.planning.pools import GiB
from finetune_operator.rendering.backend import PYTORCH_JOB, TRAIN_JOB, backend_of_kind
from finetune_trainer import contract

from test_lifecycle import POOLS, T0, DuplicateCreate, example

BOTH = (PYTORCH_JOB, TRAIN_JOB)


def policy(backend: str = "auto", **more: Any):
    return load_policy({"allowedRegions": ["eu-de-berlin", "eu-fr-paris"], "trainingBackend": backend, **more})


class World:
    """The job's status and the objects the operator created, of whichever kind; children read back
    through the backend of their kind. Strict: a create of an existing name is an error."""

    def __init__(self, job: api.FineTuneJob, served=BOTH, backend: str = "auto", **policy_fields: Any) -> None:
        self.job = job
        self.served = tuple(served)
        self.policy = policy(backend, **policy_fields)
        self.objects: dict[str, dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.now = T0
        self.events: list[lifecycle.Event] = []
        self.admission: Admission | None = None
        self.default_queue: str | None = None
        self.unsuspended_by_us: list[str] = []

    def children(self):
        found = []
        for key, obj in self.objects.items():
            backend = backend_of_kind(key.split("/")[0])
            if backend is not None:
                child = child_of(obj, backend)
                if child is not None and child.queue and self.admission is not None:
                    child = dataclasses.replace(child, admission=self.admission)
                found.append(child)
        return [c for c in found if c is not None]

    def step(self) -> lifecycle.Decision:
        decision = lifecycle.step(lifecycle.Observed(
            job=self.job, now=self.now, policy=self.policy, pools=POOLS, children=self.children(),
            pods=list(self.pods), backends=self.served, default_queue=self.default_queue))
        for ref in decision.delete:
            if self.objects.pop(f"{ref.kind}/{ref.name}", None) is not None and ref.kind != "ConfigMap":
                self.pods = []
        for obj in decision.create:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            if key in self.objects:
                raise DuplicateCreate(key)
            self.objects[key] = copy.deepcopy(obj)
        if decision.set_suspend is not None:
            obj = self.current()
            backend = backend_of_kind(obj["kind"])
            if not decision.set_suspend:
                self.unsuspended_by_us.append(obj["metadata"]["name"])
            _merge(obj, backend.suspend_patch(decision.set_suspend))
            annotations = obj["metadata"].setdefault("annotations", {})
            if decision.set_suspend:
                annotations[SUSPENDED_BY_ANNOTATION] = SUSPENDED_BY_US
            else:
                annotations.pop(SUSPENDED_BY_ANNOTATION, None)
        self.events += decision.events
        self.job = self.job.model_copy(update={"status": decision.status})
        return decision

    def current(self) -> dict[str, Any]:
        name = f"{self.job.metadata.name}-a{self.job.status.current_attempt}"
        (obj,) = [o for k, o in self.objects.items() if k.endswith(f"/{name}") and not k.startswith(("ConfigMap/", "NetworkPolicy/"))]
        return obj

    # -- the training operator (v1) or Trainer v2 + JobSet ------------------------
    def run(self) -> None:
        obj = self.current()
        if obj["kind"] == "TrainJob":
            obj.setdefault("status", {})["jobsStatus"] = [{"name": "node", "ready": 1, "active": 1}]
        else:
            obj.setdefault("status", {})["conditions"] = [{"type": "Running", "status": "True"}]

    def finish(self, ok: bool) -> None:
        obj = self.current()
        if obj["kind"] == "TrainJob":
            state = "Complete" if ok else "Failed"
        else:
            state = "Succeeded" if ok else "Failed"
        obj.setdefault("status", {})["conditions"] = [{"type": state, "status": "True"}]

    def oom(self) -> None:
        plan = self.job.status.plan
        capacity = int(plan.gpu_memory_gi_b * GiB)
        report = contract.FailureReport(
            reason="GPUOutOfMemory", phase="backward", step=0, exit_code=75,
            peak_allocated_bytes=int(capacity * 0.99), device_total_bytes=capacity, micro_batch_size=plan.micro_batch_size)
        container = "node" if self.current()["kind"] == "TrainJob" else "pytorch"
        self.pods = [{"metadata": {"name": "p", "labels": {"finetune.dev/attempt": str(self.job.status.current_attempt)}},
                      "status": {"phase": "Failed", "containerStatuses": [
                          {"name": container, "state": {"terminated": {"exitCode": 75,
                                                                       "message": report.to_termination_message()}}}]}}]
        self.finish(ok=False)

    # -- Kueue ----------------------------------------------------------------
    def kueue_admit(self) -> None:
        _merge(self.current(), backend_of_kind(self.current()["kind"]).suspend_patch(False))

    def wait_backoff(self) -> None:
        if self.job.status.next_attempt_time is not None:
            self.now = self.job.status.next_attempt_time + timedelta(seconds=1)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def conditions(job: api.FineTuneJob) -> dict[str, api.Condition]:
    return {c.type: c for c in job.status.conditions}


@pytest.mark.parametrize("served, backend, kind", [
    ((PYTORCH_JOB,), "auto", "PyTorchJob"),
    ((TRAIN_JOB,), "auto", "TrainJob"),
    (BOTH, "auto", "TrainJob"),
    (BOTH, "pytorchjob", "PyTorchJob"),
    (BOTH, "trainjob", "TrainJob"),
])
def test_the_same_job_recovers_from_a_gpu_oom_and_succeeds_on_either_backend(served, backend, kind):
    world = World(example("llama-8b-lora.yaml", recovery={"maxAttempts": 4, "backoff": {"initialSeconds": 1}}),
                  served=served, backend=backend)
    first = world.step()
    assert [o["kind"] for o in first.create] == ["ConfigMap", "NetworkPolicy", kind]
    world.run()
    world.step()
    assert world.job.status.phase == "Running"
    world.oom()
    decision = world.step()
    assert world.job.status.phase == "Recovering" and world.job.status.attempts[0].outcome == "GPUOutOfMemory"
    assert {(r.kind, r.name) for r in decision.delete} == {(kind, "support-bot-a1"), ("ConfigMap", "support-bot-a1"),
                                                                     ("NetworkPolicy", "support-bot-a1")}
    assert "GPU OOM in backward at step 0" in conditions(world.job)["Recovering"].message
    world.wait_backoff()
    relaunch = world.step()
    assert [(o["kind"], o["metadata"]["name"]) for o in relaunch.create] == [("ConfigMap", "support-bot-a2"),
                                                                            ("NetworkPolicy", "support-bot-a2"),
                                                                            (kind, "support-bot-a2")]
    world.run()
    world.step()
    world.finish(ok=True)
    world.step()
    assert world.job.status.phase == "Succeeded"
    assert [a.outcome for a in world.job.status.attempts] == ["GPUOutOfMemory", "Succeeded"]
    assert world.job.status.attempts[1].plan.calibration > 1.0


@pytest.mark.parametrize("served", [(PYTORCH_JOB,), (TRAIN_JOB,)])
def test_suspend_and_resume_on_either_backend(served):
    world = World(example("llama-8b-lora.yaml"), served=served)
    world.step()
    world.run()
    world.step()
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": True})})
    decision = world.step()
    assert decision.set_suspend is True and world.job.status.phase == "Suspended"
    assert served[0].suspended(world.current())
    world.job = world.job.model_copy(update={"spec": world.job.spec.model_copy(update={"suspend": False})})
    decision = world.step()
    assert decision.set_suspend is False and not served[0].suspended(world.current())


def test_a_missing_backend_is_a_clear_condition_and_the_job_starts_once_it_is_served():
    world = World(example("llama-8b-lora.yaml"), served=(PYTORCH_JOB,), backend="trainjob")
    decision = world.step()
    assert decision.create == [] and world.job.status.phase == "Pending"
    planned = conditions(world.job)["Planned"]
    assert (planned.status, planned.reason) == ("False", "NoTrainingBackend")
    assert "trainjobs.trainer.kubeflow.org" in planned.message and "Kubeflow Trainer v2" in planned.message
    assert [e.reason for e in world.events] == ["NoTrainingBackend"]
    world.step()
    assert [e.reason for e in world.events] == ["NoTrainingBackend"]  # said once
    world.served = BOTH  # the CRD was installed
    assert [o["kind"] for o in world.step().create] == ["ConfigMap", "NetworkPolicy", "TrainJob"]


def test_no_backend_served_at_all_names_both():
    world = World(example("llama-8b-lora.yaml"), served=())
    world.step()
    message = conditions(world.job)["Planned"].message
    assert "trainjobs.trainer.kubeflow.org" in message and "pytorchjobs.kubeflow.org" in message


def test_a_job_that_fetches_from_the_hub_takes_the_pytorchjob_under_auto_and_is_refused_on_trainjob_only():
    hub = {"hf": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f249a16976918f6564b8830bc894c89659"}}
    world = World(example("llama-8b-lora.yaml", model__source=hub), served=BOTH)
    assert [o["kind"] for o in world.step().create] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]
    only = World(example("llama-8b-lora.yaml", model__source=hub), served=(TRAIN_JOB,))
    only.step()
    failed = conditions(only.job)["Validated"]
    assert only.job.status.phase == "Failed" and failed.reason == "Invalid"
    assert "spec.model.source" in failed.message and "TrainJob cannot carry" in failed.message


def test_children_of_the_old_kind_are_followed_after_the_policy_changes_and_the_next_attempt_takes_the_new():
    world = World(example("llama-8b-lora.yaml", recovery={"maxAttempts": 3, "backoff": {"initialSeconds": 1}}),
                  served=BOTH, backend="pytorchjob")
    world.step()
    world.run()
    world.policy = policy("trainjob")  # helm upgrade while attempt 1 runs
    world.step()
    assert world.job.status.phase == "Running" and world.current()["kind"] == "PyTorchJob"
    world.oom()
    decision = world.step()
    assert ("PyTorchJob", "support-bot-a1") in {(r.kind, r.name) for r in decision.delete}
    world.wait_backoff()
    assert [o["kind"] for o in world.step().create] == ["ConfigMap", "NetworkPolicy", "TrainJob"]


# ---------------------------------------------------------------------------
# Kueue
# ---------------------------------------------------------------------------

def workload(owner_uid: str, *conds: dict[str, Any], admission: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "trainjob-support-bot-a1-1a2b3",
                         "ownerReferences": [{"uid": owner_uid, "controller": True, "kind": "TrainJob"}]},
            "status": {"conditions": list(conds), **({"admission": admission} if admission else {})}}


def test_admission_is_read_from_the_workload_with_kueues_reason():
    pending = workload("u", {"type": "QuotaReserved", "status": "False", "reason": "Pending",
                             "message": "couldn't assign flavors to pod set node: insufficient unused quota for "
                                        "nvidia.com/gpu in flavor berlin, 8 more needed"})
    read = admission_of(pending)
    assert (read.admitted, read.reason) == (False, "Pending") and "8 more needed" in read.message
    admitted = workload("u", {"type": "QuotaReserved", "status": "True"}, {"type": "Admitted", "status": "True",
                                                                           "message": "The workload is admitted"},
                        admission={"clusterQueue": "gpus", "podSetAssignments": [
                            {"name": "node", "flavors": {"nvidia.com/gpu": "berlin", "cpu": "berlin"}}]})
    read = admission_of(admitted)
    assert read.admitted and read.cluster_queue == "gpus" and read.flavors == ("berlin",)
    evicted = workload("u", {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "preempted"})
    assert admission_of(evicted).reason == "Preempted" and not admission_of(evicted).admitted
    assert admission_of(None, queue_missing=True).reason == "LocalQueueNotFound"
    assert admission_of(None).reason == "NoWorkload"


@pytest.mark.parametrize("served", [(PYTORCH_JOB,), (TRAIN_JOB,)])
def test_a_queued_job_waits_with_kueues_reason_is_never_unsuspended_by_us_and_an_oom_queues_again(served):
    world = World(example("llama-8b-lora.yaml", queueName="gpus", recovery={"maxAttempts": 3, "backoff": {"initialSeconds": 1}}),
                  served=served)
    created = world.step().create
    assert created[-1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
    assert served[0].suspended(created[-1])
    world.admission = admission_of(workload("u", {"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                                  "message": "insufficient unused quota for nvidia.com/gpu in flavor "
                                                             "berlin, 8 more needed"}))
    for _ in range(3):
        decision = world.step()
        assert decision.set_suspend is None
    queued = conditions(world.job)["Queued"]
    assert world.job.status.phase == "Queued" and queued.status == "True" and queued.reason == "WaitingForAdmission"
    assert "Kueue (Pending)" in queued.message and "8 more needed" in queued.message
    world.admission = admission_of(workload("u", {"type": "Admitted", "status": "True"}, admission={
        "clusterQueue": "gpus", "podSetAssignments": [{"name": "node", "flavors": {"nvidia.com/gpu": "berlin"}}]}))
    world.kueue_admit()
    world.run()
    world.step()
    queued = conditions(world.job)["Queued"]
    assert (queued.status, queued.reason) == ("False", "Admitted")
    assert "ClusterQueue gpus" in queued.message and "flavor berlin" in queued.message
    world.oom()
    world.step()
    world.wait_backoff()
    world.admission = None
    again = world.step().create
    assert again[-1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus" and served[0].suspended(again[-1])
    world.step()
    assert world.job.status.phase == "Queued" and conditions(world.job)["Queued"].status == "True"
    assert world.unsuspended_by_us == []


def test_a_missing_local_queue_is_a_clear_condition():
    world = World(example("llama-8b-lora.yaml", queueName="nowhere"), served=(TRAIN_JOB,))
    world.step()
    world.admission = admission_of(None, queue_missing=True)
    decision = world.step()
    queued = conditions(world.job)["Queued"]
    assert (queued.status, queued.reason) == ("True", "LocalQueueNotFound")
    assert "LocalQueue team-a/nowhere does not exist" in queued.message
    assert any(e.type == "Warning" and "does not exist" in e.message for e in decision.events)
    assert decision.set_suspend is None


def test_the_policys_default_queue_labels_the_child_when_the_namespace_has_it():
    world = World(example("llama-8b-lora.yaml"), served=(TRAIN_JOB,), defaultQueueName="gpus")
    world.default_queue = "gpus"  # the shell found LocalQueue team-a/gpus
    created = world.step().create
    assert created[-1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus" and created[-1]["spec"]["suspend"]
    plain = World(example("llama-8b-lora.yaml"), served=(TRAIN_JOB,), defaultQueueName="gpus")
    created = plain.step().create  # no such LocalQueue in the namespace: runs unqueued
    assert "kueue.x-k8s.io/queue-name" not in created[-1]["metadata"]["labels"] and not created[-1]["spec"]["suspend"]


@settings(max_examples=60, deadline=None)
@given(served=st.sets(st.sampled_from(["pytorchjob", "trainjob"])), wanted=st.sampled_from(["auto", "pytorchjob", "trainjob"]),
       hub=st.booleans())
def test_backend_selection_rule(served, wanted, hub):
    """Property: the kind created is served; the policy's explicit choice is never overridden; auto prefers
    TrainJob unless the job needs an init container and the PyTorchJob is served; otherwise nothing is created
    and a condition (or, for a job only a TrainJob could run, Invalid) says why."""
    source = {"model__source": {"hf": {"repo": "meta-llama/Llama-3.1-8B-Instruct",
                                       "revision": "0e9e39f249a16976918f6564b8830bc894c89659"}}} if hub else {}
    backends = tuple(b for b in BOTH if b.name in served)
    world = World(example("llama-8b-lora.yaml", **source), served=backends, backend=wanted)
    created = [o["kind"] for o in world.step().create if o["kind"] not in ("ConfigMap", "NetworkPolicy")]
    kinds = {b.name: b.kind for b in BOTH}
    if wanted != "auto":
        expected = kinds[wanted] if wanted in served and not (hub and wanted == "trainjob") else None
    elif hub:
        expected = "PyTorchJob" if "pytorchjob" in served else None
    else:
        expected = "TrainJob" if "trainjob" in served else "PyTorchJob" if served else None
    assert created == ([expected] if expected else [])
    if expected is None:
        reason = conditions(world.job)["Planned"].reason if "Planned" in conditions(world.job) else None
        invalid = conditions(world.job)["Validated"].reason == "Invalid"
        assert reason == "NoTrainingBackend" or invalid
