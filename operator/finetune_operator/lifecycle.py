"""The FineTuneJob state machine, as a pure function: what the shell saw in, what to do out.

`step(observed)` is called whenever something about a job may have changed (the job, its
training job, its pods) and on a timer. It returns the new status, the objects to create or
delete, and the events to post; the shell (`controller.py`) does the I/O. Everything here
is deterministic in its input, so the lifecycle is tested without a cluster and the
operator can be killed at any point: the next `step` sees what exists and carries on.

Phases: Pending (until a plan fits) -> [Queued ->] Launching -> Running -> Succeeded
                                                       \\-> Recovering -> Launching (attempt N+1) ...
                                                       \\-> Failed
        any -> Suspended (spec.suspend) -> back where it was.
Queued: a queueing system (Kueue) holds the attempt's training job suspended.

Before deciding anything, the status is reconciled with the children (children.py): they are
the truth of what runs, so a status that lost track is rebuilt from them, never restarted.
Something only a person can fix (a foreign object holding a name, a refused create) sets the
Blocked condition and the step creates and deletes nothing.

Spec changes after the first attempt: only `suspend`, `recovery` and `resources` may change
(the CRD enforces it with CEL transition rules); `resources` applies to the next plan, never
to a running attempt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Mapping, Sequence

from finetune_trainer.failures import outcome_of

from . import api
from .children import PLAN_STATUS_ANNOTATION, Child, plan_annotation
from .planning.plan import Infeasible, Plan
from .planning.policy import ClusterPolicy
from .planning.pools import GiB, NodePool
from .planning.search import plan_job
from .recovery.adjust import decide_next, failed_runs, learned_calibration, replan_after_loss
from .recovery.classify import Failure, FailureKind, classify_attempt, classify_pod
from .recovery.classify import most_specific
from .recovery.redact import redact
from .rendering.errors import RenderError
from .rendering.layout import layout_of
from .rendering.names import attempt_name
from .rendering.backend import DEFAULT_SERVED, Backend, NoBackend, select_backend, trainer_containers
from .rendering.renderer import ATTEMPT_LABEL
from . import calibration, provenance
from .profiling import state as profiling
from .sizing import ModelArchitecture, SizingError, UnknownArchitecture
from .sizing.from_job import architecture_of

# How long to wait before planning again when nothing fits (pools may scale or free up).
REPLAN_AFTER_SECONDS = 60.0
# How often to look at a running attempt even when no event arrives.
RESYNC_SECONDS = 30.0
# How often to look again for an object the job refers to that does not exist yet.
WAITING_RETRY_SECONDS = 5.0
# How often to look again at a queued job whose Workload has not said yet why it waits.
QUEUE_RETRY_SECONDS = 3.0
# How often to look again at a job that something only a person can fix blocks.
BLOCKED_RETRY_SECONDS = 10.0
# Longest message of a failed pod kept in status.
MAX_EVIDENCE_MESSAGE = 512


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str
    namespace: str | None = None  # None: the job's (a profile pod lives in the operator's)


@dataclass(frozen=True)
class Observed:
    """What the shell read from the cluster for one job."""

    job: api.FineTuneJob
    now: datetime
    policy: ClusterPolicy
    pools: Sequence[NodePool] = ()
    children: Sequence[Child] = ()  # every training job this FineTuneJob controls, any attempt
    pods: Sequence[dict[str, Any]] = ()  # of the job, every attempt (labelled with it)
    foreign: Sequence[ObjectRef] = ()  # objects holding the current attempt's names, not controlled by this job
    invalid: list[api.FieldProblem] | None = None  # problems found by the shell (e.g. a configMapRef)
    model_config: dict[str, Any] | None = None  # the config.json a configMapRef architecture points at
    waiting_for: str | None = None  # something the job refers to that does not exist yet (its configMapRef)
    architecture: ModelArchitecture | None = None  # resolved by `step`, not by the shell
    # The training-job kinds the API server serves (rendering/backend.py); a new attempt's kind is
    # chosen among them by the policy's trainingBackend. The lifecycle never names one.
    backends: Sequence[Backend] = DEFAULT_SERVED
    # The policy's defaultQueueName, when the job's namespace has that LocalQueue (the shell checks).
    default_queue: str | None = None
    # Served backends that cannot be used now, and why (the TrainJob's ClusterTrainingRuntime is missing).
    unusable: Mapping[str, str] = field(default_factory=dict)
    # For a model only the pre-flight profile can size: the cache and the profile pod, as the shell
    # read them (profiling.state.ProfileObservation, or NotProfilable naming what cannot be traced).
    profile: Any = None
    # The memory corrections the cluster learned (calibration.py), by kind of run; the shell reads them.
    learned: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: api.FineTuneJobStatus
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[ObjectRef] = field(default_factory=list)
    # Suspend (True) or resume (False) the current attempt's training job for spec.suspend. Only
    # ever False for a child the operator itself suspended: a queued child is never resumed here.
    set_suspend: bool | None = None
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # seconds; None: wait for a change
    # Learned memory corrections this step changed (calibration.py), for the shell to store.
    learned: dict[str, Any] = field(default_factory=dict)


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
        # Sources the pods cannot read are the job's fault: say so now, not after planning. Object
        # storage endpoints are checked against the policy before the first attempt only: a policy
        # reload must not fail a job whose pods run on (later attempts are checked when rendered).
        layout_of(job.spec, observed.policy if status.current_attempt is None else None)
    except RenderError as error:
        problems.append(api.FieldProblem(path=error.path, message=error.message))
    if not problems and observed.waiting_for is not None:
        return _waiting_for(decision, observed)
    if not problems:
        try:
            observed = dataclasses.replace(observed, architecture=architecture_of(job.spec, observed.model_config))
            if profiling.asks_for_profile(job):
                raise profiling.ProfileRequested(observed.architecture.family)
        except UnknownArchitecture as unknown:  # measured instead: the pre-flight profile (profiling/)
            resolved = profiling.resolve(job, observed.profile, unknown, observed.policy)
            if isinstance(resolved, profiling.ProfileStep):
                if resolved.failure is not None or status.current_attempt is None:
                    return _profiling(decision, observed, resolved)
                _profile_objects(decision, observed, resolved)  # a running attempt runs on meanwhile
            else:
                observed = dataclasses.replace(observed, architecture=resolved.architecture)
                _profile_objects(decision, observed, resolved)
        except SizingError as error:
            problems.append(_architecture_problem(job.spec, error))
    if problems:
        return invalid(decision.status, problems, now, generation)
    set_condition(status, api.COND_VALIDATED, "True", "Valid", "the spec is valid", now, generation)
    status.observed_generation = generation

    _reconcile_with_children(decision, observed)
    if status.current_attempt is None:
        return _learn(_new_attempt(decision, observed, attempt=1, note=""), observed)
    return _learn(_follow_attempt(decision, observed), observed)


def _learn(decision: Decision, observed: Observed) -> Decision:
    """Runs that ended this step with an observed peak teach the cluster's calibration (calibration.py)."""
    if observed.architecture is not None:
        seen = calibration.observations(observed.job.status, decision.status, observed.architecture.family,
                                        observed.policy.image_for(observed.job.spec.image))
        decision.learned = calibration.learn(observed.learned, seen)
    return decision


