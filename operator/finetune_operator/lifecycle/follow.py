"""Following the current attempt: its end, a hang, spec.suspend, a queue holding it; until it runs,
starting.py waits for it."""

from __future__ import annotations

import dataclasses
from datetime import datetime

from .. import api, calibration, provenance
from ..children import Child
from ..planning.policy import ClusterPolicy
from ..planning.pools import GiB
from ..recovery.classify import Failure, FailureKind
from ..recovery.redact import redact
from ..rendering.labels import ATTEMPT_LABEL
from .conditions import clear_blocked, condition, set_condition
from .failures import failure_of_attempt, recover
from .launch import create_missing
from .records import attempt_record, pods_of_attempt, record_failed_pods, record_where_it_ran, update_record
from .refs import child_refs
from .starting import waiting_to_start
from .types import MAX_EVIDENCE_MESSAGE, QUEUE_RETRY_SECONDS, RESYNC_SECONDS, Decision, Event, Observed


def follow_attempt(decision: Decision, observed: Observed) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = status.current_attempt or 1
    child = next((c for c in observed.children if c.attempt == attempt), None)

    if child is None:
        return create_missing(decision, observed, attempt)
    clear_blocked(status, now, generation)
    observed = dataclasses.replace(observed, pods=pods_of_attempt(observed.pods, attempt))
    record_failed_pods(status, attempt, observed.pods)
    record_where_it_ran(status, attempt, observed.pods)

    queued_job = job.spec.queue_name is not None or child.queue is not None
    # A finished child is judged by how it ended, whatever its suspend flag says.
    if job.spec.suspend and child.live:
        return _suspend(decision, observed, child, queued_job)
    suspended = condition(status, api.COND_SUSPENDED)
    if suspended is not None and suspended.status == "True":
        set_condition(status, api.COND_SUSPENDED, "False", "Resumed", "spec.suspend is false", now, generation)
    if child.suspended and child.live:
        if child.suspended_by_us and not queued_job:
            decision.set_suspend = False
            decision.events.append(Event("Normal", "Resumed", f"attempt {attempt}: resumed"))
            status.phase = "Launching"
            decision.requeue_after = RESYNC_SECONDS
            return decision
        return _queued(decision, observed, child)
    queued = condition(status, api.COND_QUEUED)
    if queued is not None and queued.status == "True":
        set_condition(status, api.COND_QUEUED, "False", "Admitted", _admitted_message(child), now, generation)

    if child.state == "Succeeded":
        status.phase = "Succeeded"
        status.completion_time = now
        peak = calibration.success_peak_bytes(observed.pods, attempt, ATTEMPT_LABEL)
        update_record(status, attempt, outcome="Succeeded", end_time=now, message="finished",
                       observed_peak_gi_b=round(peak / GiB, 2) if peak else None)
        status.provenance = _provenance(observed, status, attempt)
        set_condition(status, api.COND_RUNNING, "False", "Finished", f"attempt {attempt} finished", now, generation)
        if condition(status, api.COND_RECOVERING) is not None:
            set_condition(status, api.COND_RECOVERING, "False", "Recovered", f"attempt {attempt} finished", now, generation)
        set_condition(status, api.COND_SUCCEEDED, "True", "Succeeded", f"training finished on attempt {attempt}", now, generation)
        decision.events.append(Event("Normal", "Succeeded", f"training finished on attempt {attempt}"))
        return decision
    if child.state == "Failed":
        return recover(decision, observed, failure_of_attempt(status, attempt, child, observed.pods))
    if child.state == "Running":
        hung = _hung(status, attempt, observed.policy, now)
        if hung is not None:
            return recover(decision, observed, hung)
        if status.phase != "Running":
            decision.events.append(Event("Normal", "Running", f"attempt {attempt} is running"))
        status.phase = "Running"
        set_condition(status, api.COND_RUNNING, "True", "Running", f"attempt {attempt} is running", now, generation)
        decision.requeue_after = RESYNC_SECONDS
        return decision
    status.phase = "Launching"
    return waiting_to_start(decision, observed, child, queued_job)


def _hung(status: api.FineTuneJobStatus, attempt: int, policy: ClusterPolicy, now: datetime) -> Failure | None:
    """A running attempt far past its predicted time is taken as hung: without progress reports
    from the trainer this is the bound on a run that makes no progress (an NCCL collective
    waiting for a dead peer never ends by itself)."""
    record = attempt_record(status, attempt)
    if (policy.hung_after_factor <= 0 or record is None or record.start_time is None or status.plan is None
            or not status.plan.estimated_hours):
        return None
    bound = max(policy.hung_min_seconds, policy.hung_after_factor * status.plan.estimated_hours * 3600)
    running = (now - record.start_time).total_seconds()
    if running < bound:
        return None
    return Failure(FailureKind.HUNG, f"still running after {running / 3600:.1f} h, {policy.hung_after_factor:g} x the"
                   f" predicted {status.plan.estimated_hours:.2f} h: taken as hung; restarting from the last checkpoint",
                   "job")


