"""Turn an exception into a FailureReport, write it to the termination message, log it."""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .contract import EXIT_CODE_FOR_REASON, ExportFacts, FailureReason, FailureReport, TrainingFacts
from .errors import TrainerFailure
from .phases import Progress

_OOM_MARKERS = ("CUDA out of memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def log_json(event: str, **fields: Any) -> None:
    """One JSON object per line on stdout (the pod log)."""
    record = {"event": event, "time": round(time.time(), 3), "rank": rank(), **fields}
    sys.stdout.write(json.dumps(record, default=str) + "\n")
    sys.stdout.flush()


def classify(exc: BaseException) -> FailureReason:
    if isinstance(exc, TrainerFailure):
        return exc.reason
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return FailureReason.GPU_OUT_OF_MEMORY
    except ImportError:  # pragma: no cover - the trainer image always has torch
        pass
    if isinstance(exc, MemoryError):
        return FailureReason.HOST_OUT_OF_MEMORY
    # Some CUDA allocation failures surface as a plain RuntimeError (cuBLAS, NCCL).
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(marker in text for marker in _OOM_MARKERS) and "CUDA" in text:
        return FailureReason.GPU_OUT_OF_MEMORY
    return FailureReason.UNKNOWN


def device_memory() -> dict[str, int | None]:
    """Peak allocated/reserved and capacity of this rank's GPU; all None without CUDA."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            return {
                "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
                "device_total_bytes": int(torch.cuda.get_device_properties(device).total_memory),
            }
    except Exception:  # noqa: BLE001 - a broken device must not hide the original failure
        pass
    return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "device_total_bytes": None}


def build_report(exc: BaseException, progress: Progress, attempt: int | None) -> FailureReport:
    reason = classify(exc)
    message = f"{type(exc).__name__}: {exc}"
    return FailureReport(
        reason=reason,
        phase=progress.phase,
        step=progress.step,
        message=message,
        exit_code=EXIT_CODE_FOR_REASON[reason],
        micro_batch_size=progress.micro_batch_size,
        sequence_length=progress.sequence_length,
        gradient_accumulation=progress.gradient_accumulation,
        rank=rank(),
        world_size=world_size(),
        attempt=attempt,
        **device_memory(),
    )


def _replace_unless(path: str | Path, text: str, keep_existing, what: str) -> bool:
    """Write ``text`` to the termination message shared by all local ranks, under a file lock,
    unless ``keep_existing(previous)`` says the document already there (parsed JSON, or {} when
    it is not JSON) wins; a string it returns is written instead of ``text``. True when something
    was written."""
    path = Path(path)
    try:
        with open(path, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            handle.seek(0)
            existing = handle.read().strip()
            if existing:
                try:
                    previous = json.loads(existing)
                except ValueError:
                    previous = {}
                verdict = keep_existing(previous if isinstance(previous, dict) else {})
                if verdict is True:
                    return False
                if isinstance(verdict, str):
                    text = verdict
            handle.seek(0)
            handle.truncate()
            handle.write(text)
            handle.flush()
            return True
    except OSError as exc:
        log_json("warning", message=f"cannot write {what} to {path}: {exc}")
        return False


def write_report(report: FailureReport, path: str | Path) -> bool:
    """Write ``report`` unless a rank sharing this container already wrote a specific one.

    All local ranks share one termination message. The rank that fails first is the
    cause; the others usually fail afterwards with collective errors (Unknown), so a
    report already there is kept unless it is Unknown and ours is specific.
    """

    def keep(previous: dict) -> bool:
        reason = previous.get("reason")
        return bool(reason) and (reason != FailureReason.UNKNOWN.value or report.reason is FailureReason.UNKNOWN)

    return _replace_unless(path, report.to_termination_message(), keep, "failure report")


def build_success(progress: Progress, attempt: int | None, facts: TrainingFacts | None = None,
                  export: "ExportFacts | None" = None) -> "SuccessReport":
    from .contract import SuccessReport

    return SuccessReport(steps=progress.step, rank=rank(), world_size=world_size(), attempt=attempt, facts=facts,
                         export=export, **device_memory())


def write_success(report: "SuccessReport", path: str | Path) -> bool:
    """Write the success summary (measured peaks, which the operator learns its calibration from)
    unless a failure report or a local rank with a higher peak already wrote one."""

    def keep(previous: dict) -> bool | str:
        if previous.get("outcome") != "Succeeded":
            return True
        if (previous.get("peakAllocatedBytes") or 0) < (report.peak_allocated_bytes or 0):
            return False
        # Rank 0 exports after the other local ranks wrote theirs: the pod's report keeps the highest
        # peak and gains where the export went.
        if report.export is not None and "export" not in previous:
            return json.dumps({**previous, "export": report.export.model_dump(mode="json", by_alias=True,
                                                                                exclude_none=True)})
        return True

    return _replace_unless(path, report.to_termination_message(), keep, "success report")
