"""A failed attempt: the verdict on it, the next attempt (recovery/adjust.py decides) or the end
of the job; and what stops a job that only a person can unblock."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Sequence

from finetune_trainer.failures import outcome_of

from .. import api
from ..children import Child
from ..planning.policy import ClusterPolicy
from ..planning.pools import GiB
from ..recovery.adjust import decide_next, failed_runs, learned_calibration
from ..recovery.classify import Failure, FailureKind, classify_attempt, most_specific
from ..recovery.redact import redact
from ..rendering.names import attempt_name
from .conditions import condition, set_condition
from .records import attempt_record, failure_of_record, update_record
from .refs import attempt_refs
from .types import BLOCKED_RETRY_SECONDS, MAX_EVIDENCE_MESSAGE, Decision, Event, Observed


def failure_of_attempt(status: api.FineTuneJobStatus, attempt: int, child: Child,
                        pods: Sequence[dict[str, Any]]) -> Failure:
    """The verdict on the failed attempt, from every failed pod seen (present or gone) and the job."""
    record = attempt_record(status, attempt)
    verdicts = [failure_of_record(p) for p in (record.failed_pods if record is not None else [])]
    if verdicts:
        return most_specific(verdicts)
    verdict = classify_attempt(list(pods), child.body)
    if verdict.source == "job":
        # The training job failed but no pod, present or remembered, shows a failure: the one that
        # failed is gone without a trace (deleted or evicted while the operator was not looking,
        # e.g. restarting; the training operator may already have made a new pod in its place).
        # Nothing says the plan was at fault: it runs again, bounded by maxAttempts, as after an eviction.
        return Failure(FailureKind.EVICTED, f"no pod shows why the attempt failed ({verdict.message}); its failed pod "
                       "is gone (deleted or evicted while the operator was not looking)", "job")
    return verdict


def recover(decision: Decision, observed: Observed, failure: Failure) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = status.current_attempt or 1
    failed_plan = status.plan
    outcome = outcome_of(failure.kind)
    observed_peak = round(failure.peak_allocated_bytes / GiB, 2) if failure.peak_allocated_bytes else None

    if failed_plan is None:
        nxt = None
        why = failure.describe()
    else:
        nxt = decide_next(
            job.spec, failure, failed_plan,
            attempts_made=attempt, failed_keys=failed_runs(status.attempts), pools=list(observed.pools),
            policy=observed.policy, architecture=observed.architecture, calibration=learned_calibration(status.attempts),
        )
        why = nxt.why
    if nxt is None or not nxt.retry or nxt.plan is None:
        update_record(status, attempt, outcome=outcome, end_time=now, message=why, observed_peak_gi_b=observed_peak)
        # The failed training job and its terminated pods stay for inspection (its running pods
        # are cleaned by the training operator); the ownerReference removes them with the job.
        return give_up(decision, observed, outcome, f"attempt {attempt}: {why}")

    decision.delete += attempt_refs(observed, attempt_name(job.metadata.name, attempt))
    message = f"attempt {attempt + 1}: {why}; {nxt.changes}"
    update_record(status, attempt, outcome=outcome, end_time=now, message=f"{why}; next: {nxt.changes}", observed_peak_gi_b=observed_peak)
    backoff = _backoff_seconds(job.spec.recovery.backoff, attempt)
    status.phase = "Recovering"
    status.current_attempt = attempt + 1
    status.plan = nxt.plan.to_status()
    status.next_attempt_time = now + timedelta(seconds=backoff)
    # The next attempt is recorded now (its plan included), created after the backoff.
    status.attempts.append(
        api.AttemptStatus(
            attempt=attempt + 1,
            pytorch_job=attempt_name(job.metadata.name, attempt + 1),
            plan_summary=nxt.plan.summary(),
            plan=status.plan.compact(),
            outcome="Running",
            message=f"waiting {backoff:.0f} s before starting",
            predicted_peak_gi_b=round(nxt.plan.predicted_peak_bytes / GiB, 2),
        )
    )
    set_condition(status, api.COND_RUNNING, "False", outcome, f"attempt {attempt} failed: {failure.describe()}", now, generation)
    set_condition(status, api.COND_RECOVERING, "True", outcome, message, now, generation)
    decision.events.append(Event("Warning", "Recovering", message))
    decision.requeue_after = max(backoff, 1.0)
    return decision


def give_up(decision: Decision, observed: Observed, reason: str, message: str) -> Decision:
    """The job fails for good, saying why."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    status.phase = "Failed"
    status.completion_time = now
    status.next_attempt_time = None
    set_condition(status, api.COND_RUNNING, "False", "Failed", message, now, generation)
    recovering = condition(status, api.COND_RECOVERING)
    if recovering is not None and recovering.status == "True":
        set_condition(status, api.COND_RECOVERING, "False", "GaveUp", message, now, generation)
    set_condition(status, api.COND_FAILED, "True", reason, message, now, generation)
    decision.events.append(Event("Warning", "Failed", message))
    decision.requeue_after = None
    return decision


def blocked(decision: Decision, observed: Observed, reason: str, message: str) -> Decision:
    """Something only a person can fix stops the job: say so, create and delete nothing, look again later."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    previous = condition(status, api.COND_BLOCKED)
    set_condition(status, api.COND_BLOCKED, "True", reason, message, now, generation)
    if previous is None or previous.status != "True" or previous.message != message:
        decision.events.append(Event("Warning", reason, message))
    decision.create = []
    decision.delete = []
    decision.set_suspend = None
    decision.requeue_after = BLOCKED_RETRY_SECONDS
    return decision


def create_refused(job: api.FineTuneJob, status: api.FineTuneJobStatus, policy: ClusterPolicy, now: datetime,
                   kind: str, name: str, message: str) -> Decision:
    """The API refused to create an attempt's object (an admission webhook, a quota): retry,
    quoting its message, for at most the policy's bound; then the job fails with that message."""
    observed = Observed(job=job, now=now, policy=policy)
    decision = Decision(status=status.model_copy(deep=True))
    text = f"the API refused to create {kind} {name}: {redact(message)[:MAX_EVIDENCE_MESSAGE]}"
    previous = condition(decision.status, api.COND_BLOCKED)
    since = previous.last_transition_time if previous is not None and previous.status == "True" and previous.reason == "CreateRejected" else now
    if (now - since).total_seconds() >= policy.create_retry_seconds:
        attempt = decision.status.current_attempt
        if attempt is not None:
            update_record(decision.status, attempt, outcome="Failed", end_time=now, message=text)
        set_condition(decision.status, api.COND_BLOCKED, "False", "GaveUp", text, now, job.metadata.generation)
        return give_up(decision, observed, "CreateRejected", f"{text}; retried for {policy.create_retry_seconds} s")
    return blocked(decision, observed, "CreateRejected", text)


def max_attempts(job: api.FineTuneJob, policy: ClusterPolicy) -> int:
    return job.spec.recovery.max_attempts or policy.default_max_attempts


def attempts_left(job: api.FineTuneJob, policy: ClusterPolicy, attempt: int) -> bool:
    return attempt <= max_attempts(job, policy)


def _backoff_seconds(backoff: api.BackoffSpec, attempt: int) -> float:
    return float(min(backoff.max_seconds, backoff.initial_seconds * 2 ** max(attempt - 1, 0)))
