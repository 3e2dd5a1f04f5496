"""The lab's nodes: pools.yaml (plain data) -> Node manifests kwok will manage, and the labels and
taints the real kubelet node (realnode.py) registers with."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

POOLS_FILE = Path(__file__).resolve().parent / "pools.yaml"

POOL_LABEL = "karpenter.sh/nodepool"
REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
GPU_RESOURCE = "nvidia.com/gpu"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_ANNOTATION_VALUE = "fake"
# The pool with `runner: kubelet` is the lab's real nodes (realnode.py): real kubelets register them
# with this pool's labels and taints (RUNNER_LABEL among them), and run their pods as containers. kwok
# never sees them; the fake GPU leaves their pods alone.
RUNNER_LABEL = "lab.finetune.dev/runner"
RUNNER_KUBELET = "kubelet"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
# The policy the chart ships by default (issue 9); the lab's scenarios check placement against it.
DEFAULT_ALLOWED_REGIONS = ("eu-de-berlin", "eu-fr-paris")


class GPU(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    product: str
    memory_mib: int = Field(alias="memoryMiB", gt=0)
    count: int = Field(gt=0)


class Pool(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    region: str
    zones: list[str] = Field(min_length=1)
    nodes: int = Field(gt=0)
    instance_type: str = Field(alias="instanceType")
    gpu: GPU | None
    cpu: str
    memory: str
    # "kubelet": the pool is the lab's real kubelet nodes, its pods real containers.
    runner: Literal["kubelet"] | None = None

    def node_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.nodes)]


class PoolCatalog(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pools: list[Pool]

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def gpu_pools(self) -> list[Pool]:
        return [p for p in self.pools if p.gpu]

    def kubelet_pool(self) -> Pool:
        """The real nodes' pool: exactly one. realnode.py runs a kubelet and a containerd per node on
        this machine, each node in a mount namespace of its own."""
        found = [p for p in self.pools if p.runner == RUNNER_KUBELET]
        if len(found) != 1:
            raise ValueError(f"{POOLS_FILE.name} must have exactly one pool with runner: kubelet,"
                             f" found {[p.name for p in found]}")
        return found[0]


def load_pools(path: Path = POOLS_FILE) -> PoolCatalog:
    return PoolCatalog.model_validate(yaml.safe_load(path.read_text()))


def node_labels(pool: Pool, index: int) -> dict[str, str]:
    """What a node of the pool is labelled with: the topology, Karpenter's pool, GPU Feature Discovery's
    GPU labels, and the runner. The real kubelet sets its own hostname, os and arch labels."""
    zone = pool.zones[index % len(pool.zones)]
    labels = {
        "node.kubernetes.io/instance-type": pool.instance_type,
        REGION_LABEL: pool.region,
        ZONE_LABEL: zone,
        POOL_LABEL: pool.name,
        "karpenter.sh/capacity-type": "on-demand",
    }
    if pool.gpu:
        labels |= {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": pool.gpu.product,
            "nvidia.com/gpu.memory": str(pool.gpu.memory_mib),
            "nvidia.com/gpu.count": str(pool.gpu.count),
        }
    if pool.runner:
        labels[RUNNER_LABEL] = pool.runner
    return labels


def node_taints(pool: Pool) -> list[dict[str, str]]:
    taints = []
    if pool.gpu:
        # GPU nodes repel everything that does not ask for a GPU (the usual EKS/GKE/Karpenter setup).
        taints.append(dict(GPU_TAINT))
    if pool.runner:
        # A dedicated pool: only pods that tolerate it (the operator's, planned there) land on it,
        # never a scenario's fake-GPU pod that asks for a GPU without naming a region.
        taints.append({"key": RUNNER_LABEL, "value": pool.runner, "effect": "NoSchedule"})
    return taints


def node_manifest(pool: Pool, index: int) -> dict:
    if pool.runner == RUNNER_KUBELET:
        raise ValueError(f"pool {pool.name} is the real kubelet node's: the kubelet registers it, not kwok")
    name = pool.node_names()[index]
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
              **node_labels(pool, index), "type": "kwok"}
    capacity = {"cpu": pool.cpu, "memory": pool.memory, "pods": "110", "ephemeral-storage": "3Ti"}
    if pool.gpu:
        capacity[GPU_RESOURCE] = str(pool.gpu.count)
    taints = node_taints(pool)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {KWOK_ANNOTATION: KWOK_ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def all_node_manifests(catalog: PoolCatalog | None = None) -> list[dict]:
    catalog = catalog or load_pools()
    return [node_manifest(p, i) for p in catalog.pools if p.runner != RUNNER_KUBELET for i in range(p.nodes)]
