"""Recovery: why an attempt failed (`classify`) and what the next attempt changes (`adjust`)."""

from .classify import Failure, FailureKind, Remedy, classify_attempt, classify_pod, parse_cuda_oom

__all__ = ["Failure", "FailureKind", "Remedy", "classify_attempt", "classify_pod", "parse_cuda_oom"]
