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
from typing import Hashable, Iterable, Sequence

from .nodepool import NodePool


@dataclass(frozen=True)
class Claim:
    """GPUs an attempt will hold on a pool that the nodes do not show as used yet."""

    pool: str
    nodes: int
    gpus_per_node: int


def with_claims(pools: Sequence[NodePool], claims: Iterable[Claim]) -> list[NodePool]:
    """The pools with each claim's GPUs taken off their free GPUs (never below zero), and what
    found no free GPUs counted as the pool's queue (`queued_gpus`)."""
    by_pool: dict[str, list[Claim]] = {}
    for claim in claims:
        by_pool.setdefault(claim.pool, []).append(claim)
    adjusted = []
    for pool in pools:
        claims_here = by_pool.get(pool.name)
        if not claims_here or pool.free_gpus is None:
            adjusted.append(pool)  # unknown stays unknown: nothing to take off
            continue
        queued = 0
        if pool.free_gpus_per_node:
            free = sorted(pool.free_gpus_per_node, reverse=True)
            for claim in claims_here:
                for _ in range(claim.nodes):
                    free, placed = _place(free, claim.gpus_per_node)
                    queued += 0 if placed else claim.gpus_per_node
            adjusted.append(pool.model_copy(update={"free_gpus": sum(free), "free_gpus_per_node": free,
                                                    "queued_gpus": pool.queued_gpus + queued}))
        else:
            asked = sum(c.nodes * c.gpus_per_node for c in claims_here)
            adjusted.append(pool.model_copy(update={"free_gpus": max(0, pool.free_gpus - asked),
                                                    "queued_gpus": pool.queued_gpus + max(0, asked - pool.free_gpus)}))
    return adjusted


def _place(free: list[int], gpus: int) -> tuple[list[int], bool]:
    """Take `gpus` off the node that fits them with the most free GPUs (or the fullest one, when
    none fits: the replica waits, and what it asks is still not free for others). Returns the
    free GPUs per node and whether the replica fitted."""
    if not free:
        return free, False
    fitting = [i for i, f in enumerate(free) if f >= gpus]
    index = fitting[0] if fitting else 0
    result = list(free)
    result[index] = max(0, result[index] - gpus)
    return sorted(result, reverse=True), bool(fitting)


@dataclass(frozen=True)
class Waiting:
    """An attempt whose pods wait for a node: its claim, where the job may run, how long it waited."""

    key: Hashable
    claim: Claim
    regions: frozenset[str]
    waited_seconds: float


def movers(pools: Sequence[NodePool], waiting: Iterable[Waiting], *, min_wait_seconds: float) -> list[Hashable]:
    """The waiting attempts worth looking at now because another pool in their regions has room:
    for each pool with free GPUs (claims already taken off, `with_claims`), the longest waiting
    attempts of other pools that have waited `min_wait_seconds` (the policy's bound before a move)
    and whose shape fits, as many as its free GPUs take. The lifecycle decides the move itself;
    this only says whom to wake, so GPUs freed in Paris do not idle while Berlin's line waits for
    its next resync."""
    free = {p.name: sorted(p.free_gpus_per_node or ([p.free_gpus] if p.free_gpus else []), reverse=True)
            for p in pools if p.free_gpus}
    if not free:
        return []
    region_of = {p.name: p.region for p in pools}
    woken: list[Hashable] = []
    for item in sorted(waiting, key=lambda w: -w.waited_seconds):
        if item.waited_seconds < min_wait_seconds:
            break
        for name, left in free.items():
            if name == item.claim.pool or region_of[name] not in item.regions:
                continue
            trial = left
            placed = True
            for _ in range(item.claim.nodes):
                trial, fitted = _place(trial, item.claim.gpus_per_node)
                placed = placed and fitted
            if placed:
                free[name] = trial
                woken.append(item.key)
                break
    return woken