def _profile_objects(decision: Decision, observed: Observed, resolved: Any) -> None:
    """The profile pod to create or delete, and the Profiled condition (profiling/state.py decides)."""
    job, status = observed.job, decision.status
    decision.delete += [ObjectRef("v1", "Pod", name, resolved.pod_namespace or None) for name in resolved.delete]
    if isinstance(resolved, profiling.Profiled):
        set_condition(status, profiling.COND_PROFILED, "True", "Profiled", resolved.message, observed.now,
                      job.metadata.generation)
        return
    decision.create += resolved.create
    set_condition(status, profiling.COND_PROFILED, *resolved.condition, observed.now, job.metadata.generation)
    if resolved.event is not None:
        decision.events.append(Event(*resolved.event))
    decision.requeue_after = profiling.PROFILE_POLL_SECONDS


def _profiling(decision: Decision, observed: Observed, step: Any) -> Decision:
    """No plan before the profile: say so (Pending, Profiled Unknown), or fail naming why it cannot be."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    if step.failure is not None:
        result = invalid(status, [step.failure], now, generation)
        reason = step.condition[1]
        set_condition(result.status, profiling.COND_PROFILED, *step.condition, now, generation)
        set_condition(result.status, api.COND_FAILED, "True", reason, step.condition[2], now, generation)
        result.events = [Event("Warning", reason, step.condition[2])]
        result.delete += [ObjectRef("v1", "Pod", name, step.pod_namespace or None) for name in step.delete]
        return result
    status.phase = "Pending"
    status.observed_generation = generation
    set_condition(status, api.COND_VALIDATED, "True", "Valid", "the spec is valid", now, generation)
    _profile_objects(decision, observed, step)
    return decision


def _waiting_for(decision: Decision, observed: Observed) -> Decision:
    """The job refers to an object that does not exist yet: say what is missing and look again
    soon; nothing else changes (a running attempt runs on)."""
    status, now, generation = decision.status, observed.now, observed.job.metadata.generation
    message = f"waiting: {observed.waiting_for}"
    previous = condition(status, api.COND_VALIDATED)
    set_condition(status, api.COND_VALIDATED, "Unknown", "WaitingForConfigMap", message, now, generation)
    if previous is None or previous.message != message:
        decision.events.append(Event("Warning", "WaitingForConfigMap", message))
    if status.current_attempt is None:
        status.phase = "Pending"
    decision.requeue_after = WAITING_RETRY_SECONDS
    return decision


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
    status.observed_generation = generation
    decision.events.append(Event("Warning", "Invalid", message))
    return decision


# ---------------------------------------------------------------------------
# the children are the truth of what runs
# ---------------------------------------------------------------------------


def _reconcile_with_children(decision: Decision, observed: Observed) -> None:
    """Make the status agree with the training jobs that exist, before deciding anything.

    A status that is behind the cluster (rolled back, patched by a person, a write lost in a
    crash) is rebuilt from the newest child, so the operator never starts attempt 1 again
    beside a running attempt 3. Children of other attempts than the current one are
    leftovers (a crash between the status write and the delete): they are deleted, so at
    most one training job of the FineTuneJob is ever live.
    """
    status = decision.status
    children = sorted(observed.children, key=lambda c: c.attempt)
    said = status.current_attempt
    # A current attempt the status has no record of was not written by us: do not trust it.
    current = said if said is not None and _attempt_record(status, said) is not None else None
    newest_child = children[-1] if children else None
    if newest_child is not None and (current is None or newest_child.attempt > current):
        _adopt_child_as_current(decision, observed, newest_child, said=said)
    elif current is None and status.attempts:
        _continue_after_history(decision, said)
    elif newest_child is not None and newest_child.attempt == current and status.plan is None:
        status.plan = newest_child.plan  # a plan the status lost (or could not read), from its child
    for child in children:
        if child.attempt != status.current_attempt:
            decision.delete += _child_refs(child)


def _continue_after_history(decision: Decision, said: int | None) -> None:
    """No child exists and the status names no attempt it has a record of: go on from the
    newest record (never from attempt 1 again)."""
    status = decision.status
    last = status.attempts[-1]
    if last.outcome == "Running" and last.plan is not None:
        status.current_attempt, status.plan = last.attempt, last.plan  # it never ran or was deleted: create it
    else:
        status.current_attempt, status.plan = None, None  # it ended: the next attempt is planned afresh
        if said is None:
            return  # the normal state of a job waiting to plan its next attempt: nothing was lost
    decision.events.append(Event(
        "Warning", "StatusRebuilt",
        f"the status named attempt {said if said is not None else 'none'}; continuing after its history "
        f"(newest attempt {last.attempt}, {last.outcome})"))


def _adopt_child_as_current(decision: Decision, observed: Observed, child: Child, *, said: int | None) -> None:
    status = decision.status
    status.current_attempt = child.attempt
    record = _attempt_record(status, child.attempt)
    plan = child.plan or (record.plan if record is not None else None)
    status.plan = plan
    status.next_attempt_time = None
    if record is None:
        status.attempts = sorted(
            status.attempts + [api.AttemptStatus(
                attempt=child.attempt, pytorch_job=child.name,
                plan_summary=_plan_summary(plan), plan=plan.compact() if plan is not None else None, outcome="Running",
                message="rebuilt from the cluster: the status had lost this attempt",
                predicted_peak_gi_b=plan.predicted_peak_gi_b if plan is not None else None,
                start_time=observed.now)],
            key=lambda a: a.attempt)
    if status.phase in ("Pending", "Recovering"):
        status.phase = "Launching"
    decision.events.append(Event(
        "Warning", "StatusRebuilt",
        f"the status named attempt {said if said is not None else 'none'} but {child.name} exists; "
        f"continuing with attempt {child.attempt}"))


def _plan_summary(plan: api.PlanStatus | None) -> str:
    if plan is None:
        return ""
    return f"{plan.gpus} x {plan.gpu_type} on {plan.node_pool} ({plan.region}), {plan.strategy}"


def network_policy_ref(name: str) -> ObjectRef:
    """An attempt's NetworkPolicy (rendering/network.py), named like the attempt."""
    return ObjectRef("networking.k8s.io/v1", "NetworkPolicy", name)


