"""Prometheus metrics of the operator, served on the port the chart exposes (`/metrics`).

The chart's Grafana dashboard and PrometheusRule read these names (tests/chart checks that
every query names only metrics this module exports):

| metric | type | labels | what |
| --- | --- | --- | --- |
| `finetune_jobs` | gauge | phase | FineTuneJobs this operator follows, by phase |
| `finetune_attempts_total` | counter | | attempts launched (training jobs created) |
| `finetune_recoveries_total` | counter | kind, action | failed attempts by failure kind and what followed: `retry`, `moved` (unschedulable, moved to another pool) or `gave-up` |
| `finetune_jobs_finished_total` | counter | result, reason | jobs that ended: `Succeeded`, or `Failed` for good with the reason of their Failed condition |
| `finetune_reconcile_seconds` | histogram | planned | time of one reconcile |
| `finetune_planning_seconds` | histogram | result | time of a reconcile that searched for a plan: `launched`, `replanned` (after a failure), `nofit` |
| `finetune_observed_to_predicted_peak_ratio` | histogram | | observed peak GPU memory over the predicted peak of failed attempts that reported one |
| `finetune_gpu_seconds_total` | counter | pool, region, gpu_type | GPU time of attempts while the job is Running: the plan's GPUs times the time |
| `finetune_gpus_running` | gauge | pool, region, gpu_type | GPUs of the attempts running now |
| `finetune_job_phase_since_timestamp_seconds` | gauge | job_namespace, job_name, phase | when each unfinished job entered its phase (Unix time) |
| `finetune_leading` | gauge | | 1 while this replica holds the Lease and reconciles (or runs without an election), else 0 |

Cardinality: every label has a bounded set of values (phases, failure kinds, the catalog's pools)
except `finetune_job_phase_since_timestamp_seconds`, which has one series per FineTuneJob that has
not finished (Succeeded and Failed jobs have none). It is what lets an alert name a job stuck
Pending or Queued. Its labels are `job_namespace`/`job_name`, not `namespace`, because the
scrape adds `namespace` (the operator's namespace) to every series.

The GPU time and the per-job phase times come from `track_phase`, which sees every status change
of every job; the counters of attempts, recoveries, finished jobs and the latencies come from
`observe_reconcile`, which sees each decision of the lifecycle.
"""

from __future__ import annotations

import threading
import time
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import api

if TYPE_CHECKING:
    from ..lifecycle import Decision

PHASES = ("Pending", "Queued", "Launching", "Running", "Recovering", "Suspended", "Succeeded", "Failed")
FINISHED_PHASES = ("Succeeded", "Failed")
# How an attempt can end other than by succeeding (api.AttemptStatus.outcome).
FAILURE_KINDS = tuple(o for o in typing.get_args(api.AttemptStatus.model_fields["outcome"].annotation)
                      if o not in ("Running", "Succeeded"))
# Reasons of a Failed condition: a failure kind, "Failed" (no attempt left), "Invalid" (the spec).
FAILED_REASONS = (*FAILURE_KINDS, "Failed", "Invalid")
PLANNING_RESULTS = ("launched", "replanned", "nofit")

JOBS_BY_PHASE = Gauge("finetune_jobs", "FineTuneJobs this operator follows, by phase", ["phase"])
LEADING = Gauge("finetune_leading", "1 while this replica holds the Lease and reconciles (or runs without an election), else 0")
ATTEMPTS = Counter("finetune_attempts_total", "Attempts launched (PyTorchJobs created)")
RECOVERIES = Counter(
    "finetune_recoveries_total",
    "Failed attempts, by failure kind and what followed (retry, moved to another pool, gave-up)",
    ["kind", "action"],
)
JOBS_FINISHED = Counter(
    "finetune_jobs_finished_total",
    "FineTuneJobs that ended: Succeeded, or Failed for good, with the reason of the Failed condition",
    ["result", "reason"],
)
EVENTS_DROPPED = Counter("finetune_events_dropped_total",
                         "Events not posted because the line to the API server was full (events.py)")
