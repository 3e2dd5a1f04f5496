"""The labels and the owner reference on every object of an attempt and on its pods, whichever
backend renders it (`renderer`, `trainjob`) and the NetworkPolicy that selects its pods (`network`).
Below all three, so each builds on it without importing another."""

from __future__ import annotations

from typing import Any

from .. import api
from .names import label_value

JOB_LABEL = "finetune.dev/job"
ATTEMPT_LABEL = "finetune.dev/attempt"
MANAGER = "finetune-operator"


def common_labels(job: api.FineTuneJob, attempt: int) -> dict[str, str]:
    """Labels on every object of the attempt and on its pods."""
    return {
        "app.kubernetes.io/name": "finetune-trainer",
        "app.kubernetes.io/instance": label_value(job.metadata.name),
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/part-of": "finetune-operator",
        "app.kubernetes.io/managed-by": MANAGER,
        JOB_LABEL: label_value(job.metadata.name),
        ATTEMPT_LABEL: str(attempt),
    }


def owner_reference(job: api.FineTuneJob) -> dict[str, Any] | None:
    """Controller reference to the FineTuneJob; None for a job not yet stored (no uid, e.g. the CLI)."""
    if not job.metadata.uid:
        return None
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }
