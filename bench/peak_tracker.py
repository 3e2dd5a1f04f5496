"""The peak tracker lives in the trainer package (finetune_trainer/peak_tracker.py), shared by the
pre-flight profile and this bench; kept importable here for bench scripts and tests."""

from finetune_trainer.peak_tracker import CUDA_BLOCK_BYTES, PeakTracker  # noqa: F401
