"""The steps before a plan: a spec that cannot be accepted, an object the job refers to that does not
exist yet, and a model that must be profiled before it can be sized (profiling/state.py decides)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .. import api
from ..profiling import state as profiling
from ..sizing import SizingError
from .conditions import condition, set_condition
from .types import WAITING_RETRY_SECONDS, Decision, Event, ObjectRef, Observed


def profile_objects(decision: Decision, observed: Observed, resolved: Any) -> None:
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


def profile_first(decision: Decision, observed: Observed, step: Any) -> Decision:
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
    profile_objects(decision, observed, step)
    return decision


def waiting_for(decision: Decision, observed: Observed) -> Decision:
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


def architecture_problem(spec: api.FineTuneJobSpec, error: SizingError) -> api.FieldProblem:
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
