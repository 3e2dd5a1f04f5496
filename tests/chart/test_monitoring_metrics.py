"""What the chart's dashboard and alerts read, fed the way the operator feeds it: `track_phase` (every
status change of a job) and `observe_reconcile` (every decision of the lifecycle) move the metrics
of `finetune_operator.shell.metrics` as their help texts say."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from prometheus_client import REGISTRY

from finetune_operator import api
from finetune_operator.shell import metrics
from finetune_operator.lifecycle import Decision, Event

T0 = datetime(2026, 11, 30, 9, 0, tzinfo=timezone.utc)
BERLIN = {"pool": "h100-berlin", "region": "eu-de-berlin", "gpu_type": "H100-80GB"}
PARIS = {"pool": "a100-paris", "region": "eu-fr-paris", "gpu_type": "A100-40GB"}


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Clock:
    def __init__(self) -> None:
        self.wall = T0.timestamp()
        self.mono = 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(metrics, "_wall", lambda: c.wall)
    monkeypatch.setattr(metrics, "_monotonic", lambda: c.mono)
    return c


@pytest.fixture
def jobs():
    """Names of jobs a test follows; forgotten afterwards so that tests do not see each other's."""
    followed: list[tuple[str, str]] = []
    yield followed
    for namespace, name in followed:
        metrics.track_phase(namespace, name, None)


def _plan(pool: dict[str, str], gpus: int) -> dict[str, Any]:
    return {"nodePool": pool["pool"], "region": pool["region"], "gpuType": pool["gpu_type"], "gpus": gpus}


def _cond(type_: str, status: str, at: datetime, reason: str = "Because") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "lastTransitionTime": at.isoformat().replace("+00:00", "Z")}


def test_gpu_seconds_count_only_while_running_by_pool(clock, jobs):
    jobs.append(("team-a", "gpu-a"))
    before_berlin = value("finetune_gpu_seconds_total", **BERLIN)
    before_paris = value("finetune_gpu_seconds_total", **PARIS)
    metrics.track_phase("team-a", "gpu-a", "Launching", status={"phase": "Launching", "plan": _plan(BERLIN, 8)})
    clock.advance(60)  # launching: pods scheduled, image pulled; not counted
    metrics.track_phase("team-a", "gpu-a", "Running", status={"phase": "Running", "plan": _plan(BERLIN, 8)})
    clock.advance(100)
    assert value("finetune_gpu_seconds_total", **BERLIN) == pytest.approx(before_berlin + 800)
    assert value("finetune_gpus_running", **BERLIN) >= 8
    # A status change that keeps the plan keeps counting from where it was.
    metrics.track_phase("team-a", "gpu-a", "Running", status={"phase": "Running", "plan": _plan(BERLIN, 8)})
    clock.advance(50)
    metrics.track_phase("team-a", "gpu-a", "Recovering", status={"phase": "Recovering", "plan": _plan(PARIS, 4)})
    clock.advance(500)  # backoff: nothing runs
    assert value("finetune_gpu_seconds_total", **BERLIN) == pytest.approx(before_berlin + 1200)
    metrics.track_phase("team-a", "gpu-a", "Running", status={"phase": "Running", "plan": _plan(PARIS, 4)})
    clock.advance(25)
    metrics.track_phase("team-a", "gpu-a", "Succeeded", status={"phase": "Succeeded", "plan": _plan(PARIS, 4)})
    clock.advance(1000)
    assert value("finetune_gpu_seconds_total", **BERLIN) == pytest.approx(before_berlin + 1200)
    assert value("finetune_gpu_seconds_total", **PARIS) == pytest.approx(before_paris + 100)


def test_gpus_running_follows_the_running_jobs(clock, jobs):
    jobs += [("team-b", "one"), ("team-b", "two")]
    base = value("finetune_gpus_running", **PARIS)
    metrics.track_phase("team-b", "one", "Running", status={"plan": _plan(PARIS, 8)})
    metrics.track_phase("team-b", "two", "Running", status={"plan": _plan(PARIS, 2)})
    assert value("finetune_gpus_running", **PARIS) == base + 10
    metrics.track_phase("team-b", "one", None)  # deleted while running: its GPU time is kept, its GPUs gone
    assert value("finetune_gpus_running", **PARIS) == base + 2


