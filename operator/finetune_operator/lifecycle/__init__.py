"""The FineTuneJob state machine, as a pure function: what the shell saw in, what to do out.

`step(observed)` is called whenever something about a job may have changed (the job, its
training job, its pods) and on a timer. It returns the new status, the objects to create or
delete, and the events to post; the shell (`shell/reconciler.py`) does the I/O. Everything here
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

The modules, in the order they build on each other (none imports a later one):
  types.py       Observed, Decision, ObjectRef, Event; the requeue intervals
  conditions.py  setting and reading status conditions
  refs.py        an attempt's objects, as references to delete
  records.py     the attempt records in status.attempts, and what the pods showed
  validation.py  before a plan: invalid, waiting for a referred object, profiling first
  adoption.py    the status rebuilt from the children
  failures.py    a failed attempt: recover or give up; blocked; a refused create
  launch.py      planning, recording and creating an attempt
  starting.py    an attempt not running yet: scheduling and start bounds, moving pools
  follow.py      the current attempt: its end, a hang, suspend, a queue
  machine.py     `step`, in the order the work happens
"""

from .conditions import condition, set_condition
from .failures import blocked, create_refused
from .refs import network_policy_ref
from .machine import step
from .types import (
    BLOCKED_RETRY_SECONDS,
    MAX_EVIDENCE_MESSAGE,
    QUEUE_RETRY_SECONDS,
    REPLAN_AFTER_SECONDS,
    RESYNC_SECONDS,
    WAITING_RETRY_SECONDS,
    Decision,
    Event,
    ObjectRef,
    Observed,
)
from .validation import invalid

__all__ = [
    "BLOCKED_RETRY_SECONDS",
    "MAX_EVIDENCE_MESSAGE",
    "QUEUE_RETRY_SECONDS",
    "REPLAN_AFTER_SECONDS",
    "RESYNC_SECONDS",
    "WAITING_RETRY_SECONDS",
    "Decision",
    "Event",
    "ObjectRef",
    "Observed",
    "blocked",
    "condition",
    "create_refused",
    "invalid",
    "network_policy_ref",
    "set_condition",
    "step",
]
