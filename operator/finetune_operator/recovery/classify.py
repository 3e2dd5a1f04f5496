"""Why did an attempt fail? Classification from the pods and the training job of the attempt.

Sources, most trusted first:
1. our trainer's failure report in a container's termination message (the contract);
2. what the kubelet says of the container: `reason: OOMKilled` (the kernel killed it for
   host memory, exit code 137);
3. the log tail that `FallbackToLogsOnError` puts in the termination message, so images
   that are not ours recover too: a CUDA out-of-memory error (GPU), a Python MemoryError
   (host), or torchrun reporting that a worker died of SIGKILL (`exitcode: -9`, "Signal 9
   (SIGKILL) received by PID"): the kernel's OOM killer picked one worker of a container
   that stayed under its limit as a whole, so it is read as host memory;
4. what happened to the pod: eviction, preemption, node loss (a `DisruptionTarget`
   condition, `reason: Evicted`, phase Unknown). A container's own specific verdict (1-3)
   wins over it: a pod that ran out of GPU memory and was then marked for deletion failed
   because of its plan, not because of the disruption;
5. the exit code alone, read by the contract's table only when the container shows it ran
   our trainer (its structured JSON log lines are in the tail). Other programs use the
   same numbers for other things (sysexits: 75 is EX_TEMPFAIL, 71 EX_OSERR, 65 EX_DATAERR,
   78 EX_CONFIG), so without that evidence the code says nothing: Unknown.

All ranks of a job fail when one of them does (torchrun tears the group down), so the
pods' verdicts are merged and the most specific one wins: a GPU OOM on rank 3 explains
the NCCL errors of ranks 0-2, not the other way round.

Every message of a verdict is redacted (`redact.bounded`): the termination message is
whatever the process printed last, and the verdict is quoted into conditions and Events.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from finetune_trainer import contract
from finetune_trainer.failures import FAILURES, FailureKind, Remedy

from ..rendering.backend import trainer_containers
from .redact import bounded, redact


# The failure vocabulary (kinds, remedies, how specific each is) is the trainer package's
# `finetune_trainer.failures`: one table that the trainer's report, this classifier, the
# lifecycle's attempt outcomes and the API's outcome enum all read.
_SOURCE_TRUST = {"report": 3, "log": 2, "kubelet": 2, "pod": 1, "exit-code": 1, "job": 0}

@dataclass(frozen=True)
class Failure:
    """The verdict on one failed attempt."""

    kind: FailureKind
    message: str
    source: str  # report | log | kubelet | pod | exit-code | job
    pod: str | None = None
    exit_code: int | None = None
    phase: str | None = None  # training phase (forward, backward, optimizer, ...)
    step: int | None = None
    peak_allocated_bytes: int | None = None
    capacity_bytes: int | None = None  # GPU memory the process could see
    tried_to_allocate_bytes: int | None = None
    micro_batch_size: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Redacted and bounded here, once, whichever path built the verdict: the message
        # goes to conditions, the attempt history and Events as it is.
        object.__setattr__(self, "message", bounded(self.message or ""))

    @property
    def remedy(self) -> Remedy:
        return FAILURES[self.kind].remedy

    def describe(self) -> str:
        """One line for a person: 'GPU OOM in backward at step 0, 79.1 of 80.0 GiB'."""
        if self.kind is FailureKind.GPU_OUT_OF_MEMORY:
            where = f" in {self.phase}" if self.phase else ""
            when = f" at step {self.step}" if self.step is not None else ""
            used = ""
            if self.peak_allocated_bytes is not None and self.capacity_bytes:
                used = f", {gib(self.peak_allocated_bytes):.1f} of {gib(self.capacity_bytes):.1f} GiB"
            elif self.capacity_bytes:
                used = f" on a {gib(self.capacity_bytes):.1f} GiB GPU"
            return f"GPU OOM{where}{when}{used}"
        if self.kind is FailureKind.HOST_OUT_OF_MEMORY:
            return f"host memory exhausted ({self.message})" if self.message else "host memory exhausted"
        return f"{self.kind.value}: {self.message}" if self.message else self.kind.value


def gib(value: int | float) -> float:
    return value / 2**30


# ---------------------------------------------------------------------------
# CUDA OOM messages in a log tail
# ---------------------------------------------------------------------------

_OOM_MARKERS = (
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "HIP out of memory",
)
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*(B|bytes|KiB|MiB|GiB|TiB)"
_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch >= 2.1: "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which
# 1.53 GiB is free. ... Of the allocated memory 75.62 GiB is allocated by PyTorch, ..."
_TRIED = re.compile(r"Tried to allocate " + _SIZE)
_CAPACITY_NEW = re.compile(r"total capacity of " + _SIZE)
_ALLOCATED_NEW = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
# torch < 2.1: "(GPU 0; 15.78 GiB total capacity; 14.56 GiB already allocated; ...)"
_CAPACITY_OLD = re.compile(_SIZE + r" total capacity")
_ALLOCATED_OLD = re.compile(_SIZE + r" already allocated")
_HOST_MEMORY_ERROR = re.compile(r"^\s*MemoryError\b", re.MULTILINE)


def _size(match: re.Match[str] | None) -> int | None:
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def parse_cuda_oom(log_tail: str) -> dict[str, int | None] | None:
    """The figures of a CUDA OOM error in a log tail, or None when there is no such error."""
    if not log_tail or not any(marker in log_tail for marker in _OOM_MARKERS):
        return None
    # The last error in the tail is the one that killed the process.
    start = max(log_tail.rfind(marker) for marker in _OOM_MARKERS)
    text = log_tail[start:]
    return {
        "tried_to_allocate_bytes": _size(_TRIED.search(text)),
        "capacity_bytes": _size(_CAPACITY_NEW.search(text) or _CAPACITY_OLD.search(text)),
        "peak_allocated_bytes": _size(_ALLOCATED_NEW.search(text) or _ALLOCATED_OLD.search(text)),
    }


# ---------------------------------------------------------------------------
# One pod
# ---------------------------------------------------------------------------


def _terminated_states(pod: dict[str, Any]) -> Iterable[dict[str, Any]]:
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        # A pod with a sidecar: only the container that runs the trainer (each backend names it) says why.
        if cs.get("name") not in trainer_containers() and len(status.get("containerStatuses") or []) > 1:
            continue
        for key in ("state", "lastState"):
            terminated = ((cs.get(key) or {}).get("terminated")) or None
            if terminated:
                yield terminated
    for cs in status.get("initContainerStatuses") or []:
        terminated = ((cs.get("state") or {}).get("terminated")) or None
        if terminated and terminated.get("exitCode", 0) != 0:
            yield terminated


def _name(pod: dict[str, Any]) -> str | None:
    return (pod.get("metadata") or {}).get("name")


def classify_pod(pod: dict[str, Any]) -> Failure | None:
    """The verdict on one pod, or None when it did not fail."""
    name = _name(pod)
    status = pod.get("status") or {}

    verdicts = [v for v in (_classify_terminated(t, name) for t in _terminated_states(pod)) if v is not None]
    own = most_specific(verdicts) if verdicts else None
    # The container's own specific verdict (a report, OOMKilled, an error in its log, a
    # trusted exit code) says why it ended; a disruption is what the pod went through
    # meanwhile. An Unknown exit (SIGTERM 143, NCCL errors after a peer vanished) is what a
    # disruption looks like from inside, so there the disruption is the better answer.
    if own is not None and own.kind is not FailureKind.UNKNOWN:
        return own
    disrupted = _disruption(status, name)
    if disrupted is not None:
        return disrupted
    if own is not None:
        return own
    if status.get("phase") == "Failed":
        return Failure(FailureKind.UNKNOWN, status.get("message") or "pod failed", "pod", pod=name)
    if (pod.get("metadata") or {}).get("deletionTimestamp") and status.get("phase") in ("Pending", "Running", None):
        # Deleted before it ended, with nothing of its own to say: pushed off (a drain, an
        # eviction, a person), not a fault of the plan; the same plan may run again.
        return Failure(FailureKind.EVICTED, "the pod was deleted while it ran (a drain, an eviction or a person)",
                       "pod", pod=name)
    return None


def _disruption(status: dict[str, Any], pod: str | None) -> Failure | None:
    """Eviction, preemption or node loss of the pod, or None."""
    # The node went away or the pod was pushed off it: nothing wrong with the plan.
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            reason = condition.get("reason") or ""
            kind = FailureKind.NODE_LOST if reason in ("DeletionByTaintManager", "DeletionByPodGC") else FailureKind.EVICTED
            return Failure(kind, f"{reason}: {condition.get('message', '')}".strip(": "), "pod", pod=pod)
    pod_reason = status.get("reason") or ""
    if pod_reason == "Evicted":
        # Kubelet eviction for node pressure. Eviction for memory pressure is the node's
        # problem (other pods), unless our pod was over its request - it never is, request == limit.
        return Failure(FailureKind.EVICTED, status.get("message") or "evicted", "pod", pod=pod)
    if pod_reason in ("NodeLost", "NodeShutdown", "Terminated") or status.get("phase") == "Unknown":
        return Failure(FailureKind.NODE_LOST, status.get("message") or pod_reason or "node lost", "pod", pod=pod)
    return None


# torchrun (torch.distributed.elastic) when a worker dies of a signal: the agent's log line
#   "... api.py:...] failed (exitcode: -9) local_rank: 1 (pid: 57) of binary: /usr/bin/python"
# and the ChildFailedError summary
#   "Root Cause (first observed failure): ... exitcode  : -9 (pid: 57) ... traceback : Signal 9 (SIGKILL) received by PID 57"
_ROOT_CAUSE = re.compile(r"Root Cause[^\n]*\n(?:.*\n){0,8}?\s*exitcode\s*:\s*(-?\d+)")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_SIGKILL_RECEIVED = re.compile(r"Signal 9 \(SIGKILL\) received by PID (\d+)")
_ROOT_RANK = re.compile(r"Root Cause[^\n]*\n(?:.*\n){0,8}?\s*rank\s*:\s*(\d+)")


def parse_worker_sigkill(log_tail: str) -> str | None:
    """When torchrun says its (first) failed worker was killed by SIGKILL, a description; else None.

    The first failure is what the Root Cause block (or the agent's first `failed
    (exitcode: N)` line) names: a worker killed after a peer failed shows -9 or -15 too,
    but never as the first failure. Inside a container whose other processes lived on,
    nothing but the kernel's OOM killer sends SIGKILL to one worker: a person's `kill -9`
    is the rare exception, and a kill of the whole container (preemption, the cgroup
    limit) shows on the container, not in torchrun's log."""
    if not log_tail or "exitcode" not in log_tail and "SIGKILL" not in log_tail:
        return None
    root = _ROOT_CAUSE.search(log_tail)
    if root is not None:
        if int(root.group(1)) != -9:
            return None
        rank = _ROOT_RANK.search(log_tail)
        who = f"rank {rank.group(1)}" if rank else "a worker"
    else:
        first = _AGENT_FAILED.search(log_tail)
        if first is not None:
            if int(first.group(1)) != -9:
                return None
            who = f"local rank {first.group(2)}"
        elif _SIGKILL_RECEIVED.search(log_tail):
            who = "a worker"
        else:
            return None
    return (f"torchrun: {who} was killed by SIGKILL (exitcode -9) while the container lived on: "
            "most likely the kernel's OOM killer (host memory)")


def _classify_terminated(terminated: dict[str, Any], pod: str | None) -> Failure | None:
    exit_code = terminated.get("exitCode")
    if exit_code == 0:
        return None
    # Redacted before any line is picked from it: a private key spans lines, and the
    # line picked must not be the middle of one.
    message = redact(terminated.get("message") or "")
    reason = terminated.get("reason") or ""

    report = contract.parse_failure_report(terminated.get("message"))
    # A rank that failed with a collective error (Unknown) after its peer vanished may have
    # written the report before the kernel killed the whole container: the kill says more.
    if report is not None and not (reason == "OOMKilled" and report.reason is contract.FailureReason.UNKNOWN):
        return Failure(
            report.reason,
            report.message,
            "report",
            pod=pod,
            exit_code=exit_code,
            phase=report.phase.value,
            step=report.step,
            peak_allocated_bytes=report.peak_allocated_bytes,
            capacity_bytes=report.device_total_bytes,
            micro_batch_size=report.micro_batch_size,
            details={"peakReservedBytes": report.peak_reserved_bytes, "rank": report.rank},
        )
    if reason == "OOMKilled":
        return Failure(
            FailureKind.HOST_OUT_OF_MEMORY,
            "the kernel killed the container for exceeding its memory limit (OOMKilled, exit 137)",
            "kubelet",
            pod=pod,
            exit_code=exit_code,
        )
    oom = parse_cuda_oom(message)
    if oom is not None:
        return Failure(
            FailureKind.GPU_OUT_OF_MEMORY,
            _last_line_with(message, _OOM_MARKERS),
            "log",
            pod=pod,
            exit_code=exit_code,
            peak_allocated_bytes=oom["peak_allocated_bytes"],
            capacity_bytes=oom["capacity_bytes"],
            tried_to_allocate_bytes=oom["tried_to_allocate_bytes"],
        )
    if _HOST_MEMORY_ERROR.search(message):
        return Failure(FailureKind.HOST_OUT_OF_MEMORY, "Python raised MemoryError", "log", pod=pod, exit_code=exit_code)
    killed = parse_worker_sigkill(message)
    if killed is not None:
        return Failure(FailureKind.HOST_OUT_OF_MEMORY, killed, "log", pod=pod, exit_code=exit_code)
    if exit_code is None:
        return Failure(FailureKind.UNKNOWN, reason or "terminated", "pod", pod=pod)
    tail = _tail(message)
    text = f"exit code {exit_code}" + (f" ({reason})" if reason and reason != "Error" else "")
    by_code = contract.reason_for_exit_code(int(exit_code))
    kind = by_code or FailureKind.UNKNOWN
    if kind is not FailureKind.UNKNOWN and not _ran_our_trainer(message):
        # One of the contract's codes, but nothing shows the process was our trainer (it
        # would have written a report): other programs mean other things by it.
        text += f" (the trainer's code for {by_code.value}, but without its failure report: not read as one)"
        kind = FailureKind.UNKNOWN
    return Failure(kind, f"{text}: {tail}" if tail else text, "exit-code", pod=pod, exit_code=exit_code)


def _ran_our_trainer(log_tail: str) -> bool:
    """Whether the log tail holds our trainer's structured log lines (`reporting.log_json`:
    one JSON object a line with `event`, `time` and `rank`): the evidence that an exit code
    without a report still follows the contract (the report could not be written)."""
    for line in log_tail.splitlines():
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("event"), str) and "time" in record and "rank" in record:
            return True
    return False


def _last_line_with(text: str, markers: tuple[str, ...]) -> str:
    for line in reversed(text.splitlines()):
        if any(m in line for m in markers):
            return line.strip()[:500]
    return _tail(text)


def _tail(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def most_specific(verdicts: list[Failure]) -> Failure:
    """The verdict that explains the others: the most specific kind, then the most trusted source."""
    if not verdicts:
        raise ValueError("most_specific: no verdicts")
    return max(verdicts, key=lambda v: (FAILURES[v.kind].specificity, _SOURCE_TRUST.get(v.source, 0)))


_most_specific = most_specific  # the name lifecycle.py imported first


# ---------------------------------------------------------------------------
# One attempt
# ---------------------------------------------------------------------------


def classify_attempt(pods: list[dict[str, Any]], training_job: dict[str, Any] | None = None) -> Failure:
    """The verdict on a failed attempt, from all its pods and its training job (of any backend)."""
    verdicts = [v for v in (classify_pod(p) for p in pods) if v is not None]
    if verdicts:
        return most_specific(verdicts)
    message = _job_failure_message(training_job)
    if pods == [] and message is None:
        message = "the attempt failed and its pods are gone"
    return Failure(FailureKind.UNKNOWN, message or "the attempt failed without a reason", "job")


def _job_failure_message(training_job: dict[str, Any] | None) -> str | None:
    for condition in ((training_job or {}).get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Failed" and condition.get("status") == "True":
            return condition.get("message") or condition.get("reason")
    return None
