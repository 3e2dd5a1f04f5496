"""The FineTuneJob state machine, as a pure function: what the shell saw in, what to do out.

`step(observed)` is called whenever something about a job may have changed (the job, its
PyTorchJob, its pods) and on a timer. It returns the new status, the objects to create or
delete, and the events to post; the shell (`controller.py`) does the I/O. Everything here
is deterministic in its input, so the lifecycle is tested without a cluster and the
operator can be killed at any point: the next `step` sees what exists and carries on.

Phases: Pending (until a plan fits) -> Launching -> Running -> Succeeded
                                                       \\-> Recovering -> Launching (attempt N+1) ...
                                                       \\-> Failed
        any -> Suspended (spec.suspend) -> back where it was.

Spec changes after the first attempt: only `suspend`, `recovery` and `resources` may change
(the CRD enforces it with CEL transition rules); `resources` applies to the next plan, never
to a running attempt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Sequence

from . import api
from .planning.plan import Infeasible, Plan, plan_key_of
from .planning.policy import ClusterPolicy
from .planning.pools import GiB, NodePool
from .planning.search import plan_job
from .recovery.adjust import decide_next, replan_pinned
from .recovery.classify import Failure, FailureKind, classify_attempt
from .rendering.errors import RenderError
from .rendering.layout import layout_of
from .rendering.names import attempt_name
from .rendering.renderer import render_attempt
from .sizing import ModelArchitecture, SizingError
from .sizing.from_job import architecture_of

# How long to wait before planning again when nothing fits (pools may scale or free up).
REPLAN_AFTER_SECONDS = 60.0
# How often to look at a running attempt even when no event arrives.
RESYNC_SECONDS = 30.0

_OUTCOME_OF: dict[FailureKind, str] = {
    FailureKind.GPU_OUT_OF_MEMORY: "GPUOutOfMemory",
    FailureKind.HOST_OUT_OF_MEMORY: "HostOutOfMemory",
    FailureKind.EVICTED: "Evicted",
    FailureKind.NODE_LOST: "NodeLost",
    FailureKind.DATA_ERROR: "DataError",
    FailureKind.CONFIG_ERROR: "ConfigError",
    FailureKind.UNKNOWN: "Failed",
}


@dataclass(frozen=True)
class Observed:
    """What the shell read from the cluster for one job."""

    job: api.FineTuneJob
    now: datetime
    policy: ClusterPolicy
    pools: Sequence[NodePool] = ()
    pytorch_job: dict[str, Any] | None = None  # of the current attempt
    pods: Sequence[dict[str, Any]] = ()  # of the current attempt
    invalid: list[api.FieldProblem] | None = None  # problems found by the shell (e.g. a configMapRef)
    model_config: dict[str, Any] | None = None  # the config.json a configMapRef architecture points at
    architecture: ModelArchitecture | None = None  # resolved by `step`, not by the shell


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str


@dataclass
class Decision:
    status: api.FineTuneJobStatus
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[ObjectRef] = field(default_factory=list)
    set_suspend: bool | None = None  # patch runPolicy.suspend of the current PyTorchJob
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # seconds; None: wait for a change


def set_condition(
    status: api.FineTuneJobStatus,
    type_: str,
    state: str,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> None:
    """Set a condition; its lastTransitionTime moves only when its status changes."""
    for index, condition in enumerate(status.conditions):
        if condition.type == type_:
            since = condition.last_transition_time if condition.status == state else now
            status.conditions[index] = api.Condition(
                type=type_, status=state, reason=reason, message=message,
                last_transition_time=since, observed_generation=generation,
            )
            return
    status.conditions.append(
        api.Condition(type=type_, status=state, reason=reason, message=message,
                      last_transition_time=now, observed_generation=generation)
    )


def condition(status: api.FineTuneJobStatus, type_: str) -> api.Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


# ---------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------


def step(observed: Observed) -> Decision:
    job = observed.job
    status = (job.status or api.FineTuneJobStatus()).model_copy(deep=True)
    generation = job.metadata.generation
    decision = Decision(status=status)
    now = observed.now

    if status.phase in ("Succeeded", "Failed"):
        return decision  # terminal: nothing more to do

    problems = list(observed.invalid or [])
    try:
        layout_of(job.spec)  # sources the pods cannot read are the job's fault: say so now, not after planning
    except RenderError as error:
        problems.append(api.FieldProblem(path=error.path, message=error.message))
    if not problems:
        try:
            observed = dataclasses.replace(observed, architecture=architecture_of(job.spec, observed.model_config))
        except SizingError as error:
            problems.append(_architecture_problem(job.spec, error))
    if problems:
        return invalid(decision.status, problems, now, generation)
    set_condition(status, api.COND_VALIDATED, "True", "Valid", "the spec is valid", now, generation)
    status.observed_generation = generation

    if status.current_attempt is None:
        return _first_attempt(decision, observed)
    return _follow_attempt(decision, observed)


def _architecture_problem(spec: api.FineTuneJobSpec, error: SizingError) -> api.FieldProblem:
    """A sizing error about the model's architecture, located under spec.model.architecture."""
    source = spec.model.architecture
    if error.field.startswith("spec."):
        path = error.field
    elif source.inline is not None:
        path = f"spec.model.architecture.inline.{error.field}"
    elif source.config_map_ref is not None:
        path = f"spec.model.architecture.configMapRef ({source.config_map_ref.name}/{source.config_map_ref.key}: {error.field})"
    else:
        path = f"spec.model.architecture.{error.field}"
    return api.FieldProblem(path=path, message=str(error).split(": ", 1)[-1])


