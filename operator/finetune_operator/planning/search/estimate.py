"""Stage 2 of the plan search: estimate what a group costs and how much memory it needs.

Cost (`Costs`): seconds and ranking cost per step of a group at a micro-batch, from the step-time
model (throughput.py) and the levers' host traffic. Cheap, so the choice stage prices every group
at its largest micro-batch up front: that is the bound its branch and bound orders groups by.
Memory (`Estimates`): the sizing model's estimate of a setup, asked only for the groups the fit
stage sizes, cached per setup for the plan (memory does not depend on the pool), and, for the
default model, across plans (the jobs of a platform repeat setups).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from dataclasses import dataclass
from typing import Any, Callable

from ...sizing import SizingError, TrainingSetup, estimate_memory
from ...sizing.setup import declared_window
from finetune_trainer.memory_levers import LEVERS, NO_LEVERS, Levers, ranks_per_replica, savings, unsplit

from ..throughput import (
    PCIE_GBYTES,
    JobWork,
    accumulation_steps,
    combine,
    compute_and_communication,
    job_work,
    offload_costs,
)
from .ask import Ask
from .space import Group

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
    return estimate_memory


# The sizing model is a pure function of the setup, and the jobs of a platform repeat setups (the same
# model, sequence length and batch over many jobs; every re-plan of a job): in a burst of a thousand
# such jobs each plan sized the same setups again, most of the planner's time (bench/scale.py). So
# the default model's answers are kept across plans, keyed by what the setup is made of, bounded,
# least recently used first. Another estimator (tests, bench/planner.py) is asked every time.
MEMO_SIZE = 4096
_memo: "OrderedDict[tuple, EstimateFacts | SizingError]" = OrderedDict()
_memo_lock = threading.Lock()


def _recall(key: tuple) -> "EstimateFacts | SizingError | None":
    with _memo_lock:
        hit = _memo.get(key)
        if hit is not None:
            _memo.move_to_end(key)
        return hit


def _remember(key: tuple, value: "EstimateFacts | SizingError") -> None:
    with _memo_lock:
        _memo[key] = value
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)


class Estimates:
    """Sizing estimates cached per setup for one planning call (they do not depend on the pool)."""

    def __init__(self, ask: Ask, estimator: Estimator):
        self.ask = ask
        self.estimator = estimator
        self.cache: dict[tuple, EstimateFacts | SizingError] = {}
        self.calls = 0
        self.shared = None  # the job's part of the process-wide key, when the default model sizes
        if estimator is estimate_memory:
            a = ask  # every field of the job that setup() reads
            shared = (a.arch, a.method, a.lora_rank, a.lora_targets, a.precision, a.optimizer, a.sequence_length,
                      a.attention, a.packing, a.padding_free, a.micro_batch_tokens, a.global_batch_size, a.target_experts, a.lora_dropout,
                      a.lora_modules_to_save)
            try:
                hash(shared)
                self.shared = shared
            except TypeError:  # an architecture that cannot be hashed: sized every time
                pass

    def get(self, world: int, strategy: str, offload: str, checkpointing: bool, micro: int,
            levers: Levers = NO_LEVERS, declared: bool = True) -> EstimateFacts | SizingError:
        """`declared` False: sized without spec.dataset.microBatchTokens (which describes the training
        stream, not the evaluation data)."""
        key = (world, strategy, offload, checkpointing, micro, levers, declared)
        hit = self.cache.get(key)
        if hit is None and self.shared is not None:
            hit = _recall((self.shared, key))
        if hit is None:
            try:
                setup = self.setup(world, strategy, offload, checkpointing, micro, levers, declared)
                self.calls += 1
                hit = estimate_facts(self.estimator(setup))
            except SizingError as error:
                hit = error
            if self.shared is not None:
                _remember((self.shared, key), hit)
        self.cache[key] = hit
        return hit

    def eval_required(self, world: int, strategy: str, offload: str, levers: Levers = NO_LEVERS,
                      micro: int | None = None) -> int | SizingError:
        """Required bytes per GPU while it evaluates at the job's eval micro-batch (ask.eval_micro_batch):
        the forward phase of that micro-batch with gradient checkpointing, which bounds a forward under
        no_grad from above (it keeps each block's input for backward; no_grad keeps nothing), with the
        resident states of the setup and the estimate's own allocator margin. An estimator that says
        nothing of its phases counts its whole step (more, never less). Evaluation runs each rank's
        sequences whole (the trainer turns sequence parallelism off for it): sized unsplit."""
        micro = micro or self.ask.eval_micro_batch
        assert micro is not None
        levers = unsplit(levers)
        facts = self.get(world, strategy, offload, True, micro, levers, declared=False)
        if isinstance(facts, SizingError):
            return facts
        phases = getattr(facts.source, "phase_peaks", None) or {}
        forward = phases.get("forward")
        if forward is None:
            return facts.required_bytes
        return int(facts.required_bytes - facts.peak_bytes + forward)

    def setup(self, world: int, strategy: str, offload: str, checkpointing: bool, micro: int,
              levers: Levers = NO_LEVERS, declared: bool = True) -> TrainingSetup:
        a = self.ask  # a field of the job read here belongs in `self.shared` too (the memo's key)
        return TrainingSetup(
            architecture=a.arch, method=a.method, lora_rank=a.lora_rank, lora_targets=a.lora_targets,
            lora_dropout=a.lora_dropout, lora_modules_to_save=a.lora_modules_to_save,
            precision=a.precision, optimizer=a.optimizer, micro_batch_size=micro,
            sequence_length=a.sequence_length, gradient_checkpointing=checkpointing, attention=a.attention,
            packing=a.packing, padding_free=a.padding_free, micro_batch_tokens=a.micro_batch_tokens if declared else (), strategy=strategy, world_size=world, offload=offload,
            gradient_accumulation=max(1, a.global_batch_size * ranks_per_replica(levers) // (micro * world)),
            lora_target_experts=a.target_experts and a.method != "full", **levers.setup_fields(),
        )

    def savings(self, world: int, strategy: str, offload: str, checkpointing: bool, micro: int,
                levers: Levers) -> dict[str, int]:
        """Required bytes per GPU each lever in use saves (memory_levers.savings), sized through this cache."""
        own = self.get(world, strategy, offload, checkpointing, micro, levers)
        if isinstance(own, SizingError):
            return {}

        def required(other: Levers) -> int | None:
            facts = self.get(world, strategy, offload, checkpointing, micro, other)
            return None if isinstance(facts, SizingError) else facts.required_bytes

        return savings(levers, own.required_bytes, required)


# ---------------------------------------------------------------------------
# Cost
# ---------------------------------------------------------------------------


def work_of(ask: Ask) -> JobWork:
    """The job's work per step, for the step-time model. With spec.dataset.microBatchTokens declared
    (unpacked data) rows are at most the longest example long, and padding-free a step computes on at
    most the real tokens its samples can hold: upper bounds, as the memory model's are."""
    declared = () if ask.packing else ask.micro_batch_tokens
    row = declared_window(ask.sequence_length, declared, 1)
    step = declared_window(ask.sequence_length, declared, ask.global_batch_size) if ask.padding_free else None
    return job_work(
        ask.arch, method=ask.method, lora_rank=ask.lora_rank, lora_targets=ask.lora_targets, precision=ask.precision,
        sequence_length=row, global_batch_size=ask.global_batch_size, step_tokens=step,
    )


class Costs:
    """Seconds and ranking cost per step of a group at a micro-batch. Compute and communication do
    not depend on offload, so the offload variants of a group share them."""

    def __init__(self, work: JobWork, arch: Any = None) -> None:
        self.work = work
        self.arch = arch  # for the levers' host transfers
        self.shared: dict[tuple, tuple[float, float]] = {}

    def of(self, group: Group, micro: int) -> tuple[float, float]:
        replica = ranks_per_replica(group.levers)
        key = (id(group.pool), group.nodes, group.gpus_per_node, group.strategy, group.checkpointing, micro, replica)
        parts = self.shared.get(key)
        if parts is None:
            parts = self.shared[key] = compute_and_communication(
                self.work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, strategy=group.strategy,
                gradient_checkpointing=group.checkpointing, micro_batch_size=micro, tflops=group.tflops,
                sequence_parallel=replica,
            )
        transfers, cpu_step = offload_costs(
            self.work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, offload=group.offload,
            gradient_checkpointing=group.checkpointing, micro_batch_size=micro, sequence_parallel=replica,
        )
        lever_bytes = [lever.host_transfer_bytes(self.arch, micro, self.work.sequence_length)
                       for lever in LEVERS if lever.host_transfer_bytes is not None and lever.in_use(group.levers)]
        if lever_bytes:
            transfers += self.lever_transfers(group, micro, sum(lever_bytes))
        seconds = combine(parts[0], parts[1], transfers, cpu_step)
        return seconds, seconds * group.world / 3600 * group.price

    def lever_transfers(self, group: Group, micro: int, per_micro: float) -> float:
        """Seconds per step of the levers' host traffic (Lever.host_transfer_bytes: activation
        offloading's block inputs out in forward and back in backward), each micro-batch, over the
        GPU's PCIe link (hidden by compute as far as `combine` lets traffic hide)."""
        return accumulation_steps(self.work, group.world, micro, ranks_per_replica(group.levers)) * per_micro / (
            PCIE_GBYTES * 1e9)
