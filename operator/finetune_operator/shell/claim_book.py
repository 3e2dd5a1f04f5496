"""The claim book: the GPUs each job's current attempt asks for that the nodes may not show yet,
kept between reconciles and read by the planning of other jobs (`Reconciler._commit` notes a
claim under the placement lock; planning/capacity.py nets claims off a pool snapshot).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import lifecycle
from ..children import Child
from ..planning.capacity import Claim
from ..planning.pools import NodePool
from ..rendering.labels import ATTEMPT_LABEL


@dataclass(frozen=True)
class Held:
    """One job's claim, with what wake-ups need: where the job may run and how long it has waited."""

    claim: Claim
    regions: frozenset[str]  # the regions the job may use (spec and policy)
    waiting_since: float | None = None  # time.monotonic() its pods were first seen unbound (None: none yet)
    counted_since: float | None = None  # when discovery's inputs first held all its pods (bound)


class ClaimBook:
    """The GPUs each job's current attempt asks for that the nodes may not show yet (planning/
    capacity.py). Kept from one reconcile of a job to the next, read by the planning of others.
    A claim is noted when the decision is made (before its writes, under the reconciler's placement
    lock, after checking that no claim noted since the plan took the same free GPUs: `Reconciler._commit`),
    and dropped once a pool snapshot made after discovery's inputs held the attempt's bound pods
    counts them: before that the GPUs are missing, after it they would be counted twice.
    After a restart it fills again as every job is reconciled once."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._held.pop(key, None)

    def get(self, key: tuple[str, str]) -> Held | None:
        with self._lock:
            return self._held.get(key)

    def restore(self, key: tuple[str, str], held: Held | None) -> None:
        """Put back what was held before a decision whose writes failed."""
        with self._lock:
            if held is None:
                self._held.pop(key, None)
            else:
                self._held[key] = held

    def others(self, key: tuple[str, str] | None, as_of: float = math.inf) -> list[Claim]:
        """The claims of jobs other than `key` (None: every job) that a pool snapshot taken at
        `as_of` does not count yet."""
        with self._lock:
            return [h.claim for other, h in self._held.items()
                    if other != key and (h.counted_since is None or h.counted_since > as_of)]

    def waiting(self) -> list[tuple[tuple[str, str], Held]]:
        """Jobs whose attempt's pods wait for a node (capacity.movers orders them)."""
        with self._lock:
            return [(k, h) for k, h in self._held.items() if h.waiting_since is not None]

    def note(self, key: tuple[str, str], decision: lifecycle.Decision, current: Child | None,
             pods: list[dict[str, Any]], regions: frozenset[str], counted: Callable[[list[dict[str, Any]]], bool]) -> None:
        """After a decision: does the job's attempt still ask for GPUs discovery may not count?
        `counted(pods)`: whether discovery's inputs hold these bound pods (Cluster.gpu_pods_counted)."""
        status, plan = decision.status, decision.status.plan
        claim = claim_of(decision)
        now = time.monotonic()
        with self._lock:
            previous = self._held.get(key)
            if plan is None or claim is None:
                self._held.pop(key, None)  # nothing asks (claim_of)
                return
            same = previous is not None and previous.claim == claim and not decision.create
            attempt_pods = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL)
                            == str(status.current_attempt)]
            bound = [p for p in attempt_pods if (p.get("spec") or {}).get("nodeName")]
            if decision.create or current is None or len(bound) < plan.nodes:
                # Planned, or pods not all bound: they wait for a node (or for being created).
                waiting = previous.waiting_since if same and previous.waiting_since is not None else None
                if waiting is None and not decision.create and current is not None:
                    waiting = now
                self._held[key] = Held(claim, regions, waiting_since=waiting)
                return
            counted_since = previous.counted_since if same else None
            if counted_since is None and counted(bound):
                counted_since = now
            self._held[key] = Held(claim, regions, counted_since=counted_since)


def claim_of(decision: lifecycle.Decision) -> Claim | None:
    """The GPUs a decision's attempt asks for, or None: nothing asks (no plan, the job ended or is
    suspended), or a queue (Kueue) owns admission."""
    status, plan = decision.status, decision.status.plan
    if plan is None or status.phase in ("Succeeded", "Failed", "Suspended", "Queued", "Pending"):
        return None
    return Claim(plan.node_pool, plan.nodes, plan.gpus_per_node)


def still_fits(decision: lifecycle.Decision, held: Held | None, seen: Sequence[NodePool],
                now: Sequence[NodePool]) -> bool:
    """Whether a decision planned on the free pools `seen` may be noted when the books show `now`:
    GPUs it newly claims as free now (its plan starts without a scale-up) are still free. A plan
    that waits for its pool (a queue, a scale-up) takes no free GPUs: noted as it is, even where
    another claim made the queue longer since (waiting_to_wake and the lifecycle's move of an
    unschedulable attempt look at it again). A decision that keeps the claim its job held, or
    claims nothing, takes nothing new."""
    claim = claim_of(decision)
    if claim is None or (held is not None and held.claim == claim and not decision.create):
        return True
    return not _fits_now(seen, claim) or _fits_now(now, claim)


def _fits_now(pools: Sequence[NodePool], claim: Claim) -> bool:
    pool = next((p for p in pools if p.name == claim.pool), None)
    return pool is not None and pool.fits_now(claim.nodes, claim.gpus_per_node)
