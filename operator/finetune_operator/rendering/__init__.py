"""Rendering: a job and its plan become a ConfigMap (the trainer's input) and a PyTorchJob.

Pure code. Values reach the manifests as data (see `templating.py`), never as text.
"""

from .errors import RenderError
from .names import attempt_name, label_value
from .renderer import (
    ATTEMPT_LABEL,
    JOB_LABEL,
    PREDICTED_PEAK_ANNOTATION,
    QUEUE_LABEL,
    RenderedAttempt,
    common_labels,
    is_queued,
    render_attempt,
    starts_suspended,
)

__all__ = [
    "ATTEMPT_LABEL",
    "JOB_LABEL",
    "PREDICTED_PEAK_ANNOTATION",
    "QUEUE_LABEL",
    "RenderError",
    "RenderedAttempt",
    "attempt_name",
    "common_labels",
    "is_queued",
    "label_value",
    "render_attempt",
    "starts_suspended",
]