def test_phase_since_names_each_unfinished_job(clock, jobs):
    jobs += [("team-c", "waits"), ("team-c", "new")]
    planned_false_at = T0 - timedelta(hours=2)
    # First sight (after a restart too): the condition says since when it has been Pending.
    metrics.track_phase("team-c", "waits", "Pending", status={
        "phase": "Pending", "conditions": [_cond("Planned", "False", planned_false_at, "NoFit")]})
    since = dict(job_namespace="team-c", job_name="waits", phase="Pending")
    assert value("finetune_job_phase_since_timestamp_seconds", **since) == planned_false_at.timestamp()
    # A job without a status yet: since now.
    metrics.track_phase("team-c", "new", "Pending")
    assert value("finetune_job_phase_since_timestamp_seconds", job_namespace="team-c", job_name="new",
                 phase="Pending") == clock.wall
    # Still Pending later: the time stays; a new phase starts when it is seen.
    clock.advance(30)
    metrics.track_phase("team-c", "waits", "Pending", status={"phase": "Pending"})
    assert value("finetune_job_phase_since_timestamp_seconds", **since) == planned_false_at.timestamp()
    clock.advance(30)
    metrics.track_phase("team-c", "waits", "Queued", status={"phase": "Queued"})
    assert REGISTRY.get_sample_value("finetune_job_phase_since_timestamp_seconds", since) is None
    assert value("finetune_job_phase_since_timestamp_seconds", job_namespace="team-c", job_name="waits",
                 phase="Queued") == clock.wall
    # Finished jobs have no series (bounded cardinality); the phase counts still see them.
    failed_before = value("finetune_jobs", phase="Failed")
    metrics.track_phase("team-c", "waits", "Failed", status={"phase": "Failed"})
    assert not [s for s in _samples("finetune_job_phase_since_timestamp_seconds") if s.labels["job_name"] == "waits"]
    assert value("finetune_jobs", phase="Failed") == failed_before + 1


def _samples(family: str):
    return [s for f in REGISTRY.collect() if f.name == family for s in f.samples]


def _status(phase: str, attempts: list[dict[str, Any]], conditions: list[dict[str, Any]] = (),
            completion: datetime | None = None) -> api.FineTuneJobStatus:
    raw: dict[str, Any] = {"phase": phase, "attempts": attempts, "conditions": list(conditions)}
    if completion is not None:
        raw["completionTime"] = completion.isoformat()
    return api.FineTuneJobStatus.model_validate(raw)


def _attempt(n: int, outcome: str, *, end: datetime | None = None, observed: float | None = None,
             predicted: float | None = 60.0) -> dict[str, Any]:
    out: dict[str, Any] = {"attempt": n, "pytorchJob": f"job-a{n}", "outcome": outcome, "startTime": T0.isoformat()}
    if end is not None:
        out["endTime"] = end.isoformat()
    if observed is not None:
        out["observedPeakGiB"] = observed
    if predicted is not None:
        out["predictedPeakGiB"] = predicted
    return out


def _decision(status: api.FineTuneJobStatus, *reasons: str) -> Decision:
    return Decision(status=status, events=[Event("Normal", r, r) for r in reasons])


def test_a_recovery_counts_its_kind_the_peak_ratio_and_the_planning_time():
    now = T0 + timedelta(hours=1)
    status = _status("Recovering", [_attempt(1, "GPUOutOfMemory", end=now, observed=72.0), _attempt(2, "Running")],
                     [_cond("Recovering", "True", now, "GPUOutOfMemory")])
    retries = value("finetune_recoveries_total", kind="GPUOutOfMemory", action="retry")
    ratios = value("finetune_observed_to_predicted_peak_ratio_count")
    ratio_le_1_2 = value("finetune_observed_to_predicted_peak_ratio_bucket", le="1.2")
    ratio_le_1_1 = value("finetune_observed_to_predicted_peak_ratio_bucket", le="1.1")
    planning = value("finetune_planning_seconds_count", result="replanned")
    metrics.observe_reconcile(_decision(status, "Recovering"), 0.2, planned=True)
    assert value("finetune_recoveries_total", kind="GPUOutOfMemory", action="retry") == retries + 1
    assert value("finetune_observed_to_predicted_peak_ratio_count") == ratios + 1
    assert value("finetune_observed_to_predicted_peak_ratio_bucket", le="1.2") == ratio_le_1_2 + 1  # 72 / 60 = 1.2
    assert value("finetune_observed_to_predicted_peak_ratio_bucket", le="1.1") == ratio_le_1_1
    assert value("finetune_planning_seconds_count", result="replanned") == planning + 1


