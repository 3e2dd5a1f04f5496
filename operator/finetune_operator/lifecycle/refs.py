"""The objects of an attempt, as references to delete: its training job, ConfigMap and NetworkPolicy."""

from __future__ import annotations

from ..children import Child
from .types import ObjectRef, Observed


def network_policy_ref(name: str) -> ObjectRef:
    """An attempt's NetworkPolicy (rendering/network.py), named like the attempt."""
    return ObjectRef("networking.k8s.io/v1", "NetworkPolicy", name)


def child_refs(child: Child) -> list[ObjectRef]:
    return [ObjectRef(child.api_version, child.kind, child.name), ObjectRef("v1", "ConfigMap", child.name),
            network_policy_ref(child.name)]


def attempt_refs(observed: Observed, name: str) -> list[ObjectRef]:
    """The objects of the attempt named `name`: its training job, of the kind it was created as (of
    every served kind when no child of that name is seen), its ConfigMap and its NetworkPolicy."""
    kinds = {(c.api_version, c.kind) for c in observed.children if c.name == name}
    kinds = kinds or {(b.api_version, b.kind) for b in observed.backends}
    return [ObjectRef(version, kind, name) for version, kind in sorted(kinds)] + [
        ObjectRef("v1", "ConfigMap", name), network_policy_ref(name)]