def _child_refs(child: Child) -> list[ObjectRef]:
    return [ObjectRef(child.api_version, child.kind, child.name), ObjectRef("v1", "ConfigMap", child.name),
            network_policy_ref(child.name)]


def _attempt_refs(observed: Observed, name: str) -> list[ObjectRef]:
    """The objects of the attempt named `name`: its training job, of the kind it was created as (of
    every served kind when no child of that name is seen), its ConfigMap and its NetworkPolicy."""
    kinds = {(c.api_version, c.kind) for c in observed.children if c.name == name}
    kinds = kinds or {(b.api_version, b.kind) for b in observed.backends}
    return [ObjectRef(version, kind, name) for version, kind in sorted(kinds)] + [
        ObjectRef("v1", "ConfigMap", name), network_policy_ref(name)]


# ---------------------------------------------------------------------------
# new attempts
# ---------------------------------------------------------------------------


def _new_attempt(decision: Decision, observed: Observed, *, attempt: int, note: str) -> Decision:
    """Plan attempt `attempt` from scratch (still keeping what earlier attempts taught) and launch it."""
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = max(attempt, max((a.attempt for a in status.attempts), default=0) + 1)
    if job.spec.suspend:
        status.phase = "Suspended"
        set_condition(status, api.COND_SUSPENDED, "True", "Suspended", "spec.suspend is true; nothing runs", now, generation)
        return decision
    if not _attempts_left(job, observed.policy, attempt):
        return _give_up(decision, observed, "Failed", f"all {_max_attempts(job, observed.policy)} attempts are used")
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
    return _launch(decision, observed, result, attempt=attempt, note=note)