def _suspend(decision: Decision, observed: Observed, child: Child, queued_job: bool) -> Decision:
    """spec.suspend: the pods stop, the attempt and its checkpoints stay."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    attempt = child.attempt
    first = status.phase != "Suspended"
    status.phase = "Suspended"
    if queued_job:
        # A queueing system re-admits (un-suspends) a suspended job it has admitted, so a queued
        # attempt is suspended by deleting its training job; resuming creates it again, queued.
        decision.delete += child_refs(child)
        message = f"spec.suspend is true; {child.name} was deleted and is created again (queued) on resume"
    else:
        if not child.suspended:
            decision.set_suspend = True
        message = f"spec.suspend is true; {child.name} is suspended"
    set_condition(status, api.COND_SUSPENDED, "True", "Suspended", message, now, generation)
    if first:
        decision.events.append(Event("Normal", "Suspended", f"attempt {attempt}: suspended; its pods stop"))
    return decision


def _queued(decision: Decision, observed: Observed, child: Child) -> Decision:
    """The child is suspended by someone else (a queueing system): wait for its admission, never resume it."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    queue = child.queue or observed.job.spec.queue_name
    by = f"queue {queue}" if queue else "a queueing system (the operator did not suspend it)"
    message = f"{child.name} is suspended by {by}; it starts when admitted"
    reason = "WaitingForAdmission"
    admission = child.admission
    if admission is not None and admission.queue_missing:
        reason = "LocalQueueNotFound"
        message = (f"LocalQueue {observed.job.metadata.namespace}/{queue} does not exist, so Kueue admits nothing from it: "
                   f"{child.name} stays suspended until the platform team creates it")
    elif admission is not None and admission.workload is not None:
        # Kueue's own words: which quota or flavor is short (read-only from its Workload).
        message += f"; Kueue ({admission.reason}): {redact(admission.message)[:MAX_EVIDENCE_MESSAGE]}"
        if admission.admitted:
            reason = "Admitted"
    previous = condition(status, api.COND_QUEUED)
    if status.phase != "Queued" or (reason == "LocalQueueNotFound" and (previous is None or previous.reason != reason)):
        decision.events.append(Event("Warning" if reason == "LocalQueueNotFound" else "Normal", "Queued",
                                     f"attempt {child.attempt}: " + (message if reason == "LocalQueueNotFound"
                                                                     else f"waiting for admission by {by}")))
    status.phase = "Queued"
    set_condition(status, api.COND_QUEUED, "True", reason, message, now, generation)
    # Kueue's answer (a Workload, its reason) comes within seconds of the create: look again soon until it has said.
    said = admission is not None and admission.workload is not None and admission.reason not in ("Pending", "NoWorkload") \
        or (admission is not None and admission.queue_missing)
    decision.requeue_after = RESYNC_SECONDS if said or admission is None else QUEUE_RETRY_SECONDS
    return decision


def _admitted_message(child: Child) -> str:
    admission = child.admission
    if admission is None or not admission.admitted:
        return f"{child.name} was admitted"
    where = f" by ClusterQueue {admission.cluster_queue}" if admission.cluster_queue else ""
    flavors = f" (flavor {', '.join(admission.flavors)})" if admission.flavors else ""
    return f"{child.name} was admitted{where}{flavors}"


def _provenance(observed: Observed, status: api.FineTuneJobStatus, attempt: int) -> api.ProvenanceSummary:
    """status.provenance of the job that just succeeded on `attempt`: what rank 0's success report
    says it trained on, the attempts the status holds."""
    reports = calibration.success_reports(observed.pods, attempt, ATTEMPT_LABEL)
    rank0 = next((r for r in reports if r.rank == 0 and r.facts is not None), None)
    if rank0 is None:
        rank0 = next((r for r in reports if r.facts is not None), None)
    job = observed.job.model_copy(update={"status": status})
    # Rank 0 exports last; its pod's report carries the export even where another local rank's won on peak.
    export = next((r.export for r in reports if r.export is not None), None)
    return provenance.summary(job, rank0.facts if rank0 else None, rank0.steps if rank0 else None, observed.now,
                              export)
