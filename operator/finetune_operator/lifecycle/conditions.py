"""Setting and reading the job's status conditions."""

from __future__ import annotations

from datetime import datetime

from .. import api


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


def clear_blocked(status: api.FineTuneJobStatus, now: datetime, generation: int | None) -> None:
    previous = condition(status, api.COND_BLOCKED)
    if previous is not None and previous.status == "True":
        set_condition(status, api.COND_BLOCKED, "False", "Resolved", f"was: {previous.message}", now, generation)
