"""Launching an attempt: planning it, recording it and creating its objects; creating again the
objects of an attempt the status names that do not exist."""

from __future__ import annotations

from .. import api, calibration
from ..children import PLAN_STATUS_ANNOTATION, plan_annotation
from ..planning.plan import Infeasible, Plan
from ..planning.pools import GiB
from ..planning.search import plan_job
from ..recovery.adjust import failed_runs, learned_calibration, replan_after_loss
from ..rendering.backend import NoBackend, select_backend
from ..rendering.errors import RenderError
from ..rendering.names import attempt_name
from .conditions import condition, set_condition
from .failures import attempts_left, blocked, give_up, max_attempts
from .records import attempt_record
from .refs import attempt_refs
from .types import REPLAN_AFTER_SECONDS, RESYNC_SECONDS, Decision, Event, Observed
from .validation import invalid


def new_attempt(decision: Decision, observed: Observed, *, attempt: int, note: str) -> Decision:
    """Plan attempt `attempt` from scratch (still keeping what earlier attempts taught) and launch it."""
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = max(attempt, max((a.attempt for a in status.attempts), default=0) + 1)
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; nothing runs", now, generation)
        return decision
    if not attempts_left(job, observed.policy, attempt):
        return give_up(decision, observed, "Failed", f"all {max_attempts(job, observed.policy)} attempts are used")
    # Keep what earlier attempts taught (a status rebuilt after its current attempt was lost).
    excluded = tuple(key for run in failed_runs(status.attempts) for key in run.keys())
    # The job's own floor, raised to what the cluster learned for the winner's kind of run.
    result, learned, kind = calibration.plan_with_learning(
        lambda factor: plan_job(job.spec, list(observed.pools), observed.policy, exclude=excluded,
                                calibration=factor, architecture=observed.architecture),
        learned_calibration(status.attempts), observed.learned,
        observed.architecture.family if observed.architecture is not None else "",
        observed.policy.image_for(job.spec.image))
    if learned is not None and not isinstance(result, Infeasible):
        result = result.model_copy(update={"reason": f"{result.reason} {calibration.applied_words(learned, kind)}."})
    if isinstance(result, Infeasible):
        status.phase = "Pending"
        status.current_attempt = None
        previous = condition(status, api.COND_PLANNED)
        set_condition(status, api.COND_PLANNED, "False", "NoFit", result.message, now, generation)
        if previous is None or previous.message != result.message:
            decision.events.append(Event("Warning", "NoFit", result.message))
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    return launch(decision, observed, result, attempt=attempt, note=note)


