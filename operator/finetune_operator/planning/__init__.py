"""Node pools (catalog and discovery), the cluster policy, and the plan search (search/: one module
per stage, in the order it works; search/planner.py lists them). Pure code."""

from .plan import Infeasible, Plan, PlanKey, PlanningResult, plan_key_of
from .policy import ClusterPolicy, PolicyError, load_policy
from .pools import (
    GPU_TYPES,
    CatalogError,
    Discovery,
    GpuLabel,
    GpuType,
    NodePool,
    SkippedNode,
    Taint,
    canonical_gpu_name,
    discover,
    discover_pools,
    gpu_type_info,
    load_catalog,
    merge_pools,
)
from .search import exhaustive_plan, plan_job

__all__ = [
    "GPU_TYPES",
    "CatalogError",
    "ClusterPolicy",
    "Discovery",
    "GpuLabel",
    "GpuType",
    "Infeasible",
    "NodePool",
    "Plan",
    "PlanKey",
    "PlanningResult",
    "PolicyError",
    "SkippedNode",
    "Taint",
    "canonical_gpu_name",
    "discover",
    "discover_pools",
    "exhaustive_plan",
    "gpu_type_info",
    "load_catalog",
    "load_policy",
    "merge_pools",
    "plan_job",
    "plan_key_of",
]
