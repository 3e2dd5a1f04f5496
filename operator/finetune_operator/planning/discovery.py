"""Discovery: pools as the Node objects show them now (free GPUs, nodes up), and the merge
of what discovery sees with what the catalog says.

Pure code: Node and Pod objects come in as plain dicts (`.to_dict()` of the kubernetes
client, or the API's JSON); both snake_case and camelCase keys are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .gpus import GFD_MEMORY, GFD_PRODUCT, GPU_RESOURCE, gpu_type_info, same_gpu_type
from .nodepool import MiB, GpuLabel, NodePool, Taint, pool_name_from
from .quantities import QuantityError, quantity_bytes, quantity_count

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
        if value is None:
            return 0
        try:
            return quantity_count(value, GPU_RESOURCE)
        except QuantityError:
            return 0  # the API server validates quantities: only a malformed object gets here

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


@dataclass(frozen=True)
class _Allocatable:
    gpus: int
    host_memory_bytes: int  # 0: not reported
    cpus: int  # 0: not reported


def _allocatable(status: Mapping[str, Any]) -> _Allocatable:
    """The node's allocatable GPUs, memory and CPUs; QuantityError names the field at fault."""
    allocatable = _map(status, "allocatable")

    def read(key: str, convert: Any) -> int:
        value = allocatable.get(key)
        return 0 if value is None else convert(value, f"status.allocatable[{key}]")

    return _Allocatable(read(GPU_RESOURCE, quantity_count), read("memory", quantity_bytes), read("cpu", quantity_count))


@dataclass
class _NodeFacts:
    name: str
    pool_name: str
    selector: dict[str, str]
    region: str
    zone: str | None
    product: str  # the node's GPU product label, as it is
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
        product = labels.get(GFD_PRODUCT)
        try:
            allocatable = _allocatable(_map(node, "status"))
        except QuantityError as error:
            if product or _reports_gpus(node):
                skipped.append(SkippedNode(name, str(error)))
            continue
        gpus = allocatable.gpus
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
        gpu_type = info.name if info else pool_name_from(product).upper()
        memory_bytes = memory_bytes or info.memory_bytes  # type: ignore[union-attr]
        # A catalog selector wins: it is how the platform team names its pools.
        match = next((p for p in catalog if p.selector and all(labels.get(k) == v for k, v in p.selector.items())), None)
        if match is not None:
            pool_name, selector = match.name, dict(match.selector)
        else:
            key = next((k for k in pool_keys if labels.get(k)), None)
            if key is None:
                skipped.append(SkippedNode(name, "no pool label (" + ", ".join(pool_keys) + ")"))
                continue
            pool_name, selector = pool_name_from(labels[key]), {key: labels[key]}
        taints = tuple(
            Taint(key=key, value=_str(t, "value"), effect=effect)
            for t in _list(spec, "taints")
            if (key := _str(t, "key")) and not key.startswith(_TRANSIENT_TAINT_PREFIXES)
            and (effect := _str(t, "effect") or "NoSchedule") in ("NoSchedule", "PreferNoSchedule", "NoExecute")
        )
        facts.append(
            _NodeFacts(
                name=name, pool_name=pool_name, selector=selector, region=region, zone=labels.get(zone_key),
                product=product, gpu_type=gpu_type, gpu_memory_bytes=memory_bytes, gpus=gpus,
                free=max(0, gpus - used.get(name, 0)), host_memory_bytes=allocatable.host_memory_bytes,
                cpus=allocatable.cpus, taints=taints,
            )
        )
    return Discovery(pools=_group(facts, region_key, catalog), skipped=skipped)


def _reports_gpus(node: Mapping[str, Any]) -> bool:
    """Whether the node reports any allocatable GPUs at all (even as a value that cannot be read)."""
    return _get(_map(_map(node, "status"), "allocatable"), GPU_RESOURCE) is not None


