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


class ExportError(ConfigError):
    """The export after training (spec.export: merged or full) cannot be written: an adapter the
    merge does not support, a base without safetensors weights, a tensor that does not fit. The
    training result (the adapter or the weights the Trainer saved) stays in the output as it was;
    no half-written export folder is left. A retry would fail the same way (a ConfigError)."""
