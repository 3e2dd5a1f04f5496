"""Free capacity that counts what is already asked for.

Discovery sees the GPUs that nodes offer minus those that pods *bound* to them request. That
misses demand the planner itself just created: an attempt planned a moment ago whose pods do
not exist yet, or exist but wait for the scheduler. Without it every job planned in the same
few seconds sees the same free GPUs and all of them pile onto one pool.

A `Claim` is such demand: the GPUs of an attempt whose pods are not (yet) counted on nodes.
`with_claims` takes them off the pools' free GPUs, node by node as the scheduler would place
them (each replica on the node with the most free GPUs that still fits it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .nodepool import NodePool


@dataclass(frozen=True)
class Claim:
    """GPUs an attempt will hold on a pool that the nodes do not show as used yet."""

    pool: str
    nodes: int
    gpus_per_node: int


def with_claims(pools: Sequence[NodePool], claims: Iterable[Claim]) -> list[NodePool]:
    """The pools with each claim's GPUs taken off their free GPUs (never below zero)."""
    by_pool: dict[str, list[Claim]] = {}
    for claim in claims:
        by_pool.setdefault(claim.pool, []).append(claim)
    adjusted = []
    for pool in pools:
        claims_here = by_pool.get(pool.name)
        if not claims_here or pool.free_gpus is None:
            adjusted.append(pool)  # unknown stays unknown: nothing to take off
            continue
        if pool.free_gpus_per_node:
            free = sorted(pool.free_gpus_per_node, reverse=True)
            for claim in claims_here:
                for _ in range(claim.nodes):
                    free = _place(free, claim.gpus_per_node)
            adjusted.append(pool.model_copy(update={"free_gpus": sum(free), "free_gpus_per_node": free}))
        else:
            asked = sum(c.nodes * c.gpus_per_node for c in claims_here)
            adjusted.append(pool.model_copy(update={"free_gpus": max(0, pool.free_gpus - asked)}))
    return adjusted


def _place(free: list[int], gpus: int) -> list[int]:
    """Take `gpus` off the node that fits them with the most free GPUs (or the fullest one, when
    none fits: the replica waits, and what it asks is still not free for others)."""
    fitting = [i for i, f in enumerate(free) if f >= gpus]
    index = fitting[0] if fitting else 0
    if not free:
        return free
    result = list(free)
    result[index] = max(0, result[index] - gpus)
    return sorted(result, reverse=True)
