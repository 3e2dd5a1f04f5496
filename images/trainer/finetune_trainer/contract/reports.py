"""What comes out of a training pod: the failure report (the termination message), the progress
lines (and Kubeflow Trainer's trainerStatus, which carries the same report), the success report."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from ..failures import TRAINER_REPORTED
from .base import Contract, FailureReason, Phase, TERMINATION_MESSAGE_LIMIT, json_object


# -------------------------------------------------------------------------- output


class FailureReport(Contract):
    """What the trainer writes to the termination message when it fails."""

    reason: FailureReason
    phase: Phase
    # The optimizer step in progress (1-based) in forward/backward/optimizer; the step
    # just completed in checkpoint; the step resumed from (0 on a fresh start) in
    # setup/data/load.
    step: int = Field(ge=0)
    message: str = ""
    exit_code: int
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    device_total_bytes: int | None = Field(None, ge=0)
    micro_batch_size: int | None = Field(None, ge=1)
    sequence_length: int | None = Field(None, ge=1)
    gradient_accumulation: int | None = Field(None, ge=1)
    rank: int = Field(0, ge=0)
    world_size: int | None = Field(None, ge=1)
    attempt: int | None = Field(None, ge=1)

    @field_validator("reason")
    @classmethod
    def _reported_by_the_trainer(cls, reason: FailureReason) -> FailureReason:
        # The vocabulary also holds what only the operator observes (an eviction, a lost node, a
        # hang): no trainer writes those, so a report that says so is not one of ours.
        if reason not in TRAINER_REPORTED:
            raise ValueError(f"{reason.value} is not a reason the trainer reports "
                             f"({', '.join(k.value for k in TRAINER_REPORTED)})")
        return reason

    def to_termination_message(self, limit: int = TERMINATION_MESSAGE_LIMIT) -> str:
        """Compact JSON that fits in ``limit`` bytes (UTF-8); the message is cut to fit."""
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        if len(text.encode()) <= limit:
            return text
        empty = self.model_copy(update={"message": ""}).model_dump_json(
            by_alias=True, exclude_none=True
        )
        budget = limit - len(empty.encode())
        if budget < 0:
            raise ValueError("failure report does not fit the termination message even without a message")
        # JSON escaping can grow the text (quotes, control characters); find the
        # longest prefix of the message whose serialised report fits.
        marker = " …[truncated]"

        def render(cut: int) -> str:
            return self.model_copy(update={"message": self.message[:cut] + marker}).model_dump_json(
                by_alias=True, exclude_none=True
            )

        lo, hi = 0, min(len(self.message), budget)
        if len(render(lo).encode()) > limit:
            return empty
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(render(mid).encode()) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return render(lo)


def parse_failure_report(text: str | None) -> FailureReport | None:
    """The report in a termination message, or None when it holds something else
    (e.g. the log tail that ``FallbackToLogsOnError`` puts there for other images)."""
    if not text:
        return None
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    try:
        return FailureReport.model_validate(data)
    except ValidationError:
        return None


# ------------------------------------------------------------------------ progress

# The marker key and value of a progress line: {"event": "progress", ...}.
PROGRESS_EVENT = "progress"
# A reader looks at most this many characters of one line (a progress line is ~400).
PROGRESS_LINE_LIMIT = 4096


class ProgressReport(Contract):
    """One line of the trainer's stdout (the pod log) per logging step, written by rank 0:
    a JSON object whose ``event`` is ``progress``. The operator reads the last one from the
    master pod's log (``pods/log``) into ``status.progress``.

    Read tolerantly: keys this model does not know (from a newer trainer) are ignored, so a
    trainer and an operator of different versions still understand each other."""

    model_config = ConfigDict(extra="ignore")

    event: Literal["progress"] = PROGRESS_EVENT
    time: float = Field(gt=0)
    """When the line was written (Unix seconds)."""
    rank: int = Field(0, ge=0)
    attempt: int | None = Field(None, ge=1)
    """The attempt (TrainerConfig.attempt) this process belongs to."""
    step: int = Field(ge=0)
    """Optimizer steps done, counted over all attempts (a resumed attempt continues the count)."""
    max_steps: int = Field(ge=1)
    """The step training ends at; for a run by epochs, what the trainer computed from the data."""
    start_step: int | None = Field(None, ge=0)
    """The step this attempt resumed from (0 on a fresh start)."""
    elapsed_seconds: float | None = Field(None, ge=0)
    """Seconds since this attempt's training loop began (loading not counted)."""
    loss: float | None = None
    """Training loss of the last logging interval (may be NaN or inf when training diverges)."""
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = Field(None, ge=0)
    """Tokens (all ranks) per second over the last logging interval."""
    samples_consumed: int | None = Field(None, ge=0)
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    host_peak_rss_bytes: int | None = Field(None, ge=0)
    eval_loss: float | None = None
    """Mean loss on the held-out split at its last evaluation (carried on every later line)."""
    eval_step: int | None = Field(None, ge=0)
    """The step that evaluation ran at."""

    @model_validator(mode="after")
    def _steps_consistent(self) -> "ProgressReport":
        if self.start_step is not None and self.start_step > self.step:
            raise ValueError("startStep is after step")
        return self

    def to_log_line(self) -> str:
        """The line as the trainer writes it (one JSON object, no newline; NaN stays NaN)."""
        return json.dumps(self.model_dump(by_alias=True, exclude_none=True))


