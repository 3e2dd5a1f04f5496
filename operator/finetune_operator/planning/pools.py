"""Node pools: what GPUs the cluster has or can scale to, from a catalog and from Node objects.

A pool is a group of identical GPU nodes selected by labels (a Karpenter NodePool, a GKE
node pool, an EKS node group, an AKS agent pool). The platform team describes pools in a
catalog (they may scale from zero, so nothing in the cluster shows them); discovery adds
what the Node objects show now (free GPUs, nodes up). `merge_pools` combines the two.

Pure code: Node and Pod objects come in as plain dicts (`.to_dict()` of the kubernetes
client, or the API's JSON); both snake_case and camelCase keys are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

GiB = 1024**3
MiB = 1024**2

# ---------------------------------------------------------------------------
# The canonical GPU table
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuType:
    """One GPU model: its canonical name, usable memory and dense bf16 tensor throughput."""

    name: str
    memory_bytes: int  # what the driver reports (nvidia.com/gpu.memory, MiB x 2^20)
    bf16_tflops: float  # dense (no sparsity) peak, from the vendor's data sheet
    nvlink: bool  # the usual server form factor has NVLink/NVSwitch between GPUs


def _gpu(name: str, memory_mib: int, tflops: float, nvlink: bool) -> GpuType:
    return GpuType(name, memory_mib * MiB, tflops, nvlink)


# Canonical types. Memory is the MiB figure GPU Feature Discovery publishes for the card.
_CANONICAL = [
    _gpu("H200-141GB", 143771, 989.0, True),
    _gpu("H100-80GB", 81559, 989.0, True),
    _gpu("H100-PCIE-80GB", 81559, 756.0, False),
    _gpu("H100-NVL-94GB", 95830, 835.0, True),
    _gpu("A100-80GB", 81920, 312.0, True),
    _gpu("A100-40GB", 40960, 312.0, True),
    _gpu("L40S-48GB", 46068, 362.0, False),
    _gpu("L40-48GB", 46068, 181.0, False),
    _gpu("L4-24GB", 23034, 121.0, False),
    _gpu("A10G-24GB", 23028, 70.0, False),
    _gpu("A10-24GB", 23028, 125.0, False),
    _gpu("V100-32GB", 32768, 125.0, True),  # fp16; no bf16 on Volta
    _gpu("V100-16GB", 16384, 125.0, True),
    _gpu("T4-16GB", 15360, 65.0, False),  # fp16; no bf16 on Turing
]
_BY_NAME = {g.name: g for g in _CANONICAL}

# Product label spellings (`nvidia.com/gpu.product` as GFD writes it, and the names
# cloud providers put in their own labels) -> canonical type.
_SPELLINGS: dict[str, str] = {
    "NVIDIA-H200": "H200-141GB",
    "NVIDIA-H200-141GB-HBM3e": "H200-141GB",
    "NVIDIA-H200-SXM-141GB": "H200-141GB",
    "nvidia-h200-141gb": "H200-141GB",
    "NVIDIA-H100-80GB-HBM3": "H100-80GB",
    "NVIDIA-H100-SXM5-80GB": "H100-80GB",
    "nvidia-h100-80gb": "H100-80GB",
    "nvidia-h100-mega-80gb": "H100-80GB",
    "NVIDIA-H100-PCIe": "H100-PCIE-80GB",
    "NVIDIA-H100-80GB-PCIe": "H100-PCIE-80GB",
    "NVIDIA-H100-NVL": "H100-NVL-94GB",
    "NVIDIA-A100-SXM4-80GB": "A100-80GB",
    "NVIDIA-A100-80GB-PCIe": "A100-80GB",
    "nvidia-a100-80gb": "A100-80GB",
    "NVIDIA-A100-SXM4-40GB": "A100-40GB",
    "NVIDIA-A100-PCIE-40GB": "A100-40GB",
    "nvidia-tesla-a100": "A100-40GB",
    "NVIDIA-L40S": "L40S-48GB",
    "nvidia-l40s": "L40S-48GB",
    "NVIDIA-L40": "L40-48GB",
    "NVIDIA-L4": "L4-24GB",
    "nvidia-l4": "L4-24GB",
    "NVIDIA-A10G": "A10G-24GB",
    "NVIDIA-A10": "A10-24GB",
    "Tesla-V100-SXM2-32GB": "V100-32GB",
    "Tesla-V100-SXM2-16GB": "V100-16GB",
    "Tesla-T4": "T4-16GB",
    "nvidia-tesla-t4": "T4-16GB",
}

# Lookup table: every spelling (and every canonical name), case-insensitive -> GpuType.
GPU_TYPES: dict[str, GpuType] = {name.lower(): gpu for name, gpu in _BY_NAME.items()}
GPU_TYPES.update({spelling.lower(): _BY_NAME[canonical] for spelling, canonical in _SPELLINGS.items()})


def gpu_type_info(spelling: str) -> GpuType | None:
    """The GPU type a product label or canonical name denotes, or None when unknown."""
    return GPU_TYPES.get(spelling.strip().lower())


def canonical_gpu_name(spelling: str) -> str:
    """Canonical name of a spelling; unknown spellings are returned unchanged."""
    info = gpu_type_info(spelling)
    return info.name if info else spelling


def same_gpu_type(a: str, b: str) -> bool:
    """Whether two spellings name the same GPU type (`A100-80GB` == `NVIDIA-A100-SXM4-80GB`)."""
    return canonical_gpu_name(a).lower() == canonical_gpu_name(b).lower()


# ---------------------------------------------------------------------------
# The pool model
# ---------------------------------------------------------------------------


class Taint(BaseModel):
    """A node taint the training pods must tolerate to land on the pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, max_length=317)
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class NodePool(BaseModel):
    """A group of identical GPU nodes that the training pods can be pinned to."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
    )

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Pool name (the `node_pool` a job may ask for)."""
    region: str = Field(min_length=1, max_length=63)
    """Region (value of the cluster's region label)."""
    zones: list[str] = []
    """Zones the pool's nodes are in."""
    gpu_type: str = Field(min_length=1, max_length=64)
    """Canonical GPU type, e.g. H100-80GB."""
    gpu_memory_bytes: int = Field(gt=0)
    """Memory of one GPU, bytes."""
    gpus_per_node: int = Field(ge=1, le=64)
    """GPUs in each node."""
    max_nodes: int = Field(ge=0, le=100_000)
    """Autoscaling ceiling: most nodes the pool can have."""
    free_gpus: int | None = Field(default=None, ge=0)
    """GPUs free right now (None: unknown, e.g. a catalog pool nobody has looked at)."""
    nodes_now: int = Field(default=0, ge=0)
    """Nodes up right now."""
    price_per_gpu_hour: float | None = Field(default=None, ge=0)
    """Price of one GPU-hour in the catalog's currency (None: unknown)."""
    intra_node: Literal["nvlink", "pcie"] = "nvlink"
    """Interconnect between the GPUs of one node."""
    inter_node_gbps: float = Field(default=100.0, ge=0)
    """Network bandwidth between nodes, Gbit/s per node."""
    host_memory_bytes: int = Field(default=0, ge=0)
    """Host RAM of one node that pods may use (allocatable), bytes; 0 = unknown."""
    cpus: int = Field(default=0, ge=0)
    """CPUs of one node (allocatable); 0 = unknown."""
    selector: dict[str, str] = {}
    """Node labels that select the pool, e.g. {karpenter.sh/nodepool: h100-berlin}."""
    taints: list[Taint] = []
    """Taints on the pool's nodes, which the training pods tolerate."""
    peak_tflops: float | None = Field(default=None, gt=0)
    """Dense bf16 peak of one GPU; taken from the GPU table when omitted."""
    source: Literal["catalog", "discovered", "both"] = "catalog"
    """Where the pool is known from."""

    @property
    def max_gpus(self) -> int:
        """Most GPUs the pool can give one job."""
        return self.max_nodes * self.gpus_per_node

    @property
    def gpu_memory_gib(self) -> float:
        return self.gpu_memory_bytes / GiB

    @property
    def tflops(self) -> float:
        """Dense bf16 peak of one GPU (catalog figure, else the GPU table, else a cautious 100)."""
        if self.peak_tflops is not None:
            return self.peak_tflops
        info = gpu_type_info(self.gpu_type)
        return info.bf16_tflops if info else 100.0

    def summary(self) -> str:
        return f"{self.name} ({self.gpus_per_node} x {self.gpu_type} per node, {self.region})"
