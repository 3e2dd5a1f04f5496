"""Recovery: why an attempt failed (`classify`), what the next attempt changes (`adjust`), and
credential-shaped strings kept out of what either quotes (`redact`)."""

from .classify import Failure, FailureKind, Remedy, classify_attempt, classify_pod, most_specific, parse_cuda_oom
from .redact import bounded, redact

__all__ = [
    "Failure",
    "FailureKind",
    "Remedy",
    "bounded",
    "classify_attempt",
    "classify_pod",
    "most_specific",
    "parse_cuda_oom",
    "redact",
]