def test_launches_and_nofit_are_planning_results():
    launched = value("finetune_planning_seconds_count", result="launched")
    nofit = value("finetune_planning_seconds_count", result="nofit")
    attempts = value("finetune_attempts_total")
    running = _status("Launching", [_attempt(1, "Running")])
    metrics.observe_reconcile(_decision(running, "Planned"), 0.05, planned=True)
    assert value("finetune_attempts_total") == attempts + 1
    assert value("finetune_planning_seconds_count", result="launched") == launched + 1
    pending = _status("Pending", [], [_cond("Planned", "False", T0, "NoFit")])
    metrics.observe_reconcile(_decision(pending), 0.3, planned=True)
    assert value("finetune_planning_seconds_count", result="nofit") == nofit + 1
    # A reconcile that only looked at a running attempt planned nothing.
    metrics.observe_reconcile(_decision(_status("Running", [_attempt(1, "Running")])), 0.01, planned=False)
    assert value("finetune_planning_seconds_count", result="launched") == launched + 1
    assert value("finetune_planning_seconds_count", result="nofit") == nofit + 1


def test_jobs_finished_by_result_and_reason():
    now = T0 + timedelta(hours=3)
    gave_up = value("finetune_recoveries_total", kind="HostOutOfMemory", action="gave-up")
    failed = value("finetune_jobs_finished_total", result="Failed", reason="HostOutOfMemory")
    status = _status("Failed", [_attempt(1, "HostOutOfMemory", end=now)], [_cond("Failed", "True", now, "HostOutOfMemory")],
                     completion=now)
    metrics.observe_reconcile(_decision(status, "Failed"), 0.1, planned=True)
    assert value("finetune_jobs_finished_total", result="Failed", reason="HostOutOfMemory") == failed + 1
    assert value("finetune_recoveries_total", kind="HostOutOfMemory", action="gave-up") == gave_up + 1

    # No attempt left and none ended now (the last one was counted when it ended): only the job counts.
    no_attempt_left = value("finetune_jobs_finished_total", result="Failed", reason="Failed")
    earlier = now - timedelta(minutes=5)
    status = _status("Failed", [_attempt(1, "GPUOutOfMemory", end=earlier)],
                     [_cond("Failed", "True", now, "Failed")], completion=now)
    gpu_gave_up = value("finetune_recoveries_total", kind="GPUOutOfMemory", action="gave-up")
    metrics.observe_reconcile(_decision(status, "Failed"), 0.1, planned=True)
    assert value("finetune_jobs_finished_total", result="Failed", reason="Failed") == no_attempt_left + 1
    assert value("finetune_recoveries_total", kind="GPUOutOfMemory", action="gave-up") == gpu_gave_up

    succeeded = value("finetune_jobs_finished_total", result="Succeeded", reason="Succeeded")
    status = _status("Succeeded", [_attempt(1, "Succeeded", end=now)], [_cond("Succeeded", "True", now, "Succeeded")],
                     completion=now)
    metrics.observe_reconcile(_decision(status, "Succeeded"), 0.1, planned=False)
    assert value("finetune_jobs_finished_total", result="Succeeded", reason="Succeeded") == succeeded + 1


def test_an_unschedulable_attempt_moved_to_another_pool_is_a_recovery():
    now = T0 + timedelta(hours=4)
    moved = value("finetune_recoveries_total", kind="Unschedulable", action="moved")
    status = _status("Launching", [_attempt(1, "Unschedulable", end=now), _attempt(2, "Running")])
    metrics.observe_reconcile(_decision(status, "Unschedulable", "Relaunched"), 0.1, planned=True)
    assert value("finetune_recoveries_total", kind="Unschedulable", action="moved") == moved + 1


def test_alerted_series_exist_before_the_first_event():
    """increase() misses the first increment of a series that appears with it: the series the
    alerts read exist from the start, at 0."""
    for reason in ("GPUOutOfMemory", "HostOutOfMemory", "DataError", "ConfigError", "Unschedulable", "Failed", "Invalid"):
        assert REGISTRY.get_sample_value("finetune_jobs_finished_total", {"result": "Failed", "reason": reason}) is not None
    for kind in ("GPUOutOfMemory", "HostOutOfMemory", "Evicted", "NodeLost"):
        assert REGISTRY.get_sample_value("finetune_recoveries_total", {"kind": kind, "action": "retry"}) is not None
    assert REGISTRY.get_sample_value("finetune_recoveries_total", {"kind": "Unschedulable", "action": "moved"}) is not None
