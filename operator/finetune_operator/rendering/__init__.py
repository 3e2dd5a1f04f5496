"""Rendering: a job and its plan become a ConfigMap (the trainer's input) and a PyTorchJob
(`render_attempt`) or a Kubeflow Trainer v2 TrainJob (`render_trainjob`).

Pure code. Values reach the manifests as data (see `templating.py`), never as text.
"""

from .errors import RenderError
from .labels import ATTEMPT_LABEL, JOB_LABEL, common_labels
from .names import attempt_name, label_value
from .renderer import (
    PREDICTED_PEAK_ANNOTATION,
    QUEUE_LABEL,
    RenderedAttempt,
    is_queued,
    render_attempt,
    render_config_map,
    starts_suspended,
)
from .trainjob import render_trainjob

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
    "render_config_map",
    "render_trainjob",
    "starts_suspended",
]
