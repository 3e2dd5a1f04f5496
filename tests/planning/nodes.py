"""Node and Pod objects shaped as the API server returns them (JSON, camelCase), for discovery tests.

The labels are those GPU Feature Discovery, Karpenter, GKE and kubelet really set.
"""

from __future__ import annotations

import copy
from typing import Any


def gpu_node(
    name: str,
    *,
    product: str = "NVIDIA-H100-80GB-HBM3",
    memory_mib: int | None = 81559,
    gpus: int = 8,
    region: str = "eu-de-berlin",
    zone: str = "eu-de-berlin-1",
    pool_labels: dict[str, str] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    memory: str = "2063146352Ki",
    cpu: str = "191500m",
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = {
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "topology.kubernetes.io/region": region,
        "topology.kubernetes.io/zone": zone,
        "feature.node.kubernetes.io/pci-10de.present": "true",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "90",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.machine": "p5.48xlarge",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/mig.capable": "false",
    }
    if memory_mib is not None:
        labels["nvidia.com/gpu.memory"] = str(memory_mib)
    labels.update(pool_labels if pool_labels is not None else {"karpenter.sh/nodepool": "h100-berlin"})
    labels.update(extra_labels or {})
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"nfd.node.kubernetes.io/feature-labels": "pci-10de.present"},
            "creationTimestamp": "2026-11-29T10:00:00Z",
        },
        "spec": {
            "providerID": f"aws:///eu-central-1a/i-{abs(hash(name)) % 10**12:012d}",
            "taints": taints if taints is not None else [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        },
        "status": {
            "capacity": {"cpu": "192", "memory": "2097152000Ki", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "allocatable": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus), "pods": "110",
                            "ephemeral-storage": "95491281146"},
            "conditions": [
                {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
                {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure"},
                {"type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID"},
                {"type": "Ready", "status": "True" if ready else "False",
                 "reason": "KubeletReady" if ready else "KubeletNotReady"},
            ],
            "nodeInfo": {"kubeletVersion": "v1.31.2", "containerRuntimeVersion": "containerd://1.7.22"},
        },
    }
    if unschedulable:
        node["spec"]["unschedulable"] = True
        node["spec"]["taints"].append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    return node


def cpu_node(name: str, region: str = "eu-de-berlin") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/region": region,
                                               "karpenter.sh/nodepool": "general"}},
        "spec": {},
        "status": {"allocatable": {"cpu": "15890m", "memory": "63000000Ki", "pods": "110"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


def gpu_pod(name: str, node: str, gpus: int, *, phase: str = "Running", init_gpus: int = 0,
            limits_only: bool = False) -> dict[str, Any]:
    resources = {"limits": {"nvidia.com/gpu": str(gpus), "memory": "200Gi"}}
    if not limits_only:
        resources["requests"] = {"nvidia.com/gpu": str(gpus), "cpu": "16", "memory": "200Gi"}
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "trainer", "image": "trainer:1", "resources": resources},
                {"name": "sidecar", "image": "busybox", "resources": {"requests": {"cpu": "100m"}}},
            ],
        },
        "status": {"phase": phase},
    }
    if init_gpus:
        pod["spec"]["initContainers"] = [
            {"name": "warmup", "image": "trainer:1", "resources": {"limits": {"nvidia.com/gpu": str(init_gpus)}}}
        ]
    return pod


def snake_case(obj: Any) -> Any:
    """The same object as the kubernetes client's `.to_dict()` gives it (snake_case keys; labels untouched)."""
    mapping = {"nodeName": "node_name", "initContainers": "init_containers", "providerID": "provider_id",
               "creationTimestamp": "creation_timestamp", "nodeInfo": "node_info", "apiVersion": "api_version"}
    keep_keys_of = {"labels", "annotations", "allocatable", "capacity", "limits", "requests"}

    def walk(value: Any, parent: str = "") -> Any:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                key = k if parent in keep_keys_of else mapping.get(k, k)
                out[key] = walk(v, k)
            return out
        if isinstance(value, list):
            return [walk(v, parent) for v in value]
        return value

    return walk(copy.deepcopy(obj))
