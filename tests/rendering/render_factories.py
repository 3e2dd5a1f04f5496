"""Hand-made pools, policies and plans for rendering tests (independent of the plan search)."""

from __future__ import annotations

from typing import Any

from finetune_operator import api
from finetune_operator.planning import ClusterPolicy, NodePool, Plan

GiB = 1024**3


def pool(**overrides: Any) -> NodePool:
    fields: dict[str, Any] = {
        "name": "h100-berlin",
        "region": "eu-de-berlin",
        "zones": ["eu-de-berlin-1a"],
        "gpu_type": "H100-80GB",
        "gpu_memory_bytes": 81559 * 1024**2,
        "gpus_per_node": 8,
        "max_nodes": 4,
        "host_memory_bytes": 2048 * GiB,
        "cpus": 192,
        "selector": {"karpenter.sh/nodepool": "h100-berlin"},
        "taints": [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}],
    }
    fields.update(overrides)
    return NodePool.model_validate(fields)


def policy(**overrides: Any) -> ClusterPolicy:
    fields: dict[str, Any] = {
        "allowed_regions": ["eu-de-berlin", "eu-fr-paris"],
        "trainer_image": "registry.example/trainer:1.0",
    }
    fields.update(overrides)
    return ClusterPolicy.model_validate(fields)


def plan_for(job: api.FineTuneJob, node_pool: NodePool | None = None, **overrides: Any) -> Plan:
    """A plan that satisfies the job's batch arithmetic, with overridable choices."""
    node_pool = node_pool or pool()
    nodes = overrides.pop("nodes", 1)
    gpus_per_node = overrides.pop("gpus_per_node", 2)
    micro = overrides.pop("micro_batch_size", 1)
    gpus = nodes * gpus_per_node
    global_batch = job.spec.training.global_batch_size
    fields: dict[str, Any] = {
        "pool": node_pool,
        "region": node_pool.region,
        "gpu_type": node_pool.gpu_type,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "method": job.spec.method,
        "strategy": "ddp",
        "offload": "none",
        "optimizer": job.spec.training.optimizer,
        "micro_batch_size": micro,
        "gradient_accumulation": max(1, global_batch // (micro * gpus)),
        "gradient_checkpointing": True,
        "attention": job.spec.training.attention,
        "precision": job.spec.training.precision,
        "sequence_length": job.spec.training.sequence_length,
        "global_batch_size": global_batch,
        "estimate": {},
        "predicted_peak_bytes": 40 * GiB,
        "required_bytes": 48 * GiB,
        "host_memory_bytes": 256 * GiB,
        "allowed_regions": [node_pool.region],
    }
    fields.update(overrides)
    return Plan.model_validate(fields)