def parse_progress_line(line: str) -> ProgressReport | None:
    """The progress report in one log line, or None. A prefix before the JSON object (a
    launcher's ``[rank0]:``, a timestamp) is skipped; anything that is not a complete, valid
    progress object (a partial line, another event, garbage) gives None."""
    start = line.find("{")
    if start < 0 or len(line) - start > PROGRESS_LINE_LIMIT or '"progress"' not in line:
        return None
    try:
        data = json.loads(line[start:])
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") != PROGRESS_EVENT:
        return None
    try:
        return ProgressReport.model_validate(data)
    except ValidationError:
        return None


def last_progress(text: str) -> ProgressReport | None:
    """The last valid progress report in a log tail (lines may be cut, mixed with other output)."""
    for line in reversed(text.splitlines()):
        report = parse_progress_line(line)
        if report is not None:
            return report
    return None


# ----------------------------------------------- Kubeflow Trainer's trainerStatus
# Kubeflow Trainer v2.2+ (its TrainJobStatus feature gate) takes a status from the training pods
# over HTTPS and writes it to the TrainJob's status.trainerStatus: a percentage, the seconds left
# and up to 256 name/value metrics, each value a string of at most 64 characters. The trainer
# sends its progress report there as metrics named after the report's wire fields; the operator
# reads them back into the same report (progress_from_trainer_status), so one model says what a
# progress report holds however it travels.
TRAINER_STATUS_METRIC_LIMIT = 64
_TRAINER_STATUS_FIELDS = ("time", "attempt", "step", "max_steps", "start_step", "elapsed_seconds", "loss",
                          "learning_rate", "grad_norm", "tokens_per_second", "samples_consumed", "eval_loss",
                          "eval_step", "peak_allocated_bytes", "peak_reserved_bytes", "host_peak_rss_bytes")


def trainer_status_payload(report: ProgressReport, *, remaining_seconds: float | None, updated: str) -> dict[str, Any]:
    """The body the trainer POSTs to Kubeflow Trainer's status endpoint for one progress report.
    `updated` is the report's time as RFC 3339 (the endpoint requires lastUpdatedTime)."""
    metrics = []
    for name in _TRAINER_STATUS_FIELDS:
        value = getattr(report, name)
        if value is None:
            continue
        text = repr(float(value)) if isinstance(value, float) else str(value)  # repr: NaN stays 'nan'
        metrics.append({"name": to_camel(name), "value": text[:TRAINER_STATUS_METRIC_LIMIT]})
    status: dict[str, Any] = {"progressPercentage": min(100, 100 * report.step // report.max_steps),
                              "metrics": metrics, "lastUpdatedTime": updated}
    if remaining_seconds is not None:
        status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, round(remaining_seconds)))
    return {"trainerStatus": status}


