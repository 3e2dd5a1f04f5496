"""The children are the truth of what runs: a status that lost track is rebuilt from them."""

from __future__ import annotations

from .. import api
from ..children import Child
from .records import attempt_record
from .refs import child_refs
from .types import Decision, Event, Observed


def reconcile_with_children(decision: Decision, observed: Observed) -> None:
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
    current = said if said is not None and attempt_record(status, said) is not None else None
    newest_child = children[-1] if children else None
    if newest_child is not None and (current is None or newest_child.attempt > current):
        _adopt_child_as_current(decision, observed, newest_child, said=said)
    elif current is None and status.attempts:
        _continue_after_history(decision, said)
    elif newest_child is not None and newest_child.attempt == current and status.plan is None:
        status.plan = newest_child.plan  # a plan the status lost (or could not read), from its child
    for child in children:
        if child.attempt != status.current_attempt:
            decision.delete += child_refs(child)


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
    record = attempt_record(status, child.attempt)
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
