"""Sizing estimates as the planner reads them, cached per setup (they do not depend on the pool)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..sizing import SizingError, TrainingSetup

if TYPE_CHECKING:
    from .space import Ask

Estimator = Callable[[TrainingSetup], Any]


@dataclass(frozen=True)
class EstimateFacts:
    """The numbers of a sizing estimate the planner uses (and the estimate itself, for the plan)."""

    peak_bytes: int
    required_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    host_bytes_per_rank: int  # host RAM of one training process
    source: Any = None

    @property
    def document(self) -> dict[str, Any]:
        """The estimate as the sizing CLI's JSON (`perGPU`, `host`, `notes`)."""
        if isinstance(self.source, dict):
            return self.source
        if hasattr(self.source, "to_json"):
            return self.source.to_json()
        return {
            "perGPU": {"peakAllocatedBytes": self.peak_bytes, "requiredBytes": self.required_bytes,
                       "peakPhase": self.peak_phase, "breakdown": dict(self.breakdown)},
            "host": {"requiredBytes": self.host_bytes_per_rank},
        }


def estimate_facts(estimate: Any) -> EstimateFacts:
    """Read a sizing MemoryEstimate, or its JSON document (perGPU/host, as `estimate -o json` prints)."""
    if isinstance(estimate, EstimateFacts):
        return estimate
    if not isinstance(estimate, dict):
        return EstimateFacts(
            peak_bytes=int(estimate.peak_allocated_bytes),
            required_bytes=int(estimate.required_bytes),
            peak_phase=str(estimate.peak_phase),
            breakdown={k: int(v) for k, v in estimate.breakdown.items()},
            host_bytes_per_rank=int(estimate.host_required_bytes),
            source=estimate,
        )
    per_gpu, host = estimate.get("perGPU", {}), estimate.get("host", {})
    return EstimateFacts(
        peak_bytes=int(per_gpu.get("peakAllocatedBytes", 0)),
        required_bytes=int(per_gpu["requiredBytes"]),
        peak_phase=str(per_gpu.get("peakPhase", "")),
        breakdown={k: int(v) for k, v in dict(per_gpu.get("breakdown", {})).items()},
        host_bytes_per_rank=int(host.get("requiredBytes", 0)),
        source=estimate,
    )


def default_estimator() -> Estimator:
    from ..sizing import estimate_memory

    return estimate_memory



class Estimates:
    """Sizing estimates cached per setup for one planning call (they do not depend on the pool)."""

    def __init__(self, ask: "Ask", estimator: Estimator):
        self.ask = ask
        self.estimator = estimator
        self.cache: dict[tuple, EstimateFacts | SizingError] = {}
        self.calls = 0

    def get(self, world: int, strategy: str, offload: str, checkpointing: bool, micro: int) -> EstimateFacts | SizingError:
        key = (world, strategy, offload, checkpointing, micro)
        hit = self.cache.get(key)
        if hit is None:
            a = self.ask
            try:
                setup = TrainingSetup(
                    architecture=a.arch, method=a.method, lora_rank=a.lora_rank, lora_targets=a.lora_targets,
                    precision=a.precision, optimizer=a.optimizer, micro_batch_size=micro,
                    sequence_length=a.sequence_length, gradient_checkpointing=checkpointing, attention=a.attention,
                    strategy=strategy, world_size=world, offload=offload,
                )
                self.calls += 1
                hit = estimate_facts(self.estimator(setup))
            except SizingError as error:
                hit = error
            self.cache[key] = hit
        return hit