def progress_from_trainer_status(trainer_status: Any) -> ProgressReport | None:
    """The progress report in a TrainJob's status.trainerStatus, or None: absent, written by
    something other than this trainer (no step/maxSteps/time metrics), or not a valid report.
    Read as tolerantly as a log line: the pod that wrote it is the tenant's."""
    if not isinstance(trainer_status, dict) or not isinstance(trainer_status.get("metrics"), list):
        return None
    known = {to_camel(name) for name in _TRAINER_STATUS_FIELDS}
    data: dict[str, Any] = {"event": PROGRESS_EVENT}
    for metric in trainer_status["metrics"]:
        if isinstance(metric, dict) and metric.get("name") in known and isinstance(metric.get("value"), str):
            try:
                data[metric["name"]] = json.loads(metric["value"]) if metric["value"] not in ("nan", "inf", "-inf") \
                    else float(metric["value"])
            except ValueError:
                return None
    if not {"time", "step", "maxSteps"} <= data.keys():
        return None
    try:
        return ProgressReport.model_validate(data)
    except ValidationError:
        return None


# ------------------------------------------------------------- success summary


class TrainingFacts(Contract):
    """What one attempt trained on, for the job's provenance record (finetune_operator.provenance).
    Digests only: the file list with each file's sha256 is in the attempt's record in the output
    (provenance/attempt-N.json), which the termination message's 4 KiB could not hold."""

    base_config_sha256: str | None = Field(None, description="sha256 of the base model's config.json")
    dataset_sha256: str = Field(description="sha256 over every dataset file's name and sha256 (provenance.py)")
    dataset_files: int = Field(ge=1)
    dataset_bytes: int = Field(ge=0)
    records: int = Field(ge=0, description="dataset records read")
    examples: int = Field(ge=0, description="sequences built from them (after packing), held-out ones included")
    held_out: int = Field(0, ge=0, description="of those, held out for evaluation (spec.evaluation)")
    tokens: int = Field(ge=0, description="tokens this attempt trained on, all ranks")
    final_loss: float | None = None
    eval_loss: float | None = Field(None, description="held-out loss at the last evaluation (spec.evaluation)")
    best_eval_step: int | None = Field(None, ge=0, description="the step of the lowest eval loss")
    best_eval_loss: float | None = None
    stopped_early_at: int | None = Field(None, ge=0, description="the step early stopping ended training at")
    output_is_best: bool | None = Field(None, description="keepBest: the output holds the best evaluation's model")
    eval_dataset_sha256: str | None = Field(None, description="sha256 over spec.evaluation.dataset's files, when separate")
    eval_examples: int | None = Field(None, ge=0, description="sequences of that separate evaluation dataset")


class ExportFacts(Contract):
    """What the export after training wrote (export.py; spec.export merged or full)."""

    kind: Literal["merged", "full"]
    directory: str = Field(description="the folder, in the trainer's file system (the output's mount)")
    shards: int = Field(ge=1)
    total_bytes: int = Field(ge=0, description="the weights' bytes, in the training dtype")
    peak_rss_bytes: int | None = Field(None, ge=0, description="rank 0's resident set during the merge, sampled")
    seconds: float | None = Field(None, ge=0)


class SuccessReport(Contract):
    """What the trainer writes to the termination message when training finished.

    The operator compares the measured peaks with the plan's prediction and learns a
    correction per (GPU product, model family, method, strategy) from it
    (finetune_operator.calibration). Memory fields are None without CUDA.
    """

    outcome: Literal["Succeeded"] = "Succeeded"
    steps: int = Field(ge=0)
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    device_total_bytes: int | None = Field(None, ge=0)
    rank: int = Field(0, ge=0)
    world_size: int | None = Field(None, ge=1)
    attempt: int | None = Field(None, ge=1)
    facts: TrainingFacts | None = None
    export: ExportFacts | None = None

    def to_termination_message(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


def parse_success_report(text: str | None) -> SuccessReport | None:
    """The success summary in a termination message, or None when it holds anything else."""
    data = json_object(text)
    if data is None or data.get("outcome") != "Succeeded":
        return None
    try:
        return SuccessReport.model_validate(data)
    except ValidationError:
        return None
