"""The real shell (Cluster, Reconciler) on the strict fake API with TrainJob served: API discovery picks
the backend, the ClusterTrainingRuntime must exist, and Kueue's Workload and LocalQueue are read (never
written) for a queued child."""

from __future__ import annotations

from reconcile_world import NAMESPACE, ReconcileWorld, job_document

V2 = {"finetunejobs", "trainjobs", "clustertrainingruntimes", "workloads", "localqueues"}


def world(served=V2, runtime=True, **spec) -> ReconcileWorld:
    w = ReconcileWorld(job_document(**spec))
    w.kube.served = set(served)
    if runtime:
        w.kube.put("ClusterTrainingRuntime", {"metadata": {"name": "finetune-torch", "namespace": ""}})
    return w


def _condition(w: ReconcileWorld, type_: str) -> dict:
    return w.conditions()[type_]


def test_a_cluster_with_only_trainjob_gets_a_trainjob():
    w = world()
    w.reconcile()
    assert [o["metadata"]["name"] for o in w.ours("TrainJob")] == ["support-bot-a1"]
    assert w.ours("PyTorchJob") == [] and w.status["phase"] == "Launching"


def test_a_missing_runtime_is_a_clear_condition_and_nothing_is_created():
    w = world(runtime=False)
    w.reconcile()
    assert w.ours("TrainJob") == []
    planned = _condition(w, "Planned")
    assert planned["reason"] == "NoTrainingBackend" and "ClusterTrainingRuntime finetune-torch" in planned["message"]


def test_a_queued_trainjob_reports_kueues_reason_and_is_never_written_by_us():
    w = world(queueName="gpus")
    w.kube.put("LocalQueue", {"metadata": {"name": "gpus", "namespace": NAMESPACE}})
    w.reconcile()
    (child,) = w.ours("TrainJob")
    assert child["spec"]["suspend"] is True and child["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus"
    w.kube.put("Workload", {"metadata": {"name": "trainjob-support-bot-a1-x", "namespace": NAMESPACE, "ownerReferences": [
        {"kind": "TrainJob", "name": "support-bot-a1", "uid": child["metadata"]["uid"], "controller": True}]},
        "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                   "message": "insufficient unused quota for nvidia.com/gpu in flavor berlin, 8 more needed"}]}})
    w.reconcile()
    queued = _condition(w, "Queued")
    assert w.status["phase"] == "Queued" and queued["reason"] == "WaitingForAdmission"
    assert "8 more needed" in queued["message"]
    assert not [x for x in w.kube.writes if x.kind in ("TrainJob", "Workload", "LocalQueue") and x.verb != "create"]


def test_a_queue_name_without_a_local_queue_says_so():
    w = world(queueName="nowhere")
    w.reconcile()
    w.reconcile()
    queued = _condition(w, "Queued")
    assert queued["reason"] == "LocalQueueNotFound" and f"LocalQueue {NAMESPACE}/nowhere does not exist" in queued["message"]


def test_without_kueue_installed_a_queued_job_still_waits_saying_the_queue_holds_it():
    w = world(served=V2 - {"workloads", "localqueues"}, queueName="gpus")
    w.reconcile()
    w.reconcile()
    queued = _condition(w, "Queued")
    assert queued["reason"] == "WaitingForAdmission" and "suspended by queue gpus" in queued["message"]


def test_the_policys_default_queue_is_used_only_where_the_namespace_has_it():
    from reconcile_world import policy_with_catalog

    policy = policy_with_catalog().model_copy(update={"default_queue_name": "gpus"})
    queued = ReconcileWorld(job_document(), policy=policy)
    queued.kube.served = set(V2)
    queued.kube.put("ClusterTrainingRuntime", {"metadata": {"name": "finetune-torch", "namespace": ""}})
    queued.kube.put("LocalQueue", {"metadata": {"name": "gpus", "namespace": NAMESPACE}})
    queued.reconcile()
    (child,) = queued.ours("TrainJob")
    assert child["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpus" and child["spec"]["suspend"] is True
    plain = ReconcileWorld(job_document(), policy=policy)
    plain.kube.served = set(V2)
    plain.kube.put("ClusterTrainingRuntime", {"metadata": {"name": "finetune-torch", "namespace": ""}})
    plain.reconcile()
    (child,) = plain.ours("TrainJob")
    assert "kueue.x-k8s.io/queue-name" not in child["metadata"]["labels"] and child["spec"]["suspend"] is False
