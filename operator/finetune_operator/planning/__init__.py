"""Node pools (catalog and discovery), the cluster policy, and the plan search. Pure code."""

from .plan import Infeasible, Plan, PlanKey, PlanningResult, plan_key_of
from .policy import ClusterPolicy, PolicyError, load_policy
from .pools import GPU_TYPES, GpuType, NodePool, Taint, canonical_gpu_name, gpu_type_info

__all__ = [
    "GPU_TYPES",
    "ClusterPolicy",
    "GpuType",
    "Infeasible",
    "NodePool",
    "Plan",
    "PlanKey",
    "PlanningResult",
    "PolicyError",
    "Taint",
    "canonical_gpu_name",
    "gpu_type_info",
    "load_policy",
    "plan_key_of",
]
