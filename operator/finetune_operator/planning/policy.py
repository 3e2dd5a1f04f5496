"""The cluster policy: what the platform team allows, rendered by the Helm chart into a ConfigMap.

The operator reloads it when the ConfigMap changes. `allowed_regions` is the outer bound
of sovereignty: a job's `placement.regions` can only narrow it.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from ..k8s_names import is_label_value, is_qualified_name
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


_ENDPOINT = re.compile(r"^(https?)://([A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?)(:([0-9]{1,5}))?/?$", re.IGNORECASE)
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_endpoint(url: str) -> str:
    """`scheme://host[:port]` in one spelling: lower case, no default port, no trailing slash.
    Raises ValueError for anything else (a path, user info, a query)."""
    match = _ENDPOINT.match(url.strip())
    if match is None:
        raise ValueError(f"{url!r} is not an endpoint URL of the form http(s)://host[:port]")
    scheme, host = match.group(1).lower(), match.group(2).lower()
    port = int(match.group(5)) if match.group(5) else _DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise ValueError(f"{url!r}: port {port} is out of range")
    return f"{scheme}://{host}" + ("" if port == _DEFAULT_PORTS[scheme] else f":{port}")


class ObjectStorageEndpoint(BaseModel):
    """An S3-compatible endpoint jobs may read from and write to, and where its data lives."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    endpoint: str
    """`https://host[:port]` (or `http://`), as jobs spell it in `s3.endpoint`; compared case-insensitively,
    without a default port or trailing slash."""
    region: str = Field(min_length=1, max_length=63)
    """The region the storage keeps its data in."""
    accessible_from: list[str] = []
    """Regions whose pods may read from and write to it; only `region` when empty. Listing another
    region says that data may be trained on there (and results written back from there)."""

    networks: list[str] = []
    """The address ranges (CIDRs) the endpoint answers from: the attempt's NetworkPolicy allows egress
    to them on the endpoint's port. Empty: to any address on that port (the endpoint's addresses are
    not known to the operator)."""

    @field_validator("endpoint")
    @classmethod
    def _normal(cls, value: str) -> str:
        return normalize_endpoint(value)

    @field_validator("networks")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        return _valid_networks(value)

    @property
    def port(self) -> int:
        scheme, _, rest = self.endpoint.partition("://")
        _, colon, port = rest.rpartition(":")
        return int(port) if colon else _DEFAULT_PORTS[scheme]

    @field_validator("accessible_from")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("regions must be unique")
        return value

    @property
    def usable_regions(self) -> list[str]:
        """Regions whose pods may use it."""
        return list(self.accessible_from) or [self.region]


def _valid_networks(value: list[str]) -> list[str]:
    """CIDRs in their normal spelling (`10.1.2.0/24`); a host address without a prefix is one host."""
    normal = []
    for network in value:
        try:
            normal.append(str(ipaddress.ip_network(network.strip(), strict=False)))
        except ValueError:
            raise ValueError(f"{network!r} is not an address range (CIDR, e.g. 10.20.0.0/16)") from None
    if len(set(normal)) != len(normal):
        raise ValueError("networks must be unique")
    return normal


