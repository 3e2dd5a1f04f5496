"""The cluster policy: what the platform team allows, rendered by the Helm chart into a ConfigMap.

The operator reloads it when the ConfigMap changes. `allowed_regions` is the outer bound
of sovereignty: a job's `placement.regions` can only narrow it.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from .pools import NodePool

DEFAULT_REGION_LABEL_KEY = "topology.kubernetes.io/region"
DEFAULT_ZONE_LABEL_KEY = "topology.kubernetes.io/zone"
# Pool labels of common conventions, in the order discovery tries them.
DEFAULT_POOL_LABEL_KEYS = [
    "karpenter.sh/nodepool",
    "cloud.google.com/gke-nodepool",
    "eks.amazonaws.com/nodegroup",
    "kubernetes.azure.com/agentpool",
]
DEFAULT_TRAINER_IMAGE = "ghcr.io/finetune-operator/trainer:0.1.0"


class PolicyError(ValueError):
    """A cluster policy that cannot be used; the message names the field."""


class ClusterPolicy(BaseModel):
    """What the platform allows jobs to use."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
    )

    allowed_regions: list[str] = []
    """Regions jobs may run in. Empty: no job may run anywhere (sovereignty is opt-in, never implied)."""
    region_label_key: str = Field(default=DEFAULT_REGION_LABEL_KEY, min_length=1, max_length=317)
    """Node label that holds the region (a `node-restriction.kubernetes.io/` label if kubelet-set labels are not trusted)."""
    zone_label_key: str = Field(default=DEFAULT_ZONE_LABEL_KEY, min_length=1, max_length=317)
    """Node label that holds the zone."""
    trainer_image: str = Field(default=DEFAULT_TRAINER_IMAGE, min_length=1, max_length=512)
    """Default trainer image."""
    default_memory_headroom: float = Field(default=0.10, ge=0, le=0.5)
    """Fraction of GPU memory plans leave free when the job does not say."""
    default_max_attempts: int = Field(default=4, ge=1, le=20)
    """Attempts when the job does not say."""
    unschedulable_timeout_seconds: int = Field(default=900, ge=10, le=7 * 86400)
    """How long an attempt's pods may stay unschedulable before the attempt moves to another
    pool inside the allowed regions (or, with none, the job fails saying why). Not applied to
    jobs that a queueing system (Kueue) admits: placement is the queue's there."""
    start_timeout_seconds: int = Field(default=900, ge=10, le=7 * 86400)
    """How long scheduled pods may fail to start (image pull, container config errors) before the
    attempt is given up as a configuration error."""
    create_retry_seconds: int = Field(default=600, ge=10, le=7 * 86400)
    """How long the operator retries creating an attempt's objects that the API refuses (an
    admission webhook, a quota) before the job fails with the API's message."""
    pool_label_keys: list[str] = list(DEFAULT_POOL_LABEL_KEYS)
    """Node labels that name a node's pool, tried in order; the catalog's selectors are tried first."""
    catalog: list[NodePool] = []
    """Pools the platform team describes (they may scale from zero)."""

    @field_validator("allowed_regions")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("regions must be unique")
        return value


def load_policy(source: str | dict[str, Any]) -> ClusterPolicy:
    """Read a policy from YAML text or a parsed mapping; errors name the field (and pool)."""
    from .pools import CatalogError, load_catalog

    if isinstance(source, str):
        try:
            document = yaml.safe_load(source)
        except yaml.YAMLError as error:
            raise PolicyError(f"policy: not valid YAML: {error}") from None
    else:
        document = source
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise PolicyError("policy: must be a mapping")
    document = dict(document)
    # The catalog goes through the catalog loader, so pool errors read the same everywhere.
    pools_key = "catalog" if "catalog" in document else "pools" if "pools" in document else None
    pools: list[NodePool] = []
    if pools_key is not None:
        try:
            keys = document.get("poolLabelKeys", document.get("pool_label_keys")) or DEFAULT_POOL_LABEL_KEYS
            pools = load_catalog({"pools": document.pop(pools_key) or []}, default_pool_label_key=str(keys[0]))
        except CatalogError as error:
            raise PolicyError(f"policy.{pools_key}: {error}") from None
    try:
        policy = ClusterPolicy.model_validate(document)
    except ValidationError as error:
        first = error.errors(include_url=False)
        problems = "; ".join(
            f"{'.'.join(str(p) for p in item['loc']) or '(root)'}: "
            + ("unknown field" if item["type"] == "extra_forbidden" else item["msg"])
            for item in first
        )
        raise PolicyError(f"policy: {problems}") from None
    return policy.model_copy(update={"catalog": pools})
