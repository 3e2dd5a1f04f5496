"""Where the trainer is, so a failure can say in which phase and step it happened."""

from __future__ import annotations

from dataclasses import dataclass

from .contract import Phase


@dataclass
class Progress:
    phase: Phase = Phase.SETUP
    # The optimizer step in progress (1-based) while training; the step just completed
    # while checkpointing; 0 before training starts.
    step: int = 0
    micro_batch_size: int | None = None
    sequence_length: int | None = None
    gradient_accumulation: int | None = None

    def enter(self, phase: Phase, step: int | None = None) -> None:
        self.phase = phase
        if step is not None:
            self.step = step


# One per process: the failure handler reads it, the training code updates it.
PROGRESS = Progress()
