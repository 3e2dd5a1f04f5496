"""What `kubectl get ftj` says about a job in one word: `status.reason`.

A printer column is one JSONPath and cannot choose between conditions, so the operator keeps
the choice in `status.reason`: the reason of the condition that explains the job's phase now.
A pure function of the status; the lifecycle calls it after each step.
"""

from __future__ import annotations

from . import api

# Per phase, the conditions (type, status) whose reason explains it, first match wins.
_BY_PHASE: dict[str, tuple[tuple[str, str], ...]] = {
    "Failed": ((api.COND_FAILED, "True"), (api.COND_VALIDATED, "False")),
    "Succeeded": (),
    "Suspended": ((api.COND_SUSPENDED, "True"),),
    "Queued": ((api.COND_QUEUED, "True"),),
    "Recovering": ((api.COND_RECOVERING, "True"),),
    # Validated=Unknown: waiting for an object the job refers to (WaitingForConfigMap), before any plan.
    "Pending": ((api.COND_VALIDATED, "Unknown"), (api.COND_PLANNED, "False"), (api.COND_VALIDATED, "False")),
    "Launching": ((api.COND_RUNNING, "False"),),
    "Running": (),
}
# A phase this module does not know (written by a newer operator): the usual suspects, in order.
_ANY_PHASE: tuple[tuple[str, str], ...] = (
    (api.COND_FAILED, "True"),
    (api.COND_QUEUED, "True"),
    (api.COND_PLANNED, "False"),
    (api.COND_RUNNING, "False"),
    (api.COND_VALIDATED, "False"),
    (api.COND_VALIDATED, "Unknown"),
)


def status_reason(status: api.FineTuneJobStatus) -> str | None:
    """The reason of the condition that matters now, or None when the phase says it all.

    Blocked=True wins in every phase (the operator waits for a person). Otherwise the condition
    that explains the phase: Failed's for Failed, Queued's for Queued, Validated=Unknown's
    (WaitingForConfigMap), Planned=False's (NoFit) or Validated=False's for Pending, Running=False's (Unschedulable, NotStarting) for Launching,
    Recovering's (GPUOutOfMemory, ...) for Recovering, Suspended's for Suspended; nothing for
    Running and Succeeded. A reason that only repeats the phase is left out."""
    by_type = {c.type: c for c in status.conditions}
    wanted = ((api.COND_BLOCKED, "True"),) + _BY_PHASE.get(status.phase, _ANY_PHASE)
    for type_, state in wanted:
        found = by_type.get(type_)
        if found is not None and found.status == state:
            return None if found.reason == status.phase else found.reason
    return None
