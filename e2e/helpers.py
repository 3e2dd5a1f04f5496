"""Manifests and waits shared by the e2e scenarios."""

from __future__ import annotations

from kubernetes import client

from e2e.lab.fate import JOB_LABEL, PREDICTED_PEAK_ANNOTATION
from e2e.lab.nodes import GPU_RESOURCE, REGION_LABEL
from e2e.lab.waiting import wait_for

GIB = 1024**3
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def region_affinity(regions: list[str]) -> dict:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": REGION_LABEL, "operator": "In", "values": list(regions)}]}
                ]
            }
        }
    }


def gpu_pod_spec(gpus: int, regions: list[str] | None, container: str = "trainer") -> dict:
    spec = {
        "restartPolicy": "Never",
        "tolerations": [GPU_TOLERATION],
        "containers": [{
            "name": container,
            "image": "registry.eu.example/finetune/trainer:lab",
            "resources": {"limits": {GPU_RESOURCE: str(gpus)}, "requests": {"cpu": "1", "memory": "4Gi"}},
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
    }
    if regions:
        spec["affinity"] = region_affinity(regions)
    return spec


def training_pod(name: str, job: str, predicted_peak_bytes: int | None, gpus: int = 1,
                 regions: list[str] | None = None, annotations: dict | None = None) -> dict:
    ann = dict(annotations or {})
    if predicted_peak_bytes is not None:
        ann[PREDICTED_PEAK_ANNOTATION] = str(predicted_peak_bytes)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {JOB_LABEL: job}, "annotations": ann},
        "spec": gpu_pod_spec(gpus, regions),
    }


def pytorchjob(name: str, job: str, predicted_peak_bytes: int, gpus: int = 8, workers: int = 0,
               regions: list[str] | None = None, annotations: dict | None = None,
               container: str = "pytorch") -> dict:
    template = {
        "metadata": {
            "labels": {JOB_LABEL: job},
            "annotations": {PREDICTED_PEAK_ANNOTATION: str(predicted_peak_bytes), **(annotations or {})},
        },
        "spec": gpu_pod_spec(gpus, regions, container=container),
    }
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if workers:
        replicas["Worker"] = {"replicas": workers, "restartPolicy": "Never", "template": template}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        # No runPolicy.backoffLimit: with backoffLimit 0 the training operator v1.9 deletes the
        # failed pods (its "exceeds backoff limit" path), and the termination message with them.
        "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": replicas},
    }


def terminated_state(core: client.CoreV1Api, namespace: str, pod: str, timeout: float = 60):
    """Wait until the pod's first container has terminated; return (pod, terminated state)."""

    def check():
        p = core.read_namespaced_pod(pod, namespace)
        statuses = p.status.container_statuses or []
        if statuses and statuses[0].state and statuses[0].state.terminated:
            return p, statuses[0].state.terminated
        return None

    return wait_for(check, timeout, f"pod {namespace}/{pod} to terminate")


def job_condition(custom: client.CustomObjectsApi, namespace: str, name: str, ctype: str, timeout: float = 90) -> dict:
    def check():
        job = custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name)
        for c in job.get("status", {}).get("conditions", []):
            if c["type"] == ctype and c["status"] == "True":
                return job
        return None

    return wait_for(check, timeout, f"PyTorchJob {namespace}/{name} condition {ctype}")
