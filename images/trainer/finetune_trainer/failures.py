"""The failure vocabulary: every reason an attempt can fail for, written once.

One table, `FAILURES`, says for each kind of failure what it is called on the wire, how a
retry can help, how specific it is when the pods of one attempt disagree, the exit code
the trainer signals it with (only for the kinds the trainer itself reports), and the word
the FineTuneJob's `status.attempts[].outcome` shows for it. Everything else derives from
it: the trainer's failure report (`contract.FailureReport.reason`) and exit codes, the
operator's classifier (`recovery/classify.py`), the lifecycle's attempt outcomes and the
API's outcome enum (`api.AttemptStatus.outcome`, hence the CRD).

It lives in the trainer package, beside the contract, because both sides import it: the
trainer image has no operator code. Pure Python (no pydantic, no torch).

Adding a failure kind: a member of `FailureKind` and its row in `FAILURES` here, and the
code that recognises it (the trainer's `reporting.classify` for a kind the trainer
reports, the operator's `recovery/classify.py` or the lifecycle for one the operator
observes); then regenerate the CRD (the outcome enum grows).

Exit codes (documented, distinct from the signal codes 137 = SIGKILL / kernel OOM kill
and 143 = SIGTERM):

====  ==================  =====================================================
code  reason              meaning
====  ==================  =====================================================
0     -                   training finished
1     Unknown             anything unclassified (a retry may help)
65    DataError           the dataset cannot be read or parsed (retry cannot fix)
71    HostOutOfMemory     Python raised MemoryError (host RAM), or the launcher saw
                          a worker killed by SIGKILL while the container's memory
                          cgroup counted an OOM kill; the kernel OOM killer taking
                          the whole container shows as 137 with ``reason: OOMKilled``
75    GPUOutOfMemory      ``torch.OutOfMemoryError`` (retry with less memory)
78    ConfigError         the config is invalid or cannot run here (no retry)
====  ==================  =====================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

EXIT_OK = 0
EXIT_UNKNOWN = 1
EXIT_DATA_ERROR = 65
EXIT_HOST_OOM = 71
EXIT_GPU_OOM = 75
EXIT_CONFIG_ERROR = 78
# Not ours: what a signal death looks like, listed so no one reuses them.
EXIT_SIGKILL = 137
EXIT_SIGTERM = 143


class FailureKind(str, Enum):
    """Why an attempt failed. The values are the wire names (report, status, metrics)."""

    GPU_OUT_OF_MEMORY = "GPUOutOfMemory"
    HOST_OUT_OF_MEMORY = "HostOutOfMemory"
    EVICTED = "Evicted"
    NODE_LOST = "NodeLost"
    HUNG = "Hung"  # ran far past its predicted time: taken as hung (e.g. a collective that never returns)
    DATA_ERROR = "DataError"
    CONFIG_ERROR = "ConfigError"
    UNKNOWN = "Unknown"


class Remedy(str, Enum):
    """What a failure of this kind calls for."""

    ADJUST = "adjust"  # change the plan so it needs less memory
    RETRY_SAME = "retry-same"  # nothing was wrong with the plan: run it again
    GIVE_UP = "give-up"  # a retry cannot fix it (bad data, bad config)


@dataclass(frozen=True)
class Traits:
    """What the rest of the system needs to know of one failure kind."""

    remedy: Remedy
    # How specific the verdict is when the pods of one attempt disagree (higher wins): a GPU OOM
    # on rank 3 explains the NCCL errors of ranks 0-2, not the other way round.
    specificity: int
    # The trainer's exit code for it; None: the trainer never reports it, only the operator observes it.
    exit_code: int | None = None
    # `status.attempts[].outcome` for an attempt that failed so; None: the kind's own value.
    outcome: str | None = None


FAILURES: dict[FailureKind, Traits] = {
    FailureKind.GPU_OUT_OF_MEMORY: Traits(Remedy.ADJUST, 60, exit_code=EXIT_GPU_OOM),
    FailureKind.HOST_OUT_OF_MEMORY: Traits(Remedy.ADJUST, 50, exit_code=EXIT_HOST_OOM),
    FailureKind.EVICTED: Traits(Remedy.RETRY_SAME, 30),
    FailureKind.NODE_LOST: Traits(Remedy.RETRY_SAME, 30),
    FailureKind.DATA_ERROR: Traits(Remedy.GIVE_UP, 40, exit_code=EXIT_DATA_ERROR),
    FailureKind.CONFIG_ERROR: Traits(Remedy.GIVE_UP, 40, exit_code=EXIT_CONFIG_ERROR),
    FailureKind.HUNG: Traits(Remedy.RETRY_SAME, 20),
    # An attempt that failed for no reason anyone could tell "Failed" (the outcome it always had).
    FailureKind.UNKNOWN: Traits(Remedy.GIVE_UP, 0, exit_code=EXIT_UNKNOWN, outcome="Failed"),
}

# The kinds the trainer reports itself (with an exit code), in the table's order.
TRAINER_REPORTED: tuple[FailureKind, ...] = tuple(k for k, t in FAILURES.items() if t.exit_code is not None)


def outcome_of(kind: FailureKind) -> str:
    """The attempt outcome (`status.attempts[].outcome`) of a failure of this kind."""
    return FAILURES[kind].outcome or kind.value


# Every outcome an attempt can show: running or done, each failure kind's, an attempt whose pods
# found no node (moved or given up: not a failure of the attempt itself), and Unknown (in the API
# since its first version; the operator never writes it, an unknown failure shows "Failed").
ATTEMPT_OUTCOMES: tuple[str, ...] = (
    "Running",
    "Succeeded",
    *dict.fromkeys(outcome_of(k) for k in FAILURES),
    "Unschedulable",
    "Unknown",
)