def invalid(status: api.FineTuneJobStatus, problems: list[api.FieldProblem], now: datetime, generation: int | None) -> Decision:
    """A job that cannot be accepted: Failed with an Invalid condition naming the fields; no retry."""
    decision = Decision(status=status)
    message = "; ".join(str(p) for p in problems)
    set_condition(status, api.COND_VALIDATED, "False", "Invalid", message, now, generation)
    set_condition(status, api.COND_FAILED, "True", "Invalid", message, now, generation)
    status.phase = "Failed"
    status.completion_time = now
    decision.events.append(Event("Warning", "Invalid", message))
    return decision


def _first_attempt(decision: Decision, observed: Observed) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; nothing runs", now, generation)
        return decision
    result = plan_job(job.spec, list(observed.pools), observed.policy, architecture=observed.architecture)
    if isinstance(result, Infeasible):
        status.phase = "Pending"
        previous = condition(status, api.COND_PLANNED)
        set_condition(status, api.COND_PLANNED, "False", "NoFit", result.message, now, generation)
        if previous is None or previous.message != result.message:
            decision.events.append(Event("Warning", "NoFit", result.message))
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    return _launch(decision, observed, result, attempt=1, note=f"planned: {result.reason}")


def _launch(decision: Decision, observed: Observed, plan: Plan, *, attempt: int, note: str) -> Decision:
    """Record attempt `attempt` with `plan` and create its objects."""
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    try:
        rendered = render_attempt(job, plan, attempt, observed.policy)
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
    status.plan = plan_status
    status.current_attempt = attempt
    status.phase = "Launching"
    status.start_time = status.start_time or now
    status.attempts = [a for a in status.attempts if a.attempt != attempt] + [
        api.AttemptStatus(
            attempt=attempt,
            pytorch_job=rendered.pytorch_job["metadata"]["name"],
            plan_summary=plan.summary(),
            plan=plan_status,
            outcome="Running",
            predicted_peak_gi_b=round(plan.predicted_peak_bytes / GiB, 2),
            start_time=now,
        )
    ]
    set_condition(status, api.COND_PLANNED, "True", "Planned", plan.reason or plan.summary(), now, generation)
    set_condition(status, api.COND_RUNNING, "False", "Launching", f"attempt {attempt}: creating {rendered.pytorch_job['metadata']['name']}", now, generation)
    decision.create = [rendered.config_map, rendered.pytorch_job]
    if attempt > 1:
        # Normally gone already; after a crash between the status write and the delete it is not.
        previous = attempt_name(job.metadata.name, attempt - 1)
        decision.delete = [ObjectRef("kubeflow.org/v1", "PyTorchJob", previous), ObjectRef("v1", "ConfigMap", previous)]
    decision.events.append(Event("Normal", "Planned" if attempt == 1 else "Relaunched", f"attempt {attempt}: {plan.summary()}. {note}"))
    decision.requeue_after = RESYNC_SECONDS
    return decision


