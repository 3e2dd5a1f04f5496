"""The fake GPU's decision: how a training pod on a fake node ends. Pure functions of plain data.

A test sets a rule (annotations on the pod, on its FineTuneJob, or keys of the namespace's
`finetune-lab` ConfigMap; the first that has a key wins, key by key). The pod carries what the
GPU allocator would see: `finetune.dev/predicted-peak-bytes`, the per-GPU peak our estimator
predicted. The node carries its GPU memory in `nvidia.com/gpu.memory` (MiB, as GFD labels it).

    true peak = predicted x true-peak-factor
    outcome auto:  true peak > GPU memory  -> GPU OOM (exit 75, failure report)
                   otherwise               -> success (exit 0)
    outcome gpu-oom | host-oom | evicted | succeed | fail: forced
    outcome-by-attempt "host-oom,auto": the outcome of attempt N (pod label finetune.dev/attempt)
                   is the N-th entry, the last one repeating; it overrides `outcome`

A GPU OOM ends the container the way our trainer does (finetune_trainer.contract: exit code
EXIT_GPU_OOM, FailureReport JSON in the termination message); a host OOM the way the kubelet
does (reason OOMKilled, exit 137, no message); "fail" with exit code 1 (or fail-exit-code) and
the test's message verbatim, as an image that is not ours would; "evicted" the way the kubelet
ends a pod it evicts for node pressure (pod phase Failed, pod reason Evicted with the kubelet's
message, the container killed with exit 137).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from finetune_trainer.contract import (
    EXIT_GPU_OOM,
    EXIT_OK,
    EXIT_SIGKILL,
    EXIT_UNKNOWN,
    FailureReason,
    FailureReport,
    Phase,
)

PREFIX = "lab.finetune.dev/"
RULE_KEYS = ("outcome", "true-peak-factor", "fail-message", "fail-exit-code", "run-duration", "oom-phase",
             "outcome-by-attempt", "oom-step", "host-memory-scale")
OUTCOMES = ("auto", "succeed", "gpu-oom", "host-oom", "evicted", "fail")
RULES_CONFIGMAP = "finetune-lab"

JOB_LABEL = "finetune.dev/job"
ATTEMPT_LABEL = "finetune.dev/attempt"
PREDICTED_PEAK_ANNOTATION = "finetune.dev/predicted-peak-bytes"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"

# Annotations the fake GPU writes on the pod; the lab's kwok stage `lab-pod-terminate`
# reads them and performs the status change (see e2e/lab/stages.py).
VERDICT_EXIT_CODE = PREFIX + "exit-code"
VERDICT_REASON = PREFIX + "container-reason"
VERDICT_MESSAGE = PREFIX + "termination-message"
VERDICT_PHASE = PREFIX + "pod-phase"
VERDICT_DELAY = PREFIX + "terminate-after"
VERDICT_SUMMARY = PREFIX + "verdict"
# Pod-level status.reason / status.message (only for verdicts that set them, e.g. an eviction).
VERDICT_POD_REASON = PREFIX + "pod-reason"
VERDICT_POD_MESSAGE = PREFIX + "pod-message"
EVICTION_MESSAGE = ("The node was low on resource: memory. Threshold quantity: 100Mi, available: 51200Ki. "
                    "(finetune lab: evicted by rule)")

MIB = 1024 * 1024
GIB = 1024 * MIB
_DURATION = re.compile(r"^\d+(\.\d+)?(ms|s|m)$")


class RuleError(ValueError):
    """A rule value a test set is malformed; the message names the key and where it was set."""


@dataclass(frozen=True)
class RuleSource:
    """One place rules can be set, e.g. ("pod team-a/x-master-0", {"outcome": "host-oom"})."""

    where: str
    values: Mapping[str, str]


@dataclass(frozen=True)
class Rule:
    outcome: str = "auto"
    true_peak_factor: float = 1.0
    fail_message: str = "training failed (lab rule: fail)"
    fail_exit_code: int = EXIT_UNKNOWN
    run_duration: str = "2s"
    oom_phase: Phase = Phase.BACKWARD
    outcome_by_attempt: tuple[str, ...] = ()
    # Real-node pods only (gpuwebhook.py): the global step at which the real trainer raises the lab
    # GPU's OOM (None: the attempt's first step), and the share of the pod's memory request and limit
    # the webhook gives it (this machine is far smaller than the nodes the lab plays).
    oom_step: int | None = None
    host_memory_scale: float = 1.0

    def outcome_for(self, attempt: int | None) -> str:
        """The outcome for attempt `attempt` (from 1): `outcome-by-attempt` when set, else `outcome`."""
        if not self.outcome_by_attempt or attempt is None:
            return self.outcome
        return self.outcome_by_attempt[min(max(attempt, 1), len(self.outcome_by_attempt)) - 1]


def rule_values_from_annotations(annotations: Mapping[str, str] | None) -> dict[str, str]:
    return {k[len(PREFIX):]: v for k, v in (annotations or {}).items() if k.startswith(PREFIX) and k[len(PREFIX):] in RULE_KEYS}


def resolve_rule(sources: list[RuleSource]) -> Rule:
    """Merge sources (most specific first) key by key and validate every value."""
    chosen: dict[str, tuple[str, str]] = {}
    for src in sources:
        for key, value in src.values.items():
            if key in RULE_KEYS and key not in chosen:
                chosen[key] = (value, src.where)

    def bad(key: str, why: str) -> RuleError:
        value, where = chosen[key]
        return RuleError(f"lab rule {PREFIX}{key}={value!r} on {where}: {why}")

    kwargs: dict = {}
    if "outcome" in chosen:
        value = chosen["outcome"][0].strip()
        if value not in OUTCOMES:
            raise bad("outcome", f"must be one of {', '.join(OUTCOMES)}")
        kwargs["outcome"] = value
    if "true-peak-factor" in chosen:
        try:
            factor = float(chosen["true-peak-factor"][0])
        except ValueError:
            raise bad("true-peak-factor", "must be a positive number such as 1.15") from None
        if not math.isfinite(factor) or factor <= 0:
            raise bad("true-peak-factor", "must be a positive number such as 1.15")
        kwargs["true_peak_factor"] = factor
    if "fail-message" in chosen:
        kwargs["fail_message"] = chosen["fail-message"][0]
    if "fail-exit-code" in chosen:
        try:
            code = int(chosen["fail-exit-code"][0])
        except ValueError:
            raise bad("fail-exit-code", "must be an integer 1..255") from None
        if not 1 <= code <= 255:
            raise bad("fail-exit-code", "must be an integer 1..255")
        kwargs["fail_exit_code"] = code
    if "run-duration" in chosen:
        value = chosen["run-duration"][0].strip()
        if not _DURATION.match(value):
            raise bad("run-duration", "must be a duration such as 500ms, 2s or 1m")
        kwargs["run_duration"] = value
    if "oom-phase" in chosen:
        try:
            kwargs["oom_phase"] = Phase(chosen["oom-phase"][0].strip())
        except ValueError:
            raise bad("oom-phase", f"must be one of {', '.join(p.value for p in Phase)}") from None
    if "oom-step" in chosen:
        try:
            step = int(chosen["oom-step"][0])
        except ValueError:
            raise bad("oom-step", "must be an integer step >= 1") from None
        if step < 1:
            raise bad("oom-step", "must be an integer step >= 1")
        kwargs["oom_step"] = step
    if "host-memory-scale" in chosen:
        try:
            scale = float(chosen["host-memory-scale"][0])
        except ValueError:
            raise bad("host-memory-scale", "must be a number in (0, 1]") from None
        if not (0 < scale <= 1) or math.isnan(scale):
            raise bad("host-memory-scale", "must be a number in (0, 1]")
        kwargs["host_memory_scale"] = scale
    if "outcome-by-attempt" in chosen:
        values = tuple(v.strip() for v in chosen["outcome-by-attempt"][0].split(","))
        if not values or any(v not in OUTCOMES for v in values):
            raise bad("outcome-by-attempt", f"must be a comma-separated list of {', '.join(OUTCOMES)}")
        kwargs["outcome_by_attempt"] = values
    return Rule(**kwargs)


@dataclass(frozen=True)
class TrainingPod:
    """What the fake GPU needs to know about one pod and the node it landed on."""

    name: str
    predicted_peak_bytes: int | None
    gpu_memory_mib: int | None
    rank: int = 0
    attempt: int | None = None  # the pod's finetune.dev/attempt label, when it has one


@dataclass(frozen=True)
class Verdict:
    exit_code: int
    container_reason: str
    termination_message: str
    pod_phase: str  # Succeeded | Failed
    terminate_after: str
    summary: str
    pod_reason: str = ""
    pod_message: str = ""

    def annotations(self) -> dict[str, str]:
        out = {
            VERDICT_EXIT_CODE: str(self.exit_code),
            VERDICT_REASON: self.container_reason,
            VERDICT_MESSAGE: self.termination_message,
            VERDICT_PHASE: self.pod_phase,
            VERDICT_DELAY: self.terminate_after,
            VERDICT_SUMMARY: self.summary,
        }
        if self.pod_reason:
            out[VERDICT_POD_REASON] = self.pod_reason
            out[VERDICT_POD_MESSAGE] = self.pod_message
        return out


def parse_predicted_peak(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise RuleError(f"pod annotation {PREDICTED_PEAK_ANNOTATION}={value!r} is not an integer byte count") from None
    if n < 0:
        raise RuleError(f"pod annotation {PREDICTED_PEAK_ANNOTATION}={value!r} is negative")
    return n


def parse_gpu_memory_mib(value: str | None, node: str) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise RuleError(f"node {node} label {GPU_MEMORY_LABEL}={value!r} is not an integer MiB count") from None
    if n <= 0:
        raise RuleError(f"node {node} label {GPU_MEMORY_LABEL}={value!r} must be positive")
    return n


def lab_failure(message: str) -> Verdict:
    """The lab itself cannot judge the pod (bad rule, missing annotation): fail it loudly."""
    return Verdict(EXIT_UNKNOWN, "Error", f"finetune lab: {message}", "Failed", "0s", f"lab-error: {message}")


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def gpu_oom_report(pod: TrainingPod, rule: Rule, true_peak: int, device_total: int) -> FailureReport:
    # A real allocator fails before the card is full: the CUDA context and fragmentation take a
    # few percent, so what torch reports as allocated at the failure is below the total.
    allocated = min(true_peak, int(device_total * 0.97))
    reserved = min(true_peak, int(device_total * 0.99))
    tried = max(true_peak - allocated, 2 * MIB)
    message = (
        f"CUDA out of memory. Tried to allocate {_gib(tried)}. GPU {pod.rank % 8} has a total capacity of "
        f"{_gib(device_total)} of which {_gib(device_total - reserved)} is free. Of the allocated memory "
        f"{_gib(allocated)} is allocated by PyTorch. (finetune lab: true peak {_gib(true_peak)} = "
        f"predicted {_gib(pod.predicted_peak_bytes or 0)} x {rule.true_peak_factor:g})"
    )
    return FailureReport(
        reason=FailureReason.GPU_OUT_OF_MEMORY,
        phase=rule.oom_phase,
        step=0,
        message=message,
        exit_code=EXIT_GPU_OOM,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        device_total_bytes=device_total,
        rank=pod.rank,
    )


def decide(pod: TrainingPod, rule: Rule) -> Verdict:
    outcome = rule.outcome_for(pod.attempt)
    if outcome == "evicted":
        return Verdict(EXIT_SIGKILL, "Error", "", "Failed", rule.run_duration, "evicted (rule)",
                       pod_reason="Evicted", pod_message=EVICTION_MESSAGE)
    if outcome == "host-oom":
        return Verdict(EXIT_SIGKILL, "OOMKilled", "", "Failed", rule.run_duration, "host-oom (rule)")
    if outcome == "fail":
        return Verdict(rule.fail_exit_code, "Error", rule.fail_message, "Failed", rule.run_duration, "fail (rule)")
    if outcome == "succeed":
        return Verdict(EXIT_OK, "Completed", "", "Succeeded", rule.run_duration, "succeed (rule)")

    if pod.gpu_memory_mib is None:
        return lab_failure(f"pod {pod.name} landed on a node without the {GPU_MEMORY_LABEL} label")
    device_total = pod.gpu_memory_mib * MIB
    if pod.predicted_peak_bytes is None and outcome == "auto":
        return lab_failure(f"pod {pod.name} has no {PREDICTED_PEAK_ANNOTATION} annotation to judge it by")
    true_peak = int((pod.predicted_peak_bytes or device_total) * rule.true_peak_factor)
    if outcome == "gpu-oom" or true_peak > device_total:
        true_peak = max(true_peak, device_total + 1)
        report = gpu_oom_report(pod, rule, true_peak, device_total)
        summary = f"gpu-oom: true peak {_gib(true_peak)} > {_gib(device_total)}"
        return Verdict(
            EXIT_GPU_OOM, "Error", report.to_termination_message(), "Failed", rule.run_duration, summary
        )
    summary = f"succeed: true peak {_gib(true_peak)} <= {_gib(device_total)}"
    return Verdict(EXIT_OK, "Completed", "", "Succeeded", rule.run_duration, summary)


def rank_of(labels: Mapping[str, str] | None) -> int:
    """Kubeflow's rank convention: the master is rank 0, worker i is rank i + 1 (PyTorchJob); a TrainJob's
    pods (one Indexed Job of its JobSet) are ranked by their completion index."""
    labels = labels or {}
    if "batch.kubernetes.io/job-completion-index" in labels:
        try:
            return int(labels["batch.kubernetes.io/job-completion-index"])
        except ValueError:
            return 0
    rtype = labels.get("training.kubeflow.org/replica-type", "").lower()
    try:
        index = int(labels.get("training.kubeflow.org/replica-index", "0"))
    except ValueError:
        index = 0
    return index + 1 if rtype == "worker" else index


def attempt_of(labels: Mapping[str, str] | None) -> int | None:
    """The attempt number from the pod's finetune.dev/attempt label, or None."""
    try:
        return int((labels or {}).get(ATTEMPT_LABEL, ""))
    except ValueError:
        return None