def _launch(decision: Decision, observed: Observed, plan: Plan, *, attempt: int, note: str) -> Decision:
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
    existing = _attempt_record(status, attempt)
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
        decision.delete += _attempt_refs(observed, attempt_name(job.metadata.name, attempt - 1))
    blocked = condition(status, api.COND_BLOCKED)
    if not (relaunch and blocked is not None and blocked.status == "True"):
        # A create the API keeps refusing is retried quietly: the Blocked condition says why.
        # Short: the long story (why this plan won) is in the Planned condition and status.plan.
        decision.events.append(Event("Normal", "Planned" if attempt == 1 else "Relaunched",
                                     f"attempt {attempt}: {plan.summary()}" + (f"; {note}" if note else "")))
    decision.requeue_after = RESYNC_SECONDS
    return decision


def _create_missing(decision: Decision, observed: Observed, attempt: int) -> Decision:
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
        return _new_attempt(decision, observed, attempt=attempt, note="")
    # The recorded plan; when its pool is gone or changed, elsewhere, keeping what was learned.
    plan = replan_after_loss(job.spec, status.plan, failed=failed_runs(status.attempts),
                             calibration=learned_calibration(status.attempts), pools=list(observed.pools),
                             policy=observed.policy, architecture=observed.architecture)
    if isinstance(plan, Infeasible):
        status.phase = "Pending"
        set_condition(status, api.COND_PLANNED, "False", "NoFit", plan.message, now, generation)
        decision.requeue_after = REPLAN_AFTER_SECONDS
        return decision
    return _launch(decision, observed, plan, attempt=attempt, note="")


# ---------------------------------------------------------------------------
# following the current attempt
# ---------------------------------------------------------------------------


