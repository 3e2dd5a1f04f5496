"""Failures the trainer classifies itself (the rest are classified from their type)."""

from __future__ import annotations

from .contract import FailureReason


class TrainerFailure(Exception):
    reason: FailureReason = FailureReason.UNKNOWN


class ConfigError(TrainerFailure):
    """The config cannot run here (e.g. QLoRA without CUDA). A retry cannot fix it."""

    reason = FailureReason.CONFIG_ERROR


class DataError(TrainerFailure):
    """The dataset cannot be read or parsed. A retry cannot fix it."""

    reason = FailureReason.DATA_ERROR


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection hook for kind "error"."""
