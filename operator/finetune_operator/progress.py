"""Training progress from the trainer's log: the pure part.

The trainer writes one progress line per logging step on rank 0 (the contract's
`ProgressReport`), and where Kubeflow Trainer's TrainJobStatus gate gives its pods a status
endpoint, sends the same report there (the TrainJob's status.trainerStatus). The shell
(`progress_poller.py`) takes the report from trainerStatus when it holds a newer one and
otherwise reads the tail of the rank-0 pod's log through the API's `pods/log`; this module decides which pod and container to read, keeps a
smoothed step rate per attempt, and turns the last report into `status.progress`
(`api.ProgressStatus`), ETA included. No Kubernetes I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Sequence

from finetune_trainer.contract import ProgressReport, last_progress

from . import api
from .rendering.backend import is_rank0, trainer_containers
from .rendering.labels import ATTEMPT_LABEL

# The rate is an exponential moving average over time with this time constant: a rate seen
# over the last few minutes counts most, and one slow step (a checkpoint) does not swing the ETA.
RATE_TIME_CONSTANT_SECONDS = 300.0
# No ETA before the attempt has done this many steps since its first line was read.
MIN_STEPS_FOR_ETA = 2


@dataclass(frozen=True)
class Target:
    """The log to read for one job: its current attempt's rank-0 pod and trainer container.
    `ended`: the pod has finished, so one last read gets its final line and polling stops."""

    namespace: str
    job: str
    attempt: int
    pod: str
    container: str
    ended: bool = False


def trainer_container(pod: Mapping[str, Any]) -> str | None:
    containers = [c.get("name") for c in ((pod.get("spec") or {}).get("containers") or []) if c.get("name")]
    if len(containers) == 1:
        return containers[0]
    # Several containers (a sidecar): the one that runs the trainer, by the backends' names for it.
    return next((c for c in trainer_containers() if c in containers), None)


def target_of(namespace: str, job: str, status: api.FineTuneJobStatus,
              pods: Sequence[Mapping[str, Any]]) -> Target | None:
    """The log to read for the job now, or None (no current attempt, or its rank-0 pod has not
    started a container yet: a log read would only be refused)."""
    attempt = status.current_attempt
    if attempt is None or status.phase in ("Suspended", "Queued", "Pending"):
        return None
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(ATTEMPT_LABEL) != str(attempt) or not is_rank0(labels):
            continue
        phase = (pod.get("status") or {}).get("phase")
        container = trainer_container(pod)
        if container is None or phase not in ("Running", "Succeeded", "Failed"):
            continue
        ended = phase in ("Succeeded", "Failed") or bool(meta.get("deletionTimestamp"))
        return Target(namespace, job, attempt, meta.get("name", ""), container, ended)
    return None


@dataclass
class RateEstimate:
    """Steps per second of one attempt: a time-weighted moving average of the rates between
    successive reports (by the trainer's own clock, so how often the log is read does not matter)."""

    first_step: int | None = None
    last_time: float | None = None
    last_step: int | None = None
    rate: float | None = None

    def observe(self, report: ProgressReport) -> None:
        if self.last_time is None:
            # The report says where the attempt started and how long its loop has run: that
            # span is the first segment, when it is there.
            self.first_step = report.step
            if report.start_step is not None and report.elapsed_seconds and report.step > report.start_step:
                self.first_step = report.start_step
                self._blend(report.elapsed_seconds, report.step - report.start_step)
            self.last_time, self.last_step = report.time, report.step
            return
        assert self.last_step is not None
        dt, steps = report.time - self.last_time, report.step - self.last_step
        if dt <= 0 or steps < 0:
            return  # the same line again, or out of order: nothing learned
        if steps == 0:
            return
        self._blend(dt, steps)
        self.last_time, self.last_step = report.time, report.step

    def _blend(self, dt: float, steps: int) -> None:
        segment = steps / dt
        if self.rate is None:
            self.rate = segment
        else:
            weight = 1.0 - math.exp(-dt / RATE_TIME_CONSTANT_SECONDS)
            self.rate += weight * (segment - self.rate)

    def steps_seen(self) -> int:
        if self.first_step is None or self.last_step is None:
            return 0
        return self.last_step - self.first_step


def summary_text(step: int, total: int) -> str:
    """120/2000 (6%): what `kubectl get ftj` shows (a printer column cannot compute it)."""
    percent = math.floor(100 * min(step, total) / total) if total > 0 else 0
    return f"{step}/{total} ({percent}%)"


def progress_status(report: ProgressReport, attempt: int, rate: RateEstimate) -> api.ProgressStatus:
    """status.progress from the last report of the attempt and its rate so far."""
    updated = datetime.fromtimestamp(report.time, tz=timezone.utc)
    loss_finite = report.loss is None or math.isfinite(report.loss)
    steps_per_second = rate.rate if rate.rate and rate.steps_seen() >= MIN_STEPS_FOR_ETA else None
    eta = None
    if steps_per_second:
        remaining = max(report.max_steps - report.step, 0)
        eta = updated + timedelta(seconds=round(remaining / steps_per_second))
    return api.ProgressStatus(
        attempt=attempt,
        step=report.step,
        total_steps=report.max_steps,
        summary=summary_text(report.step, report.max_steps),
        loss=report.loss if loss_finite else None,
        loss_not_finite=None if loss_finite else True,
        tokens_per_second=report.tokens_per_second,
        eval_loss=report.eval_loss if report.eval_loss is not None and math.isfinite(report.eval_loss) else None,
        eval_step=report.eval_step if report.eval_loss is not None else None,
        steps_per_second=None if steps_per_second is None else round(steps_per_second, 6),
        eta=eta.replace(microsecond=0) if eta else None,
        updated_at=updated,
    )


@dataclass
class JobProgress:
    """What the poller keeps per job: the attempt it follows, its rate, the last report."""

    attempt: int
    rate: RateEstimate
    last: ProgressReport | None = None

    def read(self, log_tail: str) -> api.ProgressStatus | None:
        """Take in a log tail; the new status.progress, or None when the tail holds nothing newer.
        A line of another attempt (the log of a pod the next attempt reuses a name of) is ignored."""
        return self.take(last_progress(log_tail))

    def take(self, report: ProgressReport | None) -> api.ProgressStatus | None:
        """Take in a report (from the log or from Trainer's trainerStatus); the new status.progress,
        or None when it is not newer than the last one or belongs to another attempt."""
        if report is None or (report.attempt is not None and report.attempt != self.attempt):
            return None
        if self.last is not None and (report.time, report.step) <= (self.last.time, self.last.step):
            return None
        self.rate.observe(report)
        self.last = report
        return progress_status(report, self.attempt, self.rate)


def for_status(status: api.FineTuneJobStatus) -> api.ProgressStatus | None:
    """The progress a status write keeps: only the current attempt's (a new attempt starts without)."""
    progress = status.progress
    if progress is None or status.current_attempt is None or progress.attempt != status.current_attempt:
        return None
    return progress