RECONCILE_SECONDS = Histogram("finetune_reconcile_seconds", "Time of one reconcile", ["planned"])
PLANNING_SECONDS = Histogram(
    "finetune_planning_seconds",
    "Time of a reconcile that searched for a plan (reading the pools, the search, rendering, writing), by result",
    ["result"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
PEAK_RATIO = Histogram(
    "finetune_observed_to_predicted_peak_ratio",
    "Observed peak GPU memory over the predicted peak, for attempts that reported one",
    buckets=(0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0),
)

CALIBRATION = Gauge(
    "finetune_memory_calibration_factor",
    "The memory correction learned from observed / predicted peaks per kind of run, applied to later plans of "
    "that kind (bounded to [1.0, 1.5]; calibration.py)",
    ["gpu", "family", "method", "strategy", "image"],
)
CALIBRATION_RUNS = Gauge(
    "finetune_memory_calibration_runs",
    "Runs the learned memory correction of a kind of run was learned from",
    ["gpu", "family", "method", "strategy", "image"],
)


def show_calibration(table: dict) -> None:
    """Export the learned corrections (calibration_store.py calls this after each read and write)."""
    for key, learned in table.items():
        parts = key.split(".")
        if len(parts) != 5:  # gpu.family.method.strategy.<image hash> (calibration.Kind.key)
            continue
        CALIBRATION.labels(*parts).set(learned.factor)
        CALIBRATION_RUNS.labels(*parts).set(learned.runs)


# Series that exist from the start, so that the first increment after a restart shows in increase().
for _kind in FAILURE_KINDS:
    RECOVERIES.labels(kind=_kind, action="retry")
    RECOVERIES.labels(kind=_kind, action="gave-up")
RECOVERIES.labels(kind="Unschedulable", action="moved")
JOBS_FINISHED.labels(result="Succeeded", reason="Succeeded")
for _reason in FAILED_REASONS:
    JOBS_FINISHED.labels(result="Failed", reason=_reason)
for _result in PLANNING_RESULTS:
    PLANNING_SECONDS.labels(result=_result)
for _planned in ("true", "false"):
    RECONCILE_SECONDS.labels(planned=_planned)
for _phase in PHASES:
    JOBS_BY_PHASE.labels(phase=_phase)

# Clocks, replaced by tests: wall time for the exported timestamps, monotonic time for GPU time.
_wall = time.time
_monotonic = time.monotonic

GpuKey = tuple[str, str, str]  # (pool, region, gpu_type)


@dataclass
class _Job:
    phase: str
    since: float  # wall time the job entered `phase`
    gpu_key: GpuKey | None = None  # what its running attempt holds, while the job is Running
    gpus: int = 0
    gpu_since: float = 0.0  # monotonic time from which its GPU time is not yet in _gpu_seconds


_jobs: dict[tuple[str, str], _Job] = {}
_gpu_seconds: dict[GpuKey, float] = {}  # GPU time of intervals that have ended
_lock = threading.Lock()


def serve(port: int) -> None:
    start_http_server(port)


# ---------------------------------------------------------------------------
# each decision of the lifecycle
# ---------------------------------------------------------------------------


def observe_reconcile(decision: "Decision", seconds: float, *, planned: bool) -> None:
    RECONCILE_SECONDS.labels(planned=str(planned).lower()).observe(seconds)
    status = decision.status
    reasons = [event.reason for event in decision.events]
    launched = sum(1 for reason in reasons if reason in ("Planned", "Relaunched"))
    if launched:
        ATTEMPTS.inc(launched)

    if planned:
        result = None
        if "Recovering" in reasons:
            result = "replanned"
        elif launched:
            result = "launched"
        elif status.phase == "Pending" and _condition_reason(status, api.COND_PLANNED, "False") == "NoFit":
            result = "nofit"
        if result is not None:
            PLANNING_SECONDS.labels(result=result).observe(seconds)

    ended = _attempt_ended_now(status, reasons)
    if ended is not None:
        if "Recovering" in reasons:
            action = "retry"
        elif status.phase == "Failed":
            action = "gave-up"
        else:
            action = "moved"  # unschedulable: the next attempt runs on another pool
        RECOVERIES.labels(kind=ended.outcome, action=action).inc()
        if ended.observed_peak_gi_b and ended.predicted_peak_gi_b:
            PEAK_RATIO.observe(ended.observed_peak_gi_b / ended.predicted_peak_gi_b)

    if status.phase == "Succeeded" and "Succeeded" in reasons:
        JOBS_FINISHED.labels(result="Succeeded", reason="Succeeded").inc()
    elif status.phase == "Failed" and ("Failed" in reasons or "Invalid" in reasons):
        reason = _condition_reason(status, api.COND_FAILED, "True") or "Failed"
        JOBS_FINISHED.labels(result="Failed", reason=reason).inc()


def _condition_reason(status: api.FineTuneJobStatus, type_: str, state: str) -> str | None:
    found = next((c for c in status.conditions if c.type == type_), None)
    return found.reason if found is not None and found.status == state else None


def _attempt_ended_now(status: api.FineTuneJobStatus, reasons: list[str]) -> api.AttemptStatus | None:
    """The attempt that failed in this decision, if one did: a recovery, a move off an unschedulable
    pool, or the end of the job. A job that fails because no attempt is left, with no attempt
    ending now, has none (its last attempt was counted when it ended)."""
    ended = [a for a in status.attempts if a.end_time is not None and a.outcome not in ("Running", "Succeeded")]
    if not ended:
        return None
    last = ended[-1]
    if "Recovering" in reasons:
        return last
    if status.phase == "Failed" and "Failed" in reasons:
        return last if last.end_time == status.completion_time else None
    if "Unschedulable" in reasons and "Relaunched" in reasons and last.outcome == "Unschedulable":
        return last
    return None


# ---------------------------------------------------------------------------
# every status change of every job
# ---------------------------------------------------------------------------


def track_phase(namespace: str, name: str, phase: str | None, *, status: Mapping[str, Any] | None = None) -> None:
    """Follow one job: its phase (for `finetune_jobs` and the time it entered it) and, given its
    status (the object's `.status`), the GPUs its running attempt holds. Phase None forgets a
    deleted job."""
    wall, mono = _wall(), _monotonic()
    with _lock:
        key = (namespace, name)
        job = _jobs.get(key)
        if phase is None:
            if job is not None:
                _stop_gpus(job, mono)
                del _jobs[key]
        else:
            if job is None:
                # First sight (a new job, or every job after a restart): the status says since when.
                since = _phase_start_from_status(phase, status)
                job = _jobs[key] = _Job(phase=phase, since=since if since is not None and since <= wall else wall)
            elif job.phase != phase:
                job.phase, job.since = phase, wall
            _follow_gpus(job, phase, status, mono)
        counts = {value: 0 for value in PHASES}
        for followed in _jobs.values():
            counts[followed.phase] = counts.get(followed.phase, 0) + 1
        for value, count in counts.items():
            JOBS_BY_PHASE.labels(phase=value).set(count)


# The condition whose last transition is when a job entered a phase, and its status then.
_PHASE_CONDITION = {
    "Pending": (api.COND_PLANNED, "False"),
    "Queued": (api.COND_QUEUED, "True"),
    "Running": (api.COND_RUNNING, "True"),
    "Recovering": (api.COND_RECOVERING, "True"),
    "Suspended": (api.COND_SUSPENDED, "True"),
}


def _phase_start_from_status(phase: str, status: Mapping[str, Any] | None) -> float | None:
    if not status or phase not in _PHASE_CONDITION:
        return None
    type_, state = _PHASE_CONDITION[phase]
    for cond in status.get("conditions") or []:
        if isinstance(cond, Mapping) and cond.get("type") == type_ and cond.get("status") == state:
            return _timestamp(cond.get("lastTransitionTime"))
    return None


def _timestamp(value: Any) -> float | None:
    parsed = api.kube_time(value)
    return parsed.timestamp() if parsed is not None and parsed.tzinfo is not None else None


def _running_gpus(status: Mapping[str, Any]) -> tuple[GpuKey, int] | None:
    plan = status.get("plan")
    if not isinstance(plan, Mapping):
        return None
    gpus = plan.get("gpus")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 0:
        return None
    key = (str(plan.get("nodePool") or ""), str(plan.get("region") or ""), str(plan.get("gpuType") or ""))
    return key, gpus


def _follow_gpus(job: _Job, phase: str, status: Mapping[str, Any] | None, mono: float) -> None:
    if phase != "Running":
        _stop_gpus(job, mono)
        return
    if status is None:
        return  # no plan to read: keep what is followed
    holding = _running_gpus(status)
    if holding is None:
        _stop_gpus(job, mono)
        return
    gpu_key, gpus = holding
    if job.gpu_key != gpu_key or job.gpus != gpus:
        _stop_gpus(job, mono)
        job.gpu_key, job.gpus, job.gpu_since = gpu_key, gpus, mono


def _stop_gpus(job: _Job, mono: float) -> None:
    if job.gpu_key is not None:
        _gpu_seconds[job.gpu_key] = _gpu_seconds.get(job.gpu_key, 0.0) + job.gpus * max(0.0, mono - job.gpu_since)
    job.gpu_key, job.gpus = None, 0


class _JobCollector(Collector):
    """GPU time, GPUs running and per-job phase times, computed when Prometheus scrapes."""

    def collect(self) -> Iterator[Any]:
        wall, mono = _wall(), _monotonic()
        seconds = CounterMetricFamily(
            "finetune_gpu_seconds",
            "GPU time of attempts while their job is Running (the plan's GPUs times the time), by pool",
            labels=["pool", "region", "gpu_type"],
        )
        running = GaugeMetricFamily(
            "finetune_gpus_running", "GPUs of the attempts running now, by pool", labels=["pool", "region", "gpu_type"],
        )
        since = GaugeMetricFamily(
            "finetune_job_phase_since_timestamp_seconds",
            "When each FineTuneJob that has not finished entered its phase (Unix time); one series per such job",
            labels=["job_namespace", "job_name", "phase"],
        )
        with _lock:
            totals = dict(_gpu_seconds)
            now_running: dict[GpuKey, int] = {}
            for (namespace, name), job in sorted(_jobs.items()):
                if job.gpu_key is not None:
                    totals[job.gpu_key] = totals.get(job.gpu_key, 0.0) + job.gpus * max(0.0, mono - job.gpu_since)
                    now_running[job.gpu_key] = now_running.get(job.gpu_key, 0) + job.gpus
                if job.phase not in FINISHED_PHASES:
                    since.add_metric([namespace, name, job.phase], min(job.since, wall))
        for key, value in sorted(totals.items()):
            seconds.add_metric(list(key), value)
            running.add_metric(list(key), now_running.get(key, 0))
        yield seconds
        yield running
        yield since


REGISTRY.register(_JobCollector())