def _follow_attempt(decision: Decision, observed: Observed) -> Decision:
    job, status, now = observed.job, decision.status, observed.now
    generation = job.metadata.generation
    attempt = status.current_attempt or 1
    child = next((c for c in observed.children if c.attempt == attempt), None)

    if child is None:
        return _create_missing(decision, observed, attempt)
    _clear_blocked(status, now, generation)
    observed = dataclasses.replace(observed, pods=_pods_of_attempt(observed.pods, attempt))
    _record_failed_pods(status, attempt, observed.pods)
    _record_where_it_ran(status, attempt, observed.pods)

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
        _update_record(status, attempt, outcome="Succeeded", end_time=now, message="finished",
                       observed_peak_gi_b=round(peak / GiB, 2) if peak else None)
        status.provenance = _provenance(observed, status, attempt)
        set_condition(status, api.COND_RUNNING, "False", "Finished", f"attempt {attempt} finished", now, generation)
        if condition(status, api.COND_RECOVERING) is not None:
            set_condition(status, api.COND_RECOVERING, "False", "Recovered", f"attempt {attempt} finished", now, generation)
        set_condition(status, api.COND_SUCCEEDED, "True", "Succeeded", f"training finished on attempt {attempt}", now, generation)
        decision.events.append(Event("Normal", "Succeeded", f"training finished on attempt {attempt}"))
        return decision
    if child.state == "Failed":
        return _recover(decision, observed, _failure_of_attempt(status, attempt, child, observed.pods))
    if child.state == "Running":
        hung = _hung(status, attempt, observed.policy, now)
        if hung is not None:
            return _recover(decision, observed, hung)
        if status.phase != "Running":
            decision.events.append(Event("Normal", "Running", f"attempt {attempt} is running"))
        status.phase = "Running"
        set_condition(status, api.COND_RUNNING, "True", "Running", f"attempt {attempt} is running", now, generation)
        decision.requeue_after = RESYNC_SECONDS
        return decision
    status.phase = "Launching"
    return _waiting_to_start(decision, observed, child, queued_job)


def _hung(status: api.FineTuneJobStatus, attempt: int, policy: ClusterPolicy, now: datetime) -> Failure | None:
    """A running attempt far past its predicted time is taken as hung: without progress reports
    from the trainer this is the bound on a run that makes no progress (an NCCL collective
    waiting for a dead peer never ends by itself)."""
    record = _attempt_record(status, attempt)
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
        decision.delete += _child_refs(child)
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


