"""The test-only fault injection hook (``faultInjection`` in the config)."""

from __future__ import annotations

import os
import signal

from .contract import FaultInjection, Phase
from .errors import InjectedFault
from .reporting import log_json, rank


class FaultInjector:
    def __init__(self, fault: FaultInjection | None, attempt: int):
        active = fault is not None
        if active and fault.attempt is not None and fault.attempt != attempt:
            active = False
        if active and fault.rank is not None and fault.rank != rank():
            active = False
        self.fault = fault if active else None

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
                f"CUDA out of memory (injected at step {step}, phase {phase.value})"
            )
        if fault.kind == "error":
            raise InjectedFault(f"injected error at step {step}, phase {phase.value}")
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