# ---- the lab GPU of a real trainer (the real nodes' gpuwebhook.py) ------------------------------
# The environment finetune_trainer.faults reads (its LAB_* names): the node's GPU memory and the
# peak this pod's plan truly reaches there; the trainer raises the OOM itself when it does not fit.
LAB_GPU_MEMORY_ENV = "FINETUNE_LAB_GPU_MEMORY_BYTES"
LAB_PEAK_ENV = "FINETUNE_LAB_PEAK_BYTES"
LAB_OOM_STEP_ENV = "FINETUNE_LAB_OOM_STEP"
LAB_OOM_PHASE_ENV = "FINETUNE_LAB_OOM_PHASE"
REAL_OUTCOMES = ("auto", "gpu-oom")
REAL_OOM_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)


def lab_gpu_environment(pod: TrainingPod, rule: Rule) -> dict[str, str]:
    """What the lab puts in a real trainer's environment: the same rule as decide()
    (true peak = predicted x true-peak-factor, or forced over the GPU's memory by gpu-oom),
    applied by the trainer at a real step. Outcomes the fake GPU fakes (host-oom, evicted, fail,
    succeed) are real events for real processes and are refused here (RuleError)."""
    outcome = rule.outcome_for(pod.attempt)
    if outcome not in REAL_OUTCOMES:
        raise RuleError(f"lab rule outcome {outcome!r} for pod {pod.name}: a pod of a real node "
                        f"takes only {', '.join(REAL_OUTCOMES)} (its host OOMs, evictions and failures are real)")
    if rule.oom_phase not in REAL_OOM_PHASES:
        raise RuleError(f"lab rule oom-phase {rule.oom_phase.value!r} for pod {pod.name}: the real trainer raises "
                        f"the lab GPU's OOM in {', '.join(p.value for p in REAL_OOM_PHASES)}")
    if pod.gpu_memory_mib is None:
        raise RuleError(f"pod {pod.name} landed on a node without the {GPU_MEMORY_LABEL} label")
    device_total = pod.gpu_memory_mib * MIB
    if pod.predicted_peak_bytes is None and outcome == "auto":
        raise RuleError(f"pod {pod.name} has no {PREDICTED_PEAK_ANNOTATION} annotation to judge it by")
    true_peak = int((pod.predicted_peak_bytes or device_total) * rule.true_peak_factor)
    if outcome == "gpu-oom":
        true_peak = max(true_peak, device_total + 1)
    env = {LAB_GPU_MEMORY_ENV: str(device_total), LAB_PEAK_ENV: str(true_peak),
           LAB_OOM_PHASE_ENV: rule.oom_phase.value}
    if rule.oom_step is not None:
        env[LAB_OOM_STEP_ENV] = str(rule.oom_step)
    return env