def _group(facts: list[_NodeFacts], region_key: str, catalog: Sequence[NodePool]) -> list[NodePool]:
    """One pool per pool label (name and selector), region and GPU type.

    A pool label that spans regions or GPU types is split. Every part is pinned by what sets
    it apart: its region (a region label in its selector) and, when the label spans GPU types
    in one region, its GPU product (the product label in its selector, when its nodes share
    one spelling of it). Whatever the selector says, every part's `gpu_label` lists the
    product values of its own nodes only, and the pods of a plan require it: no node of
    one part is selected by another. The part the catalog describes (its name, its region, and
    its GPU type where the label spans types) keeps the name; the others are named after what
    sets them apart. Labels that differ but read as one name (`GPU_Group.A`, `gpu-group-a`)
    stay apart too, the later one numbered.
    """
    Label = tuple[str, tuple[tuple[str, str], ...]]  # pool name, selector
    groups: dict[tuple[Label, str, str], list[_NodeFacts]] = {}
    for f in facts:
        label = (f.pool_name, tuple(sorted(f.selector.items())))
        groups.setdefault((label, f.region, f.gpu_type), []).append(f)
    regions_of: dict[Label, set[str]] = {}
    types_of: dict[tuple[Label, str], set[str]] = {}
    for label, region, gpu_type in groups:
        regions_of.setdefault(label, set()).add(region)
        types_of.setdefault((label, region), set()).add(gpu_type)
    described = {p.name: p for p in catalog}

    def catalogs_part(label: Label, region: str, gpu_type: str) -> bool:
        # Its name, selector and region, and its GPU type when the label spans types there (when
        # it does not, the nodes' hardware wins over the catalog's, as in merge_pools).
        entry = described.get(label[0])
        return (
            entry is not None
            and tuple(sorted(entry.selector.items())) == label[1]
            and entry.region == region
            and (len(types_of[(label, region)]) == 1 or same_gpu_type(entry.gpu_type, gpu_type))
        )

    pools: list[NodePool] = []
    taken: set[str] = set()
    # The catalog's parts first: they keep their names whatever else reads the same.
    for (label, region, gpu_type), members in sorted(groups.items(), key=lambda g: (not catalogs_part(*g[0]), g[0])):
        pool_name = label[0]
        selector = dict(label[1])
        products = sorted({f.product for f in members})
        split_by_region = len(regions_of[label]) > 1
        split_by_type = len(types_of[(label, region)]) > 1
        if split_by_region:
            selector[region_key] = region
        if split_by_type and len(products) == 1:
            selector[GFD_PRODUCT] = products[0]
        name = pool_name
        if (split_by_region or split_by_type) and not catalogs_part(label, region, gpu_type):
            name = pool_name_from(f"{pool_name}-{region}-{gpu_type}" if split_by_type else f"{pool_name}-{region}")
        name = _unique(name, taken)
        first = members[0]
        info = gpu_type_info(gpu_type)
        # Nodes of a pool may differ slightly (allocatable after system reservations): plan to the smallest.
        pools.append(
            NodePool(
                name=name,
                region=region,
                zones=sorted({f.zone for f in members if f.zone}),
                gpu_type=gpu_type,
                gpu_label=GpuLabel(key=GFD_PRODUCT, values=products),
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
    return sorted(pools, key=lambda p: p.name)


def _unique(name: str, taken: set[str]) -> str:
    """`name`, or `name-2`, `name-3`, ... when a part named after the same words exists (names are cut at 63)."""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        suffix = f"-{n}"
        candidate = name[: 63 - len(suffix)].rstrip("-") + suffix
    taken.add(candidate)
    return candidate


def discover_pools(nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], policy: Any) -> list[NodePool]:
    """Pools as the Node objects show them now (see `discover` for the nodes left out)."""
    return discover(nodes, pods, policy).pools


def _merged_gpu_label(catalog: NodePool, seen: NodePool) -> GpuLabel | None:
    """The nodes' own GPU label values, plus the catalog's when both speak of the same GPU type
    under the same label (nodes yet to scale up may carry another spelling the catalog knows)."""
    if (
        catalog.gpu_label is not None
        and seen.gpu_label is not None
        and catalog.gpu_label.key == seen.gpu_label.key
        and same_gpu_type(catalog.gpu_type, seen.gpu_type)
    ):
        return GpuLabel(key=seen.gpu_label.key, values=sorted(set(catalog.gpu_label.values) | set(seen.gpu_label.values)))
    return seen.gpu_label


def merge_pools(catalog: Sequence[NodePool], discovered: Sequence[NodePool]) -> list[NodePool]:
    """One list of pools: catalog facts (price, ceiling, interconnect) plus what discovery sees now.

    A discovered pool matches a catalog pool of the same name and region. The hardware
    the nodes report (GPU type, memory, GPUs per node, the GPU label) wins over the catalog's;
    the ceiling is at least the nodes up now. Discovered pools without a catalog entry
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
                    "gpu_label": _merged_gpu_label(pool, seen),
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
            name = pool_name_from(f"{pool.name}-{pool.region}")
        name = _unique(name, taken)
        merged.append(pool if name == pool.name else pool.model_copy(update={"name": name}))
    return merged
