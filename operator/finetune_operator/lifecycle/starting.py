"""An attempt whose training job exists but does not run yet: bounded waits for its pods to be
scheduled (then a move to another pool) and to start."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Sequence

from .. import api
from ..children import Child
from ..planning.plan import Infeasible, Plan
from ..recovery.adjust import failed_runs, learned_calibration, replan_after_loss
from ..recovery.redact import redact
from .conditions import set_condition
from .failures import attempts_left, give_up, max_attempts
from .launch import launch
from .records import attempt_record, update_record
from .refs import child_refs
from .types import RESYNC_SECONDS, Decision, Event, Observed


def waiting_to_start(decision: Decision, observed: Observed, child: Child, queued_job: bool) -> Decision:
    """The child exists but is not running: bounded waits for scheduling and for starting."""
    job, status, now, policy = observed.job, decision.status, observed.now, observed.policy
    generation = job.metadata.generation
    attempt = child.attempt
    record = attempt_record(status, attempt)
    decision.requeue_after = RESYNC_SECONDS
    unschedulable = _unschedulable(observed.pods)
    if unschedulable is not None:
        since, message = unschedulable
        waited = (now - since).total_seconds()
        bound = policy.unschedulable_timeout_seconds
        set_condition(status, api.COND_RUNNING, "False", "Unschedulable",
                      # The time it began, not the seconds since: a message that changed on every look
                      # made every waiting job write its status every resync (bench/scale.py).
                      f"attempt {attempt}: pods unschedulable since {since:%Y-%m-%dT%H:%M:%SZ}: {message}", now,
                      generation)
        if queued_job or waited < bound:
            # A queue owns placement there: report only.
            decision.requeue_after = min(RESYNC_SECONDS, max(1.0, bound - waited)) if not queued_job else RESYNC_SECONDS
            return decision
        return _move_unschedulable(decision, observed, child, message, waited)
    stuck = _not_starting(observed.pods)
    if stuck is not None:
        started = record.start_time if record is not None and record.start_time is not None else now
        waited = (now - started).total_seconds()
        bound = policy.start_timeout_seconds
        set_condition(status, api.COND_RUNNING, "False", "NotStarting",
                      f"attempt {attempt}: pods are not starting after {waited:.0f} s: {stuck}", now, generation)
        if waited >= bound:
            decision.delete += child_refs(child)
            update_record(status, attempt, outcome="ConfigError", end_time=now,
                           message=f"pods did not start within {bound} s: {stuck}")
            return give_up(decision, observed, "ConfigError",
                            f"attempt {attempt}: pods did not start within {bound} s: {stuck}; a retry cannot fix this")
        decision.requeue_after = min(RESYNC_SECONDS, max(1.0, bound - waited))
    return decision


def _move_unschedulable(decision: Decision, observed: Observed, child: Child, message: str, waited: float) -> Decision:
    """Pods found no node past the bound: move the attempt to another pool that fits, or give up."""
    job, status, now = observed.job, decision.status, observed.now
    attempt = child.attempt
    pool = status.plan.node_pool if status.plan is not None else None
    what = f"attempt {attempt}: pods unschedulable for {waited:.0f} s on pool {pool}: {message}"
    others = [p for p in observed.pools if p.name != pool]
    # Pools with room first: a move is worth its place in this pool's line only where the pods can start.
    roomy = [p for p in others if p.free_gpus is None or p.free_gpus > 0]
    here = next((p for p in observed.pools if p.name == pool), None)
    queueing = (here is not None and status.plan is not None and here.free_gpus is not None
                and not here.fits_now(status.plan.nodes, status.plan.gpus_per_node))
    allowed = set(job.spec.placement.regions) & set(observed.policy.allowed_regions)
    # Waiting in a full pool with no room anywhere else it may go: no plan to make (a busy cluster has
    # many such attempts, each looked at every RESYNC_SECONDS).
    result: Plan | Infeasible = Infeasible(message="no pool in the allowed regions has free GPUs")
    if status.plan is not None and (not queueing or any(p.region in allowed for p in roomy)):
        # The same settings elsewhere first (they were chosen for a reason), then a fresh plan.
        result = replan_after_loss(job.spec, status.plan, failed=failed_runs(status.attempts),
                                   calibration=learned_calibration(status.attempts), pools=roomy or others,
                                   policy=observed.policy, architecture=observed.architecture)
    elif status.plan is None:
        result = Infeasible(message="no plan recorded")
    if queueing and (isinstance(result, Infeasible) or not result.free_now):
        # The pool is full of other jobs' work (free GPUs count their claims): a queue, not a dead end.
        # Moving to a pool that must wait as well, or giving up, would only lose the attempt's place;
        # it moves as soon as a pool in the allowed regions has room, and starts here when GPUs free up.
        since = now - timedelta(seconds=waited)
        set_condition(status, api.COND_RUNNING, "False", "Unschedulable",
                      f"attempt {attempt}: pods unschedulable on pool {pool} since {since:%Y-%m-%dT%H:%M:%SZ}: {message};"
                      " waiting: every pool in the allowed regions that fits is busy with other jobs",
                      now, job.metadata.generation)
        decision.requeue_after = RESYNC_SECONDS
        return decision
    decision.delete += child_refs(child)
    update_record(status, attempt, outcome="Unschedulable", end_time=now, message=what)
    if not attempts_left(job, observed.policy, attempt + 1):
        return give_up(decision, observed, "Unschedulable", f"{what}; all {max_attempts(job, observed.policy)} attempts are used")
    if isinstance(result, Infeasible):
        return give_up(decision, observed, "Unschedulable", f"{what}; no other pool in the allowed regions fits: {result.message}")
    decision.events.append(Event("Warning", "Unschedulable", f"{what}; moving to {result.pool.name}"))
    return launch(decision, observed, result, attempt=attempt + 1, note=f"moved from {pool}: its pods found no node")


def _unschedulable(pods: Sequence[dict[str, Any]]) -> tuple[datetime, str] | None:
    """The earliest time a pod of the attempt became unschedulable, and the scheduler's message."""
    found: list[tuple[datetime, str]] = []
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
                since = api.kube_time(cond.get("lastTransitionTime"))
                if since is not None:
                    found.append((since, redact(str(cond.get("message") or "no node fits"))))
    return min(found, key=lambda f: f[0]) if found else None


# Container waiting reasons that mean the pod will not start by itself.
_NOT_STARTING = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "RunContainerError")


def _not_starting(pods: Sequence[dict[str, Any]]) -> str | None:
    for pod in pods:
        status = pod.get("status") or {}
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _NOT_STARTING:
                name = (pod.get("metadata") or {}).get("name", "")
                return redact(f"{name}: {waiting['reason']}: {waiting.get('message', '')}".strip(": "))
    return None
