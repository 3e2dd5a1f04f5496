"""The real shell (`Cluster`, `Reconciler`) and lifecycle on the strict fake API, with a
training operator and kubelet played by the test: children start, fail and succeed as told."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import yaml

from finetune_operator import api
from finetune_operator.children import PLAN_STATUS_ANNOTATION, SUSPENDED_BY_ANNOTATION
from finetune_operator.shell.cluster import Cluster
from finetune_operator.shell.reconciler import Later, PolicyHolder, Reconciler
from finetune_operator.shell.informers import ClusterCache
from finetune_operator.planning.policy import load_policy
from finetune_operator.planning.pools import GiB
from finetune_operator.rendering.backend import PYTORCH_JOB
from finetune_operator.rendering.labels import ATTEMPT_LABEL, JOB_LABEL
from finetune_trainer import contract

from fake_kube import FakeKube

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
NAMESPACE = "team-a"
ALLOWED = ["eu-de-berlin", "eu-fr-paris"]


def policy_with_catalog():
    catalog = yaml.safe_load((REPO / "examples" / "pools.yaml").read_text())
    return load_policy({"allowedRegions": ALLOWED, "catalog": catalog["pools"]})


def job_document(name: str = "support-bot", **spec_changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "llama-8b-lora.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NAMESPACE}
    doc["spec"].update(spec_changes)
    return doc


def gpu_node(name: str, pool: str, product: str, gpus: int, region: str = "eu-de-berlin") -> dict[str, Any]:
    """A Ready node of `pool` with `gpus` GPUs, none of them used (no pod is bound to it)."""
    return {"metadata": {"name": name, "labels": {
        "karpenter.sh/nodepool": pool, "topology.kubernetes.io/region": region,
        "nvidia.com/gpu.product": product}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus), "memory": "1900Gi", "cpu": "190"},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


def live(pj: dict[str, Any]) -> bool:
    conditions = {c["type"]: c["status"] for c in (pj.get("status") or {}).get("conditions") or []}
    return conditions.get("Succeeded") != "True" and conditions.get("Failed") != "True"


class Done:
    """A write that already ran (its value, or its error for whoever asks for the result)."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value, self.error = None, None
        try:
            self.value = call()
        except Exception as error:  # noqa: BLE001 - handed to whoever asks for the result
            self.error = error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self) -> bool:
        return False


def at_once(call: Callable[[], Any]) -> Done:
    """`Reconciler.alongside` whose write lands before the status write (a thread pool may do that)."""
    return Done(call)