def _follow_attempt(decision: Decision, observed: Observed) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = status.current_attempt or 1
    record = _attempt_record(status, attempt)
    pj = observed.pytorch_job

    if pj is None:
        return _create_missing(decision, observed, attempt)

    # Suspend and resume act on the PyTorchJob; the training operator stops or starts pods.
    suspended_now = bool(((pj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))
    if job.spec.suspend != suspended_now:
        decision.set_suspend = job.spec.suspend
        if job.spec.suspend:
            decision.events.append(Event("Normal", "Suspended", f"attempt {attempt}: suspended; its pods stop"))
        else:
            decision.events.append(Event("Normal", "Resumed", f"attempt {attempt}: resumed"))
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; the PyTorchJob is suspended", now, generation)
        return decision
    if condition(status, api.COND_SUSPENDED) is not None:
        set_condition(status, api.COND_SUSPENDED, "False", "Resumed", "spec.suspend is false", now, generation)

    state = _pytorch_job_state(pj)
    if state == "Succeeded":
        status.phase = "Succeeded"
        status.completion_time = now
        if record is not None:
            _update_record(status, attempt, outcome="Succeeded", end_time=now, message="finished")
        set_condition(status, api.COND_RUNNING, "False", "Finished", f"attempt {attempt} finished", now, generation)
        if condition(status, api.COND_RECOVERING) is not None:
            set_condition(status, api.COND_RECOVERING, "False", "Recovered", f"attempt {attempt} finished", now, generation)
        set_condition(status, api.COND_SUCCEEDED, "True", "Succeeded", f"training finished on attempt {attempt}", now, generation)
        decision.events.append(Event("Normal", "Succeeded", f"training finished on attempt {attempt}"))
        return decision
    if state == "Failed":
        failure = classify_attempt(list(observed.pods), pj)
        return _recover(decision, observed, failure)
    if state == "Running":
        if status.phase != "Running":
            decision.events.append(Event("Normal", "Running", f"attempt {attempt} is running"))
        status.phase = "Running"
        set_condition(status, api.COND_RUNNING, "True", "Running", f"attempt {attempt} is running", now, generation)
    else:
        status.phase = "Launching"
    decision.requeue_after = RESYNC_SECONDS
    return decision


def _create_missing(decision: Decision, observed: Observed, attempt: int) -> Decision:
    """The status names an attempt whose PyTorchJob does not exist: create it (again)."""
    job, status, now = observed.job, decision.status, observed.now
    if status.next_attempt_time is not None and now < status.next_attempt_time:
        decision.requeue_after = max(1.0, (status.next_attempt_time - now).total_seconds())
        return decision
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; nothing runs", now, job.metadata.generation)
        return decision
    if status.plan is None:
        status.current_attempt = None
        return _first_attempt(decision, observed)
    plan = replan_pinned(job.spec, status.plan, list(observed.pools), observed.policy, observed.architecture)
    if isinstance(plan, Infeasible):
        # The pool of the recorded plan is gone or changed: plan afresh, never repeating failures.
        excluded = tuple(plan_key_of(a.plan) for a in status.attempts if a.plan is not None and a.outcome != "Running")
        plan = plan_job(job.spec, list(observed.pools), observed.policy, exclude=excluded,
                        architecture=observed.architecture)
        if isinstance(plan, Infeasible):
            status.phase = "Pending"
            set_condition(status, api.COND_PLANNED, "False", "NoFit", plan.message, now, job.metadata.generation)
            decision.requeue_after = REPLAN_AFTER_SECONDS
            return decision
    status.next_attempt_time = None
    return _launch(decision, observed, plan, attempt=attempt, note="")


def _recover(decision: Decision, observed: Observed, failure: Failure) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = status.current_attempt or 1
    failed_plan = status.plan
    outcome = _OUTCOME_OF[failure.kind]
    observed_peak = round(failure.peak_allocated_bytes / GiB, 2) if failure.peak_allocated_bytes else None
    excluded = tuple(plan_key_of(a.plan) for a in status.attempts if a.plan is not None)

    if failed_plan is None:
        nxt = None
        why = failure.describe()
    else:
        nxt = decide_next(
            job.spec, failure, failed_plan,
            attempts_made=attempt, failed_keys=excluded, pools=list(observed.pools), policy=observed.policy,
            architecture=observed.architecture,
        )
        why = nxt.why
    pj_name = attempt_name(job.metadata.name, attempt)
    decision.delete = [
        ObjectRef("kubeflow.org/v1", "PyTorchJob", pj_name),
        ObjectRef("v1", "ConfigMap", pj_name),
    ]
    if nxt is None or not nxt.retry or nxt.plan is None:
        _update_record(status, attempt, outcome=outcome, end_time=now, message=why, observed_peak_gi_b=observed_peak)
        status.phase = "Failed"
        status.completion_time = now
        set_condition(status, api.COND_RUNNING, "False", "Failed", f"attempt {attempt} failed", now, generation)
        if condition(status, api.COND_RECOVERING) is not None:
            set_condition(status, api.COND_RECOVERING, "False", "GaveUp", why, now, generation)
        set_condition(status, api.COND_FAILED, "True", outcome, f"attempt {attempt}: {why}", now, generation)
        decision.events.append(Event("Warning", "Failed", f"attempt {attempt}: {why}"))
        # Keep the failed PyTorchJob and pods for inspection; the ownerReference cleans up on delete.
        decision.delete = []
        return decision

    message = f"attempt {attempt + 1}: {why}; {nxt.changes}"
    _update_record(status, attempt, outcome=outcome, end_time=now, message=f"{why}; next: {nxt.changes}", observed_peak_gi_b=observed_peak)
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
            plan=status.plan,
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


def _backoff_seconds(backoff: api.BackoffSpec, attempt: int) -> float:
    return float(min(backoff.max_seconds, backoff.initial_seconds * 2 ** max(attempt - 1, 0)))


def _pytorch_job_state(pj: dict[str, Any]) -> str:
    """Succeeded, Failed, Running or Pending, from the PyTorchJob's conditions."""
    conditions = {c.get("type"): c.get("status") for c in ((pj.get("status") or {}).get("conditions") or [])}
    for state in ("Succeeded", "Failed", "Running"):
        if conditions.get(state) == "True":
            return state
    return "Pending"


def _attempt_record(status: api.FineTuneJobStatus, attempt: int) -> api.AttemptStatus | None:
    return next((a for a in status.attempts if a.attempt == attempt), None)


def _update_record(status: api.FineTuneJobStatus, attempt: int, **changes: Any) -> None:
    for index, record in enumerate(status.attempts):
        if record.attempt == attempt:
            status.attempts[index] = record.model_copy(update=changes)
            return
