"""Node pools: what GPUs the cluster has or can scale to, from a catalog and from Node objects.

A pool is a group of identical GPU nodes selected by labels (a Karpenter NodePool, a GKE
node pool, an EKS node group, an AKS agent pool). The platform team describes pools in a
catalog (they may scale from zero, so nothing in the cluster shows them); discovery adds
what the Node objects show now (free GPUs, nodes up). `merge_pools` combines the two.

This module is the one place the rest of the operator imports pools from; the parts live
by concern in `gpus` (the GPU table and GPU labels), `quantities` (Kubernetes quantities),
`nodepool` (the model), `catalog` and `discovery` (Node objects, and the merge).
"""

from __future__ import annotations

from .catalog import CatalogError, load_catalog
from .discovery import Discovery, SkippedNode, discover, discover_pools, merge_pools
from .gpus import (
    GFD_COUNT,
    GFD_MEMORY,
    GFD_PRODUCT,
    GKE_ACCELERATOR,
    GPU_RESOURCE,
    GPU_TYPES,
    GpuType,
    canonical_gpu_name,
    gpu_type_info,
    label_values_for,
    same_gpu_type,
)
from .nodepool import GiB, GpuLabel, MiB, NodePool, Taint, pool_name_from
from .quantities import QuantityError, parse_quantity, quantity_bytes, quantity_count

__all__ = [
    "GFD_COUNT",
    "GFD_MEMORY",
    "GFD_PRODUCT",
    "GKE_ACCELERATOR",
    "GPU_RESOURCE",
    "GPU_TYPES",
    "CatalogError",
    "Discovery",
    "GiB",
    "GpuLabel",
    "GpuType",
    "MiB",
    "NodePool",
    "QuantityError",
    "SkippedNode",
    "Taint",
    "canonical_gpu_name",
    "discover",
    "discover_pools",
    "gpu_type_info",
    "label_values_for",
    "load_catalog",
    "merge_pools",
    "parse_quantity",
    "pool_name_from",
    "quantity_bytes",
    "quantity_count",
    "same_gpu_type",
]