class ReconcileWorld:
    def __init__(self, doc: dict[str, Any], policy=None, *, informed: bool = False, eager: bool = False) -> None:
        # informed: the shell reads pods and training jobs from informers (informers.py) on the fake's
        # watches, stepped before each reconcile unless `lagging` (then it reads what it last saw).
        self.informed = informed
        # eager: the ConfigMap posted alongside the status write lands before it (`at_once`); else after.
        self.alongside = at_once if eager else Later
        self.lagging = False
        self.queued: list[tuple[str, str]] = []
        self.kube = FakeKube()
        self.policy = policy or policy_with_catalog()
        self.now = T0
        self.name = doc["metadata"]["name"]
        self.kube.put("FineTuneJob", doc)
        self.restarts = 0
        self.restart()

    # -- the operator --------------------------------------------------------
    def restart(self) -> None:
        """A new operator process: nothing of the old one's memory survives."""
        cluster = Cluster(mock.MagicMock())
        cluster.core, cluster.custom, cluster.networking = self.kube.core, self.kube.custom, self.kube.networking
        if self.informed:
            cluster.cache = ClusterCache(self.kube.core, self.kube.custom, on_job=lambda ns, name: self.queued.append((ns, name)),
                                         on_pod=lambda pod, deleted: cluster.remember_failed_pod(pod, deleted=deleted))
            cluster.cache.watch_children(PYTORCH_JOB, start=False)
        self.reconciler = Reconciler(cluster=cluster, policy=PolicyHolder(self.policy), clock=lambda: self.now,
                                     alongside=self.alongside)
        self.restarts += 1

    def reconcile(self) -> float | None:
        if self.informed and not self.lagging:
            self.sync()
        return self.reconciler.reconcile(NAMESPACE, self.name)

    def sync(self) -> None:
        """The informers catch up: a list the first time, then the watch events since."""
        for informer in self.reconciler.cluster.cache.all():
            informer.step()

    # -- reading -------------------------------------------------------------
    @property
    def job(self) -> dict[str, Any]:
        return self.kube.get("FineTuneJob", NAMESPACE, self.name)

    @property
    def status(self) -> dict[str, Any]:
        return self.job.get("status") or {}

    def ours(self, kind: str) -> list[dict[str, Any]]:
        uid = self.job["metadata"]["uid"]
        return [o for o in self.kube.of_kind(kind, NAMESPACE)
                if any(r.get("uid") == uid and r.get("controller") for r in o["metadata"].get("ownerReferences") or [])]

    def live_children(self) -> list[dict[str, Any]]:
        return [pj for pj in self.ours("PyTorchJob") if live(pj)]

    def newest_child(self) -> dict[str, Any] | None:
        children = sorted(self.ours("PyTorchJob"), key=lambda pj: int(pj["metadata"]["labels"][ATTEMPT_LABEL]))
        return children[-1] if children else None

    def conditions(self) -> dict[str, dict[str, Any]]:
        return {c["type"]: c for c in self.status.get("conditions") or []}

    # -- the training operator and kubelet ---------------------------------------
    def _pod(self, pj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        meta = pj["metadata"]
        return self.kube.put("Pod", {
            "metadata": {"name": f"{meta['name']}-master-0", "namespace": NAMESPACE,
                         "labels": {JOB_LABEL: meta["labels"][JOB_LABEL], ATTEMPT_LABEL: meta["labels"][ATTEMPT_LABEL]},
                         "ownerReferences": [{"kind": "PyTorchJob", "name": meta["name"], "uid": meta["uid"], "controller": True}]},
            "status": status})

    def _set_state(self, pj: dict[str, Any], state: str) -> None:
        pj.setdefault("status", {})["conditions"] = [{"type": state, "status": "True"}]
        self.kube.touch(pj)

    def run(self, pj: dict[str, Any]) -> None:
        self._set_state(pj, "Running")
        self._pod(pj, {"phase": "Running"})

    def succeed(self, pj: dict[str, Any]) -> None:
        self._set_state(pj, "Succeeded")

    def gpu_oom(self, pj: dict[str, Any]) -> None:
        plan = api.PlanStatus.model_validate(json.loads(pj["metadata"]["annotations"][PLAN_STATUS_ANNOTATION]))
        capacity = int(plan.gpu_memory_gi_b * GiB)
        report = contract.FailureReport(
            reason="GPUOutOfMemory", phase="backward", step=3, exit_code=75,
            peak_allocated_bytes=int(capacity * 0.99), device_total_bytes=capacity,
            micro_batch_size=plan.micro_batch_size)
        self._pod(pj, {"phase": "Failed", "containerStatuses": [{"name": "pytorch", "state": {"terminated": {
            "exitCode": 75, "message": report.to_termination_message()}}}]})
        self._set_state(pj, "Failed")

    def host_oom(self, pj: dict[str, Any]) -> None:
        self._pod(pj, {"phase": "Failed", "containerStatuses": [{"name": "pytorch", "state": {"terminated": {
            "exitCode": 137, "reason": "OOMKilled"}}}]})
        self._set_state(pj, "Failed")

    def evict(self, pj: dict[str, Any]) -> None:
        self._pod(pj, {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory.",
                       "conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}]})
        self._set_state(pj, "Failed")

    def queue_suspend(self, pj: dict[str, Any]) -> None:
        """What Kueue's webhook does to a job it manages: suspend it, with no mark of ours."""
        pj["spec"].setdefault("runPolicy", {})["suspend"] = True
        (pj["metadata"].get("annotations") or {}).pop(SUSPENDED_BY_ANNOTATION, None)
        self.kube.touch(pj)

    def queue_admit(self, pj: dict[str, Any]) -> None:
        pj["spec"].setdefault("runPolicy", {})["suspend"] = False
        self.kube.touch(pj)

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def foreign(self, kind: str, name: str) -> dict[str, Any]:
        body: dict[str, Any] = {"metadata": {"name": name, "namespace": NAMESPACE, "labels": {"team": "other"}}}
        if kind == "ConfigMap":
            body["data"] = {"x": "y"}
        elif kind == "NetworkPolicy":
            body.update(apiVersion="networking.k8s.io/v1", kind="NetworkPolicy", spec={"podSelector": {}})
        else:
            body.update(apiVersion="kubeflow.org/v1", kind="PyTorchJob", spec={"runPolicy": {}})
        return copy.deepcopy(self.kube.put(kind, body))
