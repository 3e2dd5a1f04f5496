"""The catalog: the node pools the platform team describes (they may scale from zero, so
nothing in the cluster shows them until a job needs them)."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from .gpus import CANONICAL_TYPES, gpu_type_info
from .nodepool import NodePool
from .quantities import QuantityError, quantity_bytes


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
    (`80Gi`, `2Ti`, `1e12`). A known GPU type fills in its memory and how its nodes are
    labelled (`gpuLabel`: GPU Feature Discovery's `nvidia.com/gpu.product` with the values GFD
    writes for it); an unknown one needs `gpuMemory` and `gpuLabel.values`.
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
                entry[long] = quantity_bytes(entry.pop(short), short)
            except QuantityError as error:
                raise CatalogError(f"{where}: {error}") from None
    gpu_type = entry.get("gpuType", entry.get("gpu_type"))
    if isinstance(gpu_type, str):
        info = gpu_type_info(gpu_type)
        if info is not None:
            entry["gpuType" if "gpuType" in entry else "gpu_type"] = info.name
            if "gpuMemoryBytes" not in entry and "gpu_memory_bytes" not in entry:
                entry["gpuMemoryBytes"] = info.memory_bytes
        elif "gpuMemoryBytes" not in entry and "gpu_memory_bytes" not in entry:
            known = ", ".join(g.name for g in CANONICAL_TYPES)
            raise CatalogError(
                f"{where}: gpuType: unknown GPU type {gpu_type!r} and no gpuMemory given;"
                f" give gpuMemory (e.g. 192Gi) or use a known type ({known})"
            )
        if "gpuLabel" not in entry and "gpu_label" not in entry:
            # Every pool must say how its nodes name the GPU: the pods are pinned to it. A known
            # type says it through the GPU table (the model fills it in); an unknown one cannot.
            entry["gpuLabel"] = {}
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
            elif item["type"] == "value_error":
                message = message.removeprefix("Value error, ")
            problems.append(f"{field}: {message}")
        raise CatalogError(f"{where}: " + "; ".join(problems)) from None