class Toleration(BaseModel):
    """A toleration as a pod spec writes it (`operator: Exists` with no key tolerates every taint)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """None: every effect."""
    toleration_seconds: int | None = Field(default=None, ge=0)
    """With `NoExecute` only: how long the pod stays once the taint appears."""

    @field_validator("key", "value")
    @classmethod
    def _api_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The API server's rules: a key is `[prefix/]name`, a value a label value."""
        valid = is_qualified_name if info.field_name == "key" else is_label_value
        if value is not None and not valid(value):
            shape = " ([prefix/]name)" if info.field_name == "key" else ""
            raise ValueError(f"{value!r} is not a valid taint {info.field_name}{shape}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("operator Exists takes no value")
        if self.operator == "Equal" and self.key is None:
            raise ValueError("operator Equal needs a key (Exists with no key tolerates every taint)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self

    def to_pod(self) -> dict[str, Any]:
        """As a pod's `tolerations` entry."""
        return self.model_dump(by_alias=True, exclude_none=True)


class ProfilePodSettings(BaseModel):
    """Where profile pods may run (profiling/pod.py). They are CPU-only and need no GPU node: a cluster
    whose CPU nodes are tainted (or whose only nodes in a region are tainted GPU nodes) says here which
    taints they tolerate, and may pin them to some nodes of the job's regions."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    tolerations: list[Toleration] = []
    """The taints a profile pod tolerates. Empty: none (it lands only on untainted nodes)."""
    node_selector: dict[str, str] = {}
    """Node labels a profile pod's node must have, beside the job's regions."""

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not is_qualified_name(key):
                raise ValueError(f"{key!r} is not a valid label key ([prefix/]name)")
            if not is_label_value(label):
                raise ValueError(f"{label!r} (of {key}) is not a valid label value")
        return value


class NetworkPolicySettings(BaseModel):
    """The NetworkPolicy each attempt gets (rendering/network.py)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    enabled: bool = True
    """Render one per attempt. Off: the attempt's pods are bounded only by the namespace's own policies."""
    hub_networks: list[str] = []
    """Where the Hugging Face Hub (or the mirror the cluster routes it to) answers: egress of jobs
    with an `hf` source goes there on `hubPort`. Empty: to any address on that port."""
    hub_port: int = Field(default=443, ge=1, le=65535)
    """The Hub's port."""
    trainer_status_namespace: str = Field(default="kubeflow-system", max_length=63,
                                          pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$")
    """Where Kubeflow Trainer's controller runs: a TrainJob attempt's pods may reach its status
    endpoint (the TrainJobStatus gate) there on `trainerStatusPort`. Empty: no such egress (the
    trainer's POSTs are refused and progress is read from the pod log). Not null: Helm drops a
    null value and the default would come back."""
    trainer_status_port: int = Field(default=10443, ge=1, le=65535)
    """The status endpoint's port on the controller's pods (Trainer's default, 10443)."""

    @field_validator("hub_networks")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        return _valid_networks(value)


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# Where a repository prefix may end inside an image reference: "ghcr.io/org" must not allow
# "ghcr.io/org-evil/trainer".
_REFERENCE_BOUNDARIES = "/:@"


class AllowedImage(BaseModel):
    """Images jobs may name in `spec.image`: those under one repository prefix."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True, use_attribute_docstrings=True
    )

    prefix: str = Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")
    """A registry and repository path, e.g. `registry.internal/ml/` (every repository under it) or
    `registry.internal/ml/trainer` (that repository, any tag). Compared as text: a job must spell
    the registry host as the prefix does (no implicit docker.io)."""
    require_digest: bool = False
    """Only references pinned by digest (`...@sha256:<64 hex>`): a tag can be moved to other content."""

    def matches(self, image: str) -> bool:
        if not image.startswith(self.prefix):
            return False
        rest = image[len(self.prefix):]
        return self.prefix[-1] in _REFERENCE_BOUNDARIES or not rest or rest[0] in _REFERENCE_BOUNDARIES


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
    """Default trainer image: the image of jobs that name none, and always the image of profile pods."""
    allowed_images: list[AllowedImage] = []
    """Images a job may name in `spec.image` besides `trainerImage`. Empty: none (every job runs the
    trainer image). A job naming another image is Invalid, naming `spec.image`."""
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
    hung_after_factor: float = Field(default=4.0, ge=0, le=100)
    """An attempt still running after this many times its predicted time to finish (and at least
    `hungMinSeconds`) is taken as hung (a collective that never returns) and restarted from its
    last checkpoint with the same plan, within maxAttempts. 0 turns it off. Jobs that run by epochs
    of unknown size have no predicted time and no such bound."""
    hung_min_seconds: int = Field(default=3600, ge=60, le=30 * 86400)
    """The least running time before an attempt can be taken as hung."""
    placement_preference: Literal["cost", "startTime"] = "startTime"
    """How the planner trades cost for starting now: `cost` takes the cheapest plan (costs within 1%
    count as equal, then a pool with free GPUs now wins); `startTime` takes a plan whose pool has the
    GPUs free now over a cheaper one that must wait, when it costs at most `startTimeCostMargin` more
    (the plan's reason says so)."""
    start_time_cost_margin: float = Field(default=0.25, ge=0, le=1)
    """With `placementPreference: startTime`, how much more (a fraction) a plan that can start now may cost."""
    pool_label_keys: list[str] = list(DEFAULT_POOL_LABEL_KEYS)
    """Node labels that name a node's pool, tried in order; the catalog's selectors are tried first."""
    catalog: list[NodePool] = []
    """Pools the platform team describes (they may scale from zero)."""
    object_storage: list[ObjectStorageEndpoint] = []
    """S3-compatible endpoints jobs may use for models, data and outputs, each with the region its data
    lives in. An endpoint not listed here is refused (the job is Invalid, naming the field)."""
    network_policy: NetworkPolicySettings = NetworkPolicySettings()
    """The NetworkPolicy each attempt gets: ingress from the attempt's own pods only; egress to them,
    to DNS, and to the Hub and object storage the job uses."""
    profile_pod: ProfilePodSettings = ProfilePodSettings()
    """Where the pre-flight profile's pods may run: the taints they tolerate and the node labels they
    need, beside the job's regions (they run in the operator's namespace, CPU-only)."""
    training_backend: Literal["auto", "pytorchjob", "trainjob"] = "auto"
    """The kind of training job each attempt is: `pytorchjob` (Kubeflow training operator v1), `trainjob`
    (Kubeflow Trainer v2), or `auto`: TrainJob when the API server serves both, else whichever it serves
    (a job that fetches its model or data through an init container takes the PyTorchJob when served).
    A job whose backend the cluster does not serve waits with Planned=False, reason NoTrainingBackend."""
    train_job_runtime: str = Field(default="finetune-torch", min_length=1, max_length=253)
    """The ClusterTrainingRuntime the TrainJobs refer to (the chart's `trainJobRuntime.name`)."""
    default_queue_name: str | None = Field(default=None, min_length=1, max_length=63,
                                           pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
    """A Kueue LocalQueue for jobs without `spec.queueName`: used in each namespace that has a LocalQueue
    of this name (like Kueue's own `default` LocalQueue defaulting); jobs elsewhere run unqueued."""

    @field_validator("allowed_regions")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("regions must be unique")
        return value

    @field_validator("object_storage")
    @classmethod
    def _unique_endpoints(cls, value: list[ObjectStorageEndpoint]) -> list[ObjectStorageEndpoint]:
        endpoints = [e.endpoint for e in value]
        twice = sorted({e for e in endpoints if endpoints.count(e) > 1})
        if twice:
            raise ValueError(f"endpoints listed twice: {', '.join(twice)}")
        return value

    def image_for(self, image: str | None) -> str:
        """The image a job's training pods run: its `spec.image`, else the trainer image."""
        return image or self.trainer_image

    def image_problem(self, image: str) -> str | None:
        """Why a job may not run `image`; None when it may."""
        if image == self.trainer_image:
            return None
        for rule in self.allowed_images:
            if rule.matches(image):
                if rule.require_digest and not _DIGEST.search(image):
                    return (f"{image}: images under {rule.prefix} are allowed only pinned by digest "
                            "(@sha256:<64 hex digits>)")
                return None
        allowed = ", ".join(r.prefix for r in self.allowed_images) or "none"
        return (f"{image} is not an image the cluster policy allows (allowedImages: {allowed}; "
                f"or the trainer image {self.trainer_image})")

    def object_storage_for(self, endpoint: str) -> ObjectStorageEndpoint | None:
        """The policy's entry for an endpoint, however it is spelled; None when not listed."""
        try:
            wanted = normalize_endpoint(endpoint)
        except ValueError:
            return None
        return next((e for e in self.object_storage if e.endpoint == wanted), None)


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