def _waiting_to_start(decision: Decision, observed: Observed, child: Child, queued_job: bool) -> Decision:
    """The child exists but is not running: bounded waits for scheduling and for starting."""
    job, status, now, policy = observed.job, decision.status, observed.now, observed.policy
    generation = job.metadata.generation
    attempt = child.attempt
    record = _attempt_record(status, attempt)
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
            decision.delete += _child_refs(child)
            _update_record(status, attempt, outcome="ConfigError", end_time=now,
                           message=f"pods did not start within {bound} s: {stuck}")
            return _give_up(decision, observed, "ConfigError",
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
    decision.delete += _child_refs(child)
    _update_record(status, attempt, outcome="Unschedulable", end_time=now, message=what)
    if not _attempts_left(job, observed.policy, attempt + 1):
        return _give_up(decision, observed, "Unschedulable", f"{what}; all {_max_attempts(job, observed.policy)} attempts are used")
    if isinstance(result, Infeasible):
        return _give_up(decision, observed, "Unschedulable", f"{what}; no other pool in the allowed regions fits: {result.message}")
    decision.events.append(Event("Warning", "Unschedulable", f"{what}; moving to {result.pool.name}"))
    return _launch(decision, observed, result, attempt=attempt + 1, note=f"moved from {pool}: its pods found no node")


def _pods_of_attempt(pods: Sequence[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    return [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL) == str(attempt)]


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


# ---------------------------------------------------------------------------
# failures
# ---------------------------------------------------------------------------


def _record_failed_pods(status: api.FineTuneJobStatus, attempt: int, pods: Sequence[dict[str, Any]]) -> None:
    """Put what each failed pod shows into the attempt's record now: the pod may be deleted
    (eviction, cleanup) and the operator may restart before the attempt is judged."""
    record = _attempt_record(status, attempt)
    if record is None:
        return
    known = {p.pod: p for p in record.failed_pods}
    for pod in pods:
        verdict = classify_pod(pod)
        if verdict is None or not verdict.pod:
            continue
        known[verdict.pod] = _pod_failure_record(verdict)
    if list(known.values()) != record.failed_pods:
        _update_record(status, attempt, failed_pods=sorted(known.values(), key=lambda p: p.pod))


def _record_where_it_ran(status: api.FineTuneJobStatus, attempt: int, pods: Sequence[dict[str, Any]]) -> None:
    """Add the nodes, trainer images and first start the attempt's pods show to its record as they
    appear (a pod may be gone by the time the attempt ends): the provenance record reads them."""
    record = _attempt_record(status, attempt)
    if record is None:
        return
    nodes, images, started = provenance.pod_facts(list(pods), trainer_containers())
    changes: dict[str, Any] = {}
    if not set(nodes) <= set(record.nodes):
        changes["nodes"] = sorted(set(record.nodes) | set(nodes))
    if not set(images) <= set(record.images):
        changes["images"] = sorted(set(record.images) | set(images))
    if started is not None and (record.running_since is None or started < record.running_since):
        changes["running_since"] = started
    if changes:
        _update_record(status, attempt, **changes)


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


def _pod_failure_record(failure: Failure) -> api.PodFailure:
    return api.PodFailure(
        pod=failure.pod or "", kind=failure.kind.value, source=failure.source,
        message=redact(failure.message)[:MAX_EVIDENCE_MESSAGE], exit_code=failure.exit_code,
        phase=failure.phase, step=failure.step, peak_allocated_gi_b=_gib(failure.peak_allocated_bytes),
        capacity_gi_b=_gib(failure.capacity_bytes), tried_to_allocate_gi_b=_gib(failure.tried_to_allocate_bytes),
        micro_batch_size=failure.micro_batch_size)


def _gib(value: int | None) -> float | None:
    # Two decimals, as the status shows it: the record must read back the same after a restart.
    return None if value is None else round(value / GiB, 2)


def _bytes(value: float | None) -> int | None:
    return None if value is None else int(round(value * GiB))


def _failure_of_record(record: api.PodFailure) -> Failure:
    try:
        kind = FailureKind(record.kind)
    except ValueError:
        kind = FailureKind.UNKNOWN
    return Failure(kind, record.message, record.source, pod=record.pod, exit_code=record.exit_code,
                   phase=record.phase, step=record.step, peak_allocated_bytes=_bytes(record.peak_allocated_gi_b),
                   capacity_bytes=_bytes(record.capacity_gi_b), tried_to_allocate_bytes=_bytes(record.tried_to_allocate_gi_b),
                   micro_batch_size=record.micro_batch_size)


def _failure_of_attempt(status: api.FineTuneJobStatus, attempt: int, child: Child,
                        pods: Sequence[dict[str, Any]]) -> Failure:
    """The verdict on the failed attempt, from every failed pod seen (present or gone) and the job."""
    record = _attempt_record(status, attempt)
    verdicts = [_failure_of_record(p) for p in (record.failed_pods if record is not None else [])]
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


def _recover(decision: Decision, observed: Observed, failure: Failure) -> Decision:
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
        _update_record(status, attempt, outcome=outcome, end_time=now, message=why, observed_peak_gi_b=observed_peak)
        # The failed training job and its terminated pods stay for inspection (its running pods
        # are cleaned by the training operator); the ownerReference removes them with the job.
        return _give_up(decision, observed, outcome, f"attempt {attempt}: {why}")

    decision.delete += _attempt_refs(observed, attempt_name(job.metadata.name, attempt))
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


def _give_up(decision: Decision, observed: Observed, reason: str, message: str) -> Decision:
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
            _update_record(decision.status, attempt, outcome="Failed", end_time=now, message=text)
        set_condition(decision.status, api.COND_BLOCKED, "False", "GaveUp", text, now, job.metadata.generation)
        return _give_up(decision, observed, "CreateRejected", f"{text}; retried for {policy.create_retry_seconds} s")
    return blocked(decision, observed, "CreateRejected", text)


def _clear_blocked(status: api.FineTuneJobStatus, now: datetime, generation: int | None) -> None:
    previous = condition(status, api.COND_BLOCKED)
    if previous is not None and previous.status == "True":
        set_condition(status, api.COND_BLOCKED, "False", "Resolved", f"was: {previous.message}", now, generation)


def _max_attempts(job: api.FineTuneJob, policy: ClusterPolicy) -> int:
    return job.spec.recovery.max_attempts or policy.default_max_attempts


def _attempts_left(job: api.FineTuneJob, policy: ClusterPolicy, attempt: int) -> bool:
    return attempt <= _max_attempts(job, policy)


def _backoff_seconds(backoff: api.BackoffSpec, attempt: int) -> float:
    return float(min(backoff.max_seconds, backoff.initial_seconds * 2 ** max(attempt - 1, 0)))


def _attempt_record(status: api.FineTuneJobStatus, attempt: int) -> api.AttemptStatus | None:
    return next((a for a in status.attempts if a.attempt == attempt), None)


def _update_record(status: api.FineTuneJobStatus, attempt: int, **changes: Any) -> None:
    for index, record in enumerate(status.attempts):
        if record.attempt == attempt:
            status.attempts[index] = record.model_copy(update=changes)
            return
