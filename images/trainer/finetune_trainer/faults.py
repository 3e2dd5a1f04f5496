"""The test-only fault injection hook (``faultInjection`` in the config), and the lab's GPU.

The lab's GPU: the lab cluster's real kubelet nodes (e2e/lab/realnode.py) run the trainer's
containers on CPU. Those nodes pretend to have a GPU of
``FINETUNE_LAB_GPU_MEMORY_BYTES``; the lab gives each pod (e2e/lab/gpuwebhook.py) the peak its plan truly reaches
there (``FINETUNE_LAB_PEAK_BYTES``, from the fake GPU's rule: predicted x true-peak-factor).
Where that peak does not fit, this trainer raises ``torch.OutOfMemoryError`` itself at global
step ``FINETUNE_LAB_OOM_STEP`` (or the attempt's first step, if it resumed past it), in
``FINETUNE_LAB_OOM_PHASE`` (default backward), so the failure report, the exit code and the
last checkpoint are the real trainer's. Nothing sets these variables outside the lab.
"""

from __future__ import annotations

import os
import signal
from typing import Mapping

from .contract import FaultInjection, Phase
from .errors import ConfigError, InjectedFault
from .reporting import log_json, rank

LAB_GPU_MEMORY_ENV = "FINETUNE_LAB_GPU_MEMORY_BYTES"
LAB_PEAK_ENV = "FINETUNE_LAB_PEAK_BYTES"
LAB_OOM_STEP_ENV = "FINETUNE_LAB_OOM_STEP"
LAB_OOM_PHASE_ENV = "FINETUNE_LAB_OOM_PHASE"
_LAB_PHASES = ("forward", "backward", "optimizer")


def _lab_int(environ: Mapping[str, str], name: str, minimum: int) -> int:
    value = environ[name]
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} (set by the lab) is not an integer") from None
    if number < minimum:
        raise ConfigError(f"{name}={value!r} (set by the lab) must be at least {minimum}")
    return number


def lab_gpu_oom(start_step: int, environ: Mapping[str, str] | None = None) -> tuple[FaultInjection, str] | None:
    """The lab GPU's out-of-memory for this attempt, with its message, or None (no lab GPU, or the peak fits)."""
    environ = os.environ if environ is None else environ
    if LAB_GPU_MEMORY_ENV not in environ and LAB_PEAK_ENV not in environ:
        return None
    for name in (LAB_GPU_MEMORY_ENV, LAB_PEAK_ENV):
        if name not in environ:
            raise ConfigError(f"{name} is not set but the other lab GPU variable is; the lab sets both")
    total = _lab_int(environ, LAB_GPU_MEMORY_ENV, 1)
    peak = _lab_int(environ, LAB_PEAK_ENV, 0)
    if peak <= total:
        return None
    phase = environ.get(LAB_OOM_PHASE_ENV, "backward")
    if phase not in _LAB_PHASES:
        raise ConfigError(f"{LAB_OOM_PHASE_ENV}={phase!r} (set by the lab) must be one of {', '.join(_LAB_PHASES)}")
    wanted = _lab_int(environ, LAB_OOM_STEP_ENV, 1) if LAB_OOM_STEP_ENV in environ else start_step + 1
    # Steps are 1-based in the hooks (the step being computed); an attempt that resumed past the
    # step reaches the peak at its first step.
    step = max(wanted, start_step + 1)
    gib = 1024**3
    message = (f"CUDA out of memory. Tried to allocate {(peak - total) / gib:.2f} GiB. GPU {rank()} has a total "
               f"capacity of {total / gib:.2f} GiB (finetune lab GPU: this plan's true peak {peak / gib:.2f} GiB "
               f"does not fit; raised at step {step}, {phase})")
    return FaultInjection(kind="gpu-oom", step=step, phase=phase), message


class FaultInjector:
    def __init__(self, fault: FaultInjection | None, attempt: int):
        active = fault is not None
        if active and fault.attempt is not None and fault.attempt != attempt:
            active = False
        if active and fault.rank is not None and fault.rank != rank():
            active = False
        self.fault = fault if active else None
        self.message: str | None = None

    def arm_lab_gpu(self, start_step: int) -> None:
        """Arm the lab GPU's out-of-memory (see the module doc) unless a configured fault is armed."""
        lab = lab_gpu_oom(start_step)
        if lab is not None and self.fault is None:
            self.fault, self.message = lab
            log_json("lab-gpu", message=self.message)

    def pending(self, phase: Phase, step: int) -> bool:
        fault = self.fault
        return fault is not None and fault.phase == phase.value and fault.step == step

    def maybe_fire(self, phase: Phase, step: int) -> None:
        if not self.pending(phase, step):
            return
        fault = self.fault
        self.fault = None  # fire once
        log_json("fault-injection", kind=fault.kind, phase=phase.value, step=step)
        if fault.kind == "gpu-oom":
            import torch

            raise torch.OutOfMemoryError(
                self.message or f"CUDA out of memory (injected at step {step}, phase {phase.value})"
            )
        if fault.kind == "error":
            raise InjectedFault(f"injected error at step {step}, phase {phase.value}")
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