def launch(decision: Decision, observed: Observed, plan: Plan, *, attempt: int, note: str) -> Decision:
    """Record attempt `attempt` with `plan` and create its objects."""
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    try:
        backend = select_backend(job, observed.policy, observed.backends, observed.unusable)
    except NoBackend as missing:
        if missing.path is not None:
            return invalid(status, [api.FieldProblem(path=missing.path, message=missing.message)], now, generation)
        # The platform's to fix (install a CRD, change the policy): say so and look again; a CRD that
        # appears wakes every job at once (the shell watches CRDs).
        status.phase = "Pending"
        message = f"attempt {attempt} cannot be created: {missing.message}"
        previous = condition(status, api.COND_PLANNED)
        set_condition(status, api.COND_PLANNED, "False", "NoTrainingBackend", message, now, generation)
        if previous is None or previous.message != message:
            decision.events.append(Event("Warning", "NoTrainingBackend", message))
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    queued = job
    if job.spec.queue_name is None and observed.default_queue is not None:
        # The policy's default LocalQueue (it exists in the namespace): the child carries its label.
        queued = job.model_copy(update={"spec": job.spec.model_copy(update={"queue_name": observed.default_queue})})
    try:
        rendered = backend.render(queued, plan, attempt, observed.policy)
    except RenderError as error:
        if error.path.startswith("spec."):
            return invalid(status, [api.FieldProblem(path=error.path, message=error.message)], now, generation)
        # The plan or the platform's catalog cannot be rendered (e.g. a bad taint key): a policy fix helps.
        status.phase = "Pending"
        message = f"attempt {attempt} cannot be rendered: {error}"
        set_condition(status, api.COND_PLANNED, "False", "CannotRender", message, now, generation)
        decision.events.append(Event("Warning", "CannotRender", message))
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    plan_status = plan.to_status()
    # The child carries its whole plan, so a lost status can be rebuilt from it (children.py).
    rendered.training_job["metadata"].setdefault("annotations", {})[PLAN_STATUS_ANNOTATION] = plan_annotation(plan_status)
    name = rendered.name
    existing = attempt_record(status, attempt)
    relaunch = existing is not None and existing.outcome == "Running" and existing.plan is not None
    status.plan = plan_status
    status.current_attempt = attempt
    status.next_attempt_time = None
    status.phase = "Launching"
    status.start_time = status.start_time or now
    kept = existing.failed_pods if existing is not None else []
    status.attempts = [a for a in status.attempts if a.attempt != attempt] + [
        api.AttemptStatus(
            attempt=attempt,
            pytorch_job=name,
            plan_summary=plan.summary(),
            plan=plan_status.compact(),
            outcome="Running",
            predicted_peak_gi_b=round(plan.predicted_peak_bytes / GiB, 2),
            start_time=now,
            failed_pods=kept,
        )
    ]
    status.attempts.sort(key=lambda a: a.attempt)
    set_condition(status, api.COND_PLANNED, "True", "Planned", plan.reason or plan.summary(), now, generation)
    set_condition(status, api.COND_RUNNING, "False", "Launching", f"attempt {attempt}: creating {name}", now, generation)
    decision.create = rendered.objects
    if attempt > 1:
        # Normally gone already; after a crash between the status write and the delete it is not.
        decision.delete += attempt_refs(observed, attempt_name(job.metadata.name, attempt - 1))
    blocked = condition(status, api.COND_BLOCKED)
    if not (relaunch and blocked is not None and blocked.status == "True"):
        # A create the API keeps refusing is retried quietly: the Blocked condition says why.
        # Short: the long story (why this plan won) is in the Planned condition and status.plan.
        decision.events.append(Event("Normal", "Planned" if attempt == 1 else "Relaunched",
                                     f"attempt {attempt}: {plan.summary()}" + (f"; {note}" if note else "")))
    decision.requeue_after = RESYNC_SECONDS
    return decision


def create_missing(decision: Decision, observed: Observed, attempt: int) -> Decision:
    """The status names an attempt whose training job does not exist: create it (again)."""
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    if status.next_attempt_time is not None and now < status.next_attempt_time:
        decision.requeue_after = max(1.0, (status.next_attempt_time - now).total_seconds())
        return decision
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; nothing runs", now, generation)
        return decision
    if observed.foreign:
        return blocked(decision, observed, "NameConflict", "; ".join(
            f"{ref.kind} {job.metadata.namespace}/{ref.name} exists and is not controlled by this FineTuneJob "
            f"(delete or rename it; the operator never adopts or deletes it)" for ref in observed.foreign))
    if status.plan is None:
        return new_attempt(decision, observed, attempt=attempt, note="")
    # The recorded plan; when its pool is gone or changed, elsewhere, keeping what was learned.
    plan = replan_after_loss(job.spec, status.plan, failed=failed_runs(status.attempts),
                             calibration=learned_calibration(status.attempts), pools=list(observed.pools),
                             policy=observed.policy, architecture=observed.architecture)
    if isinstance(plan, Infeasible):
        status.phase = "Pending"
        set_condition(status, api.COND_PLANNED, "False", "NoFit", plan.message, now, generation)
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    return launch(decision, observed, plan, attempt=attempt, note="")
