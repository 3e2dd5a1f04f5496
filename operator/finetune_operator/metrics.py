"""Prometheus metrics of the operator, served on the port the chart exposes (`/metrics`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from .lifecycle import Decision

JOBS_BY_PHASE = Gauge("finetune_jobs", "FineTuneJobs this operator follows, by phase", ["phase"])
ATTEMPTS = Counter("finetune_attempts_total", "Attempts launched (PyTorchJobs created)")
RECOVERIES = Counter("finetune_recoveries_total", "Failed attempts, by failure kind and what followed", ["kind", "action"])
RECONCILE_SECONDS = Histogram("finetune_reconcile_seconds", "Time of one reconcile", ["planned"])
PEAK_RATIO = Histogram(
    "finetune_observed_to_predicted_peak_ratio",
    "Observed peak GPU memory over the predicted peak, for attempts that reported one",
    buckets=(0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0),
)

_phases: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def serve(port: int) -> None:
    start_http_server(port)


def observe_reconcile(decision: "Decision", seconds: float, *, planned: bool) -> None:
    RECONCILE_SECONDS.labels(planned=str(planned).lower()).observe(seconds)
    for event in decision.events:
        if event.reason in ("Planned", "Relaunched"):
            ATTEMPTS.inc()
    status = decision.status
    if any(e.reason in ("Recovering", "Failed") for e in decision.events):
        ended = [a for a in status.attempts if a.end_time is not None and a.outcome not in ("Running", "Succeeded")]
        if ended:
            last = ended[-1]
            action = "retry" if status.phase == "Recovering" else "gave-up"
            RECOVERIES.labels(kind=last.outcome, action=action).inc()
            if last.observed_peak_gi_b and last.predicted_peak_gi_b:
                PEAK_RATIO.observe(last.observed_peak_gi_b / last.predicted_peak_gi_b)


def track_phase(namespace: str, name: str, phase: str | None) -> None:
    """Keep the jobs-by-phase gauge right; phase None forgets a deleted job."""
    with _lock:
        key = (namespace, name)
        if phase is None:
            _phases.pop(key, None)
        else:
            _phases[key] = phase
        counts: dict[str, int] = {}
        for value in _phases.values():
            counts[value] = counts.get(value, 0) + 1
        for value in ("Pending", "Queued", "Launching", "Running", "Recovering", "Suspended", "Succeeded", "Failed"):
            JOBS_BY_PHASE.labels(phase=value).set(counts.get(value, 0))
