"""A terminal table of a MemoryEstimate (GiB, one row per term)."""

from __future__ import annotations

from .constants import GIB
from .memory import TERMS, MemoryEstimate
from .setup import TrainingSetup


def describe_setup(setup: TrainingSetup) -> str:
    arch = setup.architecture
    parts = [arch.name or arch.family, setup.method]
    if setup.method != "full":
        parts.append(f"r={setup.lora_rank}")
    parts += [setup.precision, setup.optimizer, f"{setup.strategy} x{setup.world_size}",
              f"micro-batch {setup.micro_batch_size}", f"seq {setup.sequence_length}",
              "checkpointing" if setup.gradient_checkpointing else "no checkpointing", setup.attention]
    if setup.offload != "none":
        parts.append(f"offload {setup.offload}")
    return ", ".join(parts)


def format_table(estimate: MemoryEstimate, setup: TrainingSetup | None = None) -> str:
    lines = []
    if setup is not None:
        lines.append(describe_setup(setup))
    lines.append(f"per GPU, at the peak ({estimate.peak_phase}):")
    width = max(len(t) for t in TERMS) + 2
    for term in TERMS:
        value = estimate.breakdown.get(term, 0)
        if value:
            lines.append(f"  {term:<{width}}{value / GIB:>9.2f} GiB")
    lines.append(f"  {'peak allocated':<{width}}{estimate.peak_allocated_bytes / GIB:>9.2f} GiB")
    lines.append(
        f"  {'required':<{width}}{estimate.required_bytes / GIB:>9.2f} GiB"
        f"  (x{estimate.fragmentation_factor:.2f} fragmentation + {estimate.reserve_bytes / GIB:.2f} GiB reserve)"
    )
    phases = ", ".join(f"{k} {v / GIB:.2f}" for k, v in estimate.phase_peaks.items())
    lines.append(f"  phase peaks (GiB): {phases}")
    lines.append(f"host RAM per training process: {estimate.host_required_bytes / GIB:.2f} GiB")
    for note in estimate.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
