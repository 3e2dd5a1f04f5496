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
from pydantic import BaseModel, ConfigDict, Field, ValidationError
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
    free_gpus_per_node: list[int] = []
    """Free GPUs of each node up now, most first (discovery fills it; empty: only the total is known)."""
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

    def fits_now(self, nodes: int, gpus_per_node: int) -> bool:
        """Whether `nodes` nodes with `gpus_per_node` free GPUs each are up now (no scale-up needed)."""
        if self.free_gpus_per_node:
            return sum(1 for free in self.free_gpus_per_node if free >= gpus_per_node) >= nodes
        # Only the total is known: assume it is where it is needed.
        return self.free_gpus is not None and self.free_gpus >= nodes * gpus_per_node


# ---------------------------------------------------------------------------
# Quantities
# ---------------------------------------------------------------------------

_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P|m)?\s*$")
_FACTORS = {
    None: 1, "m": 0.001, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}


def parse_quantity(value: object) -> float:
    """A Kubernetes quantity ("2113523516Ki", "1800Gi", "192", "500m") as a number."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"not a quantity: {value!r}")
    match = _QUANTITY.match(value)
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r} (e.g. 80Gi, 2Ti, 192)")
    return float(match.group(1)) * _FACTORS[match.group(2)]


# ---------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------


class CatalogError(ValueError):
    """A catalog that cannot be used. The message names the pool and the field."""


# Catalog conveniences that are not NodePool fields: quantities a person writes.
_QUANTITY_FIELDS = {"gpuMemory": "gpuMemoryBytes", "hostMemory": "hostMemoryBytes"}


def _pool_label(index: int, entry: Any) -> str:
    name = entry.get("name") if isinstance(entry, dict) else None
    return f"pool {name!r} (pools[{index}])" if isinstance(name, str) and name else f"pools[{index}]"


def _catalog_entries(document: Any) -> list[Any]:
    if document is None:
        return []
    if isinstance(document, list):
        return document
    if isinstance(document, dict):
        pools = document.get("pools", document.get("catalog"))
        if pools is None:
            raise CatalogError("catalog: expected a 'pools' list")
        if not isinstance(pools, list):
            raise CatalogError("pools: must be a list of pools")
        return pools
    raise CatalogError("catalog: must be a mapping with a 'pools' list, or a list of pools")


def load_catalog(
    source: str | dict[str, Any] | list[Any], *, default_pool_label_key: str = "karpenter.sh/nodepool"
) -> list[NodePool]:
    """Pools from catalog YAML text or its parsed form (`{pools: [...]}` or a bare list).

    Each pool's fields are NodePool's, camelCase (`gpuType`, `gpusPerNode`, `maxNodes`,
    `pricePerGpuHour`, ...). `gpuMemory` and `hostMemory` may be given as quantities
    (`80Gi`, `2Ti`). A known GPU type fills in its memory; an unknown one needs `gpuMemory`.
    A pool without `selector` is selected by `{default_pool_label_key: name}`.
    """
    if isinstance(source, str):
        try:
            source = yaml.safe_load(source)
        except yaml.YAMLError as error:
            raise CatalogError(f"catalog: not valid YAML: {error}") from None
    entries = _catalog_entries(source)
    pools: list[NodePool] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(entries):
        where = _pool_label(index, entry)
        if not isinstance(entry, dict):
            raise CatalogError(f"{where}: must be a mapping of pool fields")
        pool = _pool_from_entry(where, dict(entry), default_pool_label_key)
        if pool.name in seen:
            raise CatalogError(f"{where}: name: duplicate of pools[{seen[pool.name]}]; pool names must be unique")
        seen[pool.name] = index
        pools.append(pool)
    return pools


def _pool_from_entry(where: str, entry: dict[str, Any], default_pool_label_key: str) -> NodePool:
    for short, long in _QUANTITY_FIELDS.items():
        if short in entry:
            if long in entry:
                raise CatalogError(f"{where}: {short}: give {short} or {long}, not both")
            try:
                entry[long] = int(parse_quantity(entry.pop(short)))
            except ValueError as error:
                raise CatalogError(f"{where}: {short}: {error}") from None
    gpu_type = entry.get("gpuType", entry.get("gpu_type"))
    if isinstance(gpu_type, str):
        info = gpu_type_info(gpu_type)
        if info is not None:
            entry["gpuType" if "gpuType" in entry else "gpu_type"] = info.name
            if "gpuMemoryBytes" not in entry and "gpu_memory_bytes" not in entry:
                entry["gpuMemoryBytes"] = info.memory_bytes
        elif "gpuMemoryBytes" not in entry and "gpu_memory_bytes" not in entry:
            known = ", ".join(g.name for g in _CANONICAL)
            raise CatalogError(
                f"{where}: gpuType: unknown GPU type {gpu_type!r} and no gpuMemory given;"
                f" give gpuMemory (e.g. 192Gi) or use a known type ({known})"
            )
    entry.setdefault("source", "catalog")
    if "selector" not in entry and isinstance(entry.get("name"), str):
        # Pods must be pinned to the pool; the pool's name under the platform's pool label is the usual way.
        entry["selector"] = {default_pool_label_key: entry["name"]}
    if "intraNode" not in entry and "intra_node" not in entry and isinstance(gpu_type, str):
        info = gpu_type_info(gpu_type)
        entry["intraNode"] = "nvlink" if info is None or info.nvlink else "pcie"
    try:
        return NodePool.model_validate(entry)
    except ValidationError as error:
        problems = []
        for item in error.errors(include_url=False):
            field = ".".join(str(p) for p in item["loc"]) or "(pool)"
            message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
            if item["type"] == "missing":
                message = "required field is missing"
            elif item["type"] == "string_pattern_mismatch" and field == "name":
                message = "must be a DNS-1123 label (lower-case letters, digits and '-'), as Kubernetes names pools"
            problems.append(f"{field}: {message}")
        raise CatalogError(f"{where}: " + "; ".join(problems)) from None


# ---------------------------------------------------------------------------
# Discovery from Node and Pod objects
# ---------------------------------------------------------------------------

GPU_RESOURCE = "nvidia.com/gpu"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_MEMORY = "nvidia.com/gpu.memory"  # MiB
GFD_COUNT = "nvidia.com/gpu.count"
# Taints the node lifecycle controller sets for a while; they say nothing about the pool.
_TRANSIENT_TAINT_PREFIXES = ("node.kubernetes.io/", "node.cloudprovider.kubernetes.io/", "ToBeDeletedByClusterAutoscaler",
                             "karpenter.sh/disrupted", "karpenter.sh/disruption")


def _get(obj: Any, *names: str) -> Any:
    """obj[name] for the first name present (the API's camelCase or the client's snake_case)."""
    if not isinstance(obj, Mapping):
        return None
    for name in names:
        if name in obj and obj[name] is not None:
            return obj[name]
    return None


# Objects come from the API, but a partial or odd object must not crash discovery: read each
# level as the type it should have, and treat anything else as absent.
def _map(obj: Any, *names: str) -> Mapping[str, Any]:
    value = _get(obj, *names)
    return value if isinstance(value, Mapping) else {}


def _list(obj: Any, *names: str) -> list[Any]:
    value = _get(obj, *names)
    return value if isinstance(value, list) else []


def _str(obj: Any, *names: str) -> str | None:
    value = _get(obj, *names)
    return value if isinstance(value, str) else None


def _labels(meta: Mapping[str, Any]) -> dict[str, str]:
    return {k: v for k, v in _map(meta, "labels").items() if isinstance(k, str) and isinstance(v, str)}


def _count(value: Any) -> int:
    try:
        return int(parse_quantity(value)) if value is not None else 0
    except ValueError:
        return 0


@dataclass(frozen=True)
class SkippedNode:
    """A node discovery left out, and why (shown by the operator's logs and `plan --explain`)."""

    node: str
    reason: str


@dataclass(frozen=True)
class Discovery:
    pools: list[NodePool]
    skipped: list[SkippedNode]


def _node_ready(node: Mapping[str, Any]) -> bool:
    for condition in _list(_map(node, "status"), "conditions"):
        if _get(condition, "type") == "Ready":
            return _get(condition, "status") == "True"
    return False


def _pod_gpu_request(pod: Mapping[str, Any]) -> int:
    """GPUs a pod holds on its node: the larger of its containers' sum and its biggest init container."""
    spec = _map(pod, "spec")

    def gpus(container: Any) -> int:
        resources = _map(container, "resources")
        # For extended resources a request defaults to the limit, and they must be equal when both are set.
        value = _get(_map(resources, "requests"), GPU_RESOURCE)
        if value is None:
            value = _get(_map(resources, "limits"), GPU_RESOURCE)
        return _count(value)

    main = sum(gpus(c) for c in _list(spec, "containers"))
    init = max((gpus(c) for c in _list(spec, "initContainers", "init_containers")), default=0)
    return max(main, init)


def _gpus_in_use(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    used: dict[str, int] = {}
    for pod in pods:
        node = _str(_map(pod, "spec"), "nodeName", "node_name")
        phase = _get(_map(pod, "status"), "phase")
        if not node or phase in ("Succeeded", "Failed"):
            continue
        used[node] = used.get(node, 0) + _pod_gpu_request(pod)
    return used


def _sanitize_pool_name(value: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-")
    return name or "pool"


@dataclass
class _NodeFacts:
    name: str
    pool_key: str  # label key that named the pool ("" when a catalog selector matched)
    pool_name: str
    selector: dict[str, str]
    region: str
    zone: str | None
    gpu_type: str
    gpu_memory_bytes: int
    gpus: int
    free: int
    host_memory_bytes: int
    cpus: int
    taints: tuple[Taint, ...]


def discover(
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    policy: Any,
) -> Discovery:
    """Pools as the Node objects show them now, with free GPUs, and the nodes left out and why.

    `policy` is a ClusterPolicy (region/zone label keys, pool label keys, the catalog whose
    selectors name pools first).
    """
    used = _gpus_in_use(pods)
    catalog: list[NodePool] = list(getattr(policy, "catalog", []) or [])
    pool_keys: list[str] = list(getattr(policy, "pool_label_keys", []) or [])
    region_key: str = policy.region_label_key
    zone_key: str = getattr(policy, "zone_label_key", "topology.kubernetes.io/zone")
    facts: list[_NodeFacts] = []
    skipped: list[SkippedNode] = []
    for node in nodes:
        meta = _map(node, "metadata")
        name = _str(meta, "name") or "?"
        labels = _labels(meta)
        spec = _map(node, "spec")
        allocatable = _map(_map(node, "status"), "allocatable")
        gpus = _count(allocatable.get(GPU_RESOURCE))
        product = labels.get(GFD_PRODUCT)
        if gpus <= 0 and not product:
            continue  # not a GPU node: nothing to say about it
        if _get(spec, "unschedulable"):
            skipped.append(SkippedNode(name, "cordoned (spec.unschedulable)"))
            continue
        if not _node_ready(node):
            skipped.append(SkippedNode(name, "not Ready"))
            continue
        if gpus <= 0:
            skipped.append(SkippedNode(name, f"no allocatable {GPU_RESOURCE} (device plugin not running?)"))
            continue
        region = labels.get(region_key)
        if not region:
            skipped.append(SkippedNode(name, f"no region label {region_key}"))
            continue
        if not product:
            skipped.append(SkippedNode(name, f"no {GFD_PRODUCT} label (GPU Feature Discovery not running?)"))
            continue
        info = gpu_type_info(product)
        memory_bytes = None
        if labels.get(GFD_MEMORY, "").isdigit():
            memory_bytes = int(labels[GFD_MEMORY]) * MiB
        if info is None and memory_bytes is None:
            skipped.append(SkippedNode(name, f"unknown GPU {product!r} and no {GFD_MEMORY} label"))
            continue
        if "-MIG-" in product.upper():
            skipped.append(SkippedNode(name, f"MIG slices ({product}) are not planned for training"))
            continue
        gpu_type = info.name if info else _sanitize_pool_name(product).upper()
        memory_bytes = memory_bytes or info.memory_bytes  # type: ignore[union-attr]
        # A catalog selector wins: it is how the platform team names its pools.
        match = next((p for p in catalog if p.selector and all(labels.get(k) == v for k, v in p.selector.items())), None)
        if match is not None:
            pool_key, pool_name, selector = "", match.name, dict(match.selector)
        else:
            key = next((k for k in pool_keys if labels.get(k)), None)
            if key is None:
                skipped.append(SkippedNode(name, "no pool label (" + ", ".join(pool_keys) + ")"))
                continue
            pool_key, pool_name, selector = key, _sanitize_pool_name(labels[key]), {key: labels[key]}
        host_memory = _count(allocatable.get("memory"))
        cpus = _count(allocatable.get("cpu"))
        taints = tuple(
            Taint(key=key, value=_str(t, "value"), effect=effect)
            for t in _list(spec, "taints")
            if (key := _str(t, "key")) and not key.startswith(_TRANSIENT_TAINT_PREFIXES)
            and (effect := _str(t, "effect") or "NoSchedule") in ("NoSchedule", "PreferNoSchedule", "NoExecute")
        )
        facts.append(
            _NodeFacts(
                name=name, pool_key=pool_key, pool_name=pool_name, selector=selector, region=region,
                zone=labels.get(zone_key), gpu_type=gpu_type, gpu_memory_bytes=memory_bytes, gpus=gpus,
                free=max(0, gpus - used.get(name, 0)), host_memory_bytes=host_memory, cpus=cpus, taints=taints,
            )
        )
    catalog_regions = {p.name: p.region for p in catalog}
    return Discovery(pools=_group(facts, region_key, catalog_regions), skipped=skipped)


def _group(facts: list[_NodeFacts], region_key: str, catalog_regions: Mapping[str, str]) -> list[NodePool]:
    groups: dict[tuple[str, str, str], list[_NodeFacts]] = {}
    for f in facts:
        groups.setdefault((f.pool_name, f.region, f.gpu_type), []).append(f)
    names_seen: dict[str, int] = {}
    regions_seen: dict[tuple[str, str], int] = {}
    for pool_name, region, _ in groups:
        names_seen[pool_name] = names_seen.get(pool_name, 0) + 1
        regions_seen[(pool_name, region)] = regions_seen.get((pool_name, region), 0) + 1
    pools: list[NodePool] = []
    for (pool_name, region, gpu_type), members in sorted(groups.items()):
        first = members[0]
        selector = dict(first.selector)
        name = pool_name
        if names_seen[pool_name] > 1 and not (catalog_regions.get(pool_name) == region
                                              and regions_seen[(pool_name, region)] == 1):
            # One pool label spanning regions or GPU types: split it, and pin each part by region too.
            # The part the catalog describes (its name, its region) keeps the name.
            suffix = region if regions_seen[(pool_name, region)] == 1 else f"{region}-{gpu_type}"
            name = _sanitize_pool_name(f"{pool_name}-{suffix}")
            selector[region_key] = region
        info = gpu_type_info(gpu_type)
        # Nodes of a pool may differ slightly (allocatable after system reservations): plan to the smallest.
        pools.append(
            NodePool(
                name=name,
                region=region,
                zones=sorted({f.zone for f in members if f.zone}),
                gpu_type=gpu_type,
                gpu_memory_bytes=min(f.gpu_memory_bytes for f in members),
                gpus_per_node=min(max(f.gpus for f in members), 64),
                max_nodes=len(members),
                free_gpus=sum(f.free for f in members),
                free_gpus_per_node=sorted((f.free for f in members), reverse=True),
                nodes_now=len(members),
                intra_node="nvlink" if info is None or info.nvlink else "pcie",
                host_memory_bytes=min(f.host_memory_bytes for f in members),
                cpus=min(f.cpus for f in members),
                selector=selector,
                taints=list(first.taints),
                source="discovered",
            )
        )
    return pools


def discover_pools(nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], policy: Any) -> list[NodePool]:
    """Pools as the Node objects show them now (see `discover` for the nodes left out)."""
    return discover(nodes, pods, policy).pools


def merge_pools(catalog: Sequence[NodePool], discovered: Sequence[NodePool]) -> list[NodePool]:
    """One list of pools: catalog facts (price, ceiling, interconnect) plus what discovery sees now.

    A discovered pool matches a catalog pool of the same name and region. The hardware
    the nodes report (GPU type, memory, GPUs per node) wins over the catalog's; the
    ceiling is at least the nodes up now. Discovered pools without a catalog entry
    are kept (no price, ceiling = nodes up now).
    """
    by_key = {(p.name, p.region): p for p in discovered}
    merged: list[NodePool] = []
    for pool in catalog:
        seen = by_key.pop((pool.name, pool.region), None)
        if seen is None:
            merged.append(pool)
            continue
        merged.append(
            pool.model_copy(
                update={
                    "zones": sorted(set(pool.zones) | set(seen.zones)),
                    "gpu_type": seen.gpu_type,
                    "gpu_memory_bytes": seen.gpu_memory_bytes,
                    "gpus_per_node": seen.gpus_per_node,
                    "max_nodes": max(pool.max_nodes, seen.nodes_now),
                    "free_gpus": seen.free_gpus,
                    "free_gpus_per_node": seen.free_gpus_per_node,
                    "nodes_now": seen.nodes_now,
                    "host_memory_bytes": seen.host_memory_bytes or pool.host_memory_bytes,
                    "cpus": seen.cpus or pool.cpus,
                    "taints": pool.taints or seen.taints,
                    "source": "both",
                }
            )
        )
    # Nodes that carry a catalog pool's label in another region (a misconfiguration, or a pool
    # the catalog does not know there) stay a pool of their own, under a name of their own:
    # plans and recovery tell pools apart by name. The region pin comes from the plan's region.
    taken = {p.name for p in merged}
    for pool in discovered:
        if (pool.name, pool.region) not in by_key:
            continue
        name = pool.name
        if name in taken:
            name = _sanitize_pool_name(f"{pool.name}-{pool.region}")
        taken.add(name)
        merged.append(pool if name == pool.name else pool.model_copy(update={"name": name}))
    return merged
