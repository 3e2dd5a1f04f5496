"""The node pool model: a group of identical GPU nodes, and the labels that select its nodes.

A pool is a group of identical GPU nodes selected by labels (a Karpenter NodePool, a GKE
node pool, an EKS node group, an AKS agent pool). Its nodes are told apart from every other
node by three things, which every pod of an attempt on the pool must require: the region
label (the cluster policy's key, the pool's region), the pool's `selector`, and its
`gpu_label` (the label that names the GPU model on its nodes, with the values it takes
there). Two pools that differ in GPU type therefore never select the same node.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from .gpus import GFD_PRODUCT, canonical_gpu_name, gpu_type_info, label_values_for

GiB = 1024**3
MiB = 1024**2


class Taint(BaseModel):
    """A node taint the training pods must tolerate to land on the pool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1, max_length=317)
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"


class GpuLabel(BaseModel):
    """How the pool's nodes name their GPU model: a node label and the values it takes there."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    key: str = Field(default=GFD_PRODUCT, min_length=1, max_length=317)
    """Node label that names the GPU (GPU Feature Discovery's, or e.g. cloud.google.com/gke-accelerator)."""
    values: list[str] = Field(default=[], max_length=64)
    """Its values on the pool's nodes (exact, case-sensitive); filled from the GPU table for a known type."""


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
    gpu_label: GpuLabel | None = Field(default=None, validate_default=True)
    """The node label naming the GPU model and its values on the pool's nodes; None only for a
    GPU type the table does not know and nobody said how its nodes are labelled (such a pool
    cannot be rendered: the catalog refuses it, discovery always knows the label it read)."""
    gpu_memory_bytes: int = Field(gt=0)
    """Memory of one GPU, bytes."""
    gpus_per_node: int = Field(ge=1, le=64)
    """GPUs in each node."""
    max_nodes: int = Field(ge=0, le=100_000)
    """Autoscaling ceiling: most nodes the pool can have."""
    free_gpus: int | None = Field(default=None, ge=0)
    """GPUs free right now (None: unknown, e.g. a catalog pool nobody has looked at)."""
    free_gpus_per_node: list[int] = []
    """Free GPUs of each node up now, most first (discovery fills it; empty: only the total is known)."""
    queued_gpus: int = Field(default=0, ge=0)
    """GPUs that attempts planned on the pool ask for and that found no free GPUs: the pool's queue
    (capacity.py fills it from the operator's claims; pods of other tenants are not counted)."""
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

    @field_validator("gpu_label")
    @classmethod
    def _gpu_label_of_the_type(cls, label: GpuLabel | None, info: ValidationInfo) -> GpuLabel | None:
        gpu_type = info.data.get("gpu_type")
        if not isinstance(gpu_type, str):
            return label  # gpu_type itself failed validation; that error is the one to read
        key = GFD_PRODUCT if label is None else label.key
        values = list(label.values) if label is not None else []
        if not values:
            values = label_values_for(key, gpu_type)
            if not values:
                if label is None:
                    return None
                raise ValueError(
                    f"the GPU table does not know the values of {key} on {gpu_type} nodes;"
                    " give gpuLabel.values: the label's exact value on the pool's nodes"
                )
        # A value the table knows as another GPU type would pin the pool's pods to that type.
        foreign = [v for v in values if (known := gpu_type_info(v)) is not None and known.name != canonical_gpu_name(gpu_type)]
        if foreign:
            raise ValueError(f"values {foreign} name another GPU type than {gpu_type}")
        if len(set(values)) != len(values):
            raise ValueError(f"values {values} repeat a value")
        return GpuLabel(key=key, values=values)

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

    def fits_now(self, nodes: int, gpus_per_node: int) -> bool:
        """Whether `nodes` nodes with `gpus_per_node` free GPUs each are up now (no scale-up needed)."""
        if self.free_gpus_per_node:
            return sum(1 for free in self.free_gpus_per_node if free >= gpus_per_node) >= nodes
        # Only the total is known: assume it is where it is needed.
        return self.free_gpus is not None and self.free_gpus >= nodes * gpus_per_node

    def wait_share(self, nodes: int, gpus_per_node: int) -> float:
        """How long a job of this shape waits here, in run lengths of the pool's work: 0 when it can
        start now, else the GPUs queued ahead of it and its own over the GPUs the pool has up now
        (infinite when nothing is known: a pool with no nodes up must scale up first)."""
        if self.fits_now(nodes, gpus_per_node):
            return 0.0
        capacity = self.nodes_now * self.gpus_per_node
        if self.free_gpus is None or capacity <= 0:
            return math.inf
        return (self.queued_gpus + nodes * gpus_per_node) / capacity

    def selects(self, labels: dict[str, str], region_label_key: str) -> bool:
        """Whether a node with `labels` is one of the pool's nodes: its region, its selector, its GPU."""
        if labels.get(region_label_key) != self.region:
            return False
        if any(labels.get(key) != value for key, value in self.selector.items()):
            return False
        return self.gpu_label is not None and labels.get(self.gpu_label.key) in self.gpu_label.values


def pool_name_from(value: str) -> str:
    """`value` made a valid pool name (a DNS-1123 label)."""
    name = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-")
    return name or "pool"
