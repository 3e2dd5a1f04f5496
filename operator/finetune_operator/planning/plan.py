"""The planner's answer: a `Plan` (how and where to run a job) or an `Infeasible` (why nothing fits)."""

from __future__ import annotations

from typing import Any, Iterable, Literal, NamedTuple, Union

from pydantic.alias_generators import to_camel
from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from finetune_trainer.combinations import OPTIMIZERS, STRATEGIES
from finetune_trainer.memory_levers import (LEVERS, NO_LEVERS, Levers, camel, lever_fields_model, levers_of,
                                           ranks_per_replica)

from .. import api
from .pools import GiB, NodePool

StrategyName = Literal[STRATEGIES]  # type: ignore[valid-type]  (combinations.STRATEGIES: the one list)
OffloadName = Literal["none", "optimizer", "optimizer+params"]


class PlanKey(NamedTuple):
    """What makes two plans the same run (recovery excludes plans by this key)."""

    node_pool: str
    nodes: int
    gpus_per_node: int
    method: str
    strategy: str
    offload: str
    optimizer: str
    micro_batch_size: int
    gradient_checkpointing: bool
    # The memory levers' setting (memory_levers.Levers; default: every lever off, so keys of plans
    # made before them read back the same).
    levers: Levers = NO_LEVERS


class _PlanHead(BaseModel):
    """A Plan's fields before the memory levers'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pool: NodePool
    region: str
    gpu_type: str
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    method: Literal["full", "lora", "qlora"]
    strategy: StrategyName
    offload: OffloadName
    optimizer: Literal[OPTIMIZERS]  # type: ignore[valid-type]
    micro_batch_size: int = Field(ge=1)
    gradient_accumulation: int = Field(ge=1)
    gradient_checkpointing: bool
    attention: Literal["sdpa", "flash", "eager"]
    precision: Literal["bf16", "fp16", "fp32"]


# The memory levers the plan uses (master_weights ... activation_offloading, as the plan status
# declares them, off by default) come from the registry, after the head's (memory_levers/fields.py).
_PlanLevers = lever_fields_model(_PlanHead, LEVERS)


class Plan(_PlanLevers):
    """One concrete way to run a job: pool, GPUs, strategy, batch split, and why it won."""

    lever_savings_bytes: dict[str, int] = {}
    """Per-GPU required bytes each lever in use saves (the plan's estimate with that lever alone off, less its own)."""
    sequence_length: int = Field(ge=1)
    global_batch_size: int = Field(ge=1)
    estimate: dict[str, Any]
    """The sizing estimate (MemoryEstimate as a JSON dict) for this setup."""
    predicted_peak_bytes: int = Field(ge=0)
    """Predicted peak allocated GPU memory per GPU."""
    required_bytes: int = Field(ge=0)
    """Predicted GPU memory needed per GPU (peak plus fragmentation and reserve), after calibration."""
    breakdown_bytes: dict[str, int] = {}
    """Per-GPU memory by term."""
    peak_phase: str = ""
    """Training phase where the peak falls."""
    host_memory_bytes: int = Field(ge=0)
    """Host memory each pod (one per node) requests and is limited to."""
    calibration: float = 1.0
    """Factor applied to the estimate (learned from observed peaks: an out-of-memory failure of this job, or the cluster's runs of this kind)."""
    memory_headroom: float = 0.10
    """Fraction of GPU memory the plan leaves free."""
    estimated_hours: float | None = None
    """Predicted wall time to finish (None when the job runs by epochs of unknown size)."""
    estimated_cost: float | None = None
    """Predicted cost to finish in the catalog's currency (None when the price or the length is unknown)."""
    cost_per_step: float | None = None
    """Predicted cost of one optimizer step (GPU-hours x price, or GPU-hours when there is no price)."""
    seconds_per_step: float = 0.0
    """Predicted wall time of one optimizer step."""
    needs_scale_up: bool = False
    """True when the pool has too few free GPUs now and must scale up (or free GPUs are unknown)."""
    free_now: bool = False
    """True when the pool has enough free GPUs right now."""
    allowed_regions: list[str]
    """Regions the plan may choose from (cluster policy intersected with spec.placement.regions); the
    pods are pinned to `region` alone."""
    changes: list[str] = []
    """Where the plan departs from what the user asked (fields they left `auto` are not changes)."""
    reason: str = ""
    """Why this plan won, in one paragraph."""
    runners_up: list[str] = []
    """The next-best candidates, each with why it lost."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @model_validator(mode="before")
    @classmethod
    def _derived_gpus(cls, data: Any) -> Any:
        # A dumped plan carries `gpus` (derived); read it back only when it agrees.
        if isinstance(data, dict) and "gpus" in data:
            data = dict(data)
            gpus = data.pop("gpus")
            if gpus != data.get("nodes", 0) * data.get("gpus_per_node", 0):
                raise ValueError(f"gpus: {gpus} is not nodes x gpus_per_node")
        return data

    @property
    def data_parallel_size(self) -> int:
        # Every strategy here is data-parallel over all GPUs (sharding splits state, not data), but for the
        # GPUs that split one micro-batch's sequence (memory_levers.ranks_per_replica).
        return self.gpus // ranks_per_replica(self)

    @property
    def key(self) -> PlanKey:
        return PlanKey(
            self.pool.name,
            self.nodes,
            self.gpus_per_node,
            self.method,
            self.strategy,
            self.offload,
            self.optimizer,
            self.micro_batch_size,
            self.gradient_checkpointing,
            self.levers,
        )

    @property
    def levers(self) -> Levers:
        return levers_of(self)

    def summary(self) -> str:
        """The plan in one line (status attempts, logs)."""
        ckpt = "ckpt" if self.gradient_checkpointing else "no-ckpt"
        off = "" if self.offload == "none" else f", offload {self.offload}"
        levers = "".join(f", {w}" for w in self.levers.words())
        return (
            f"{self.pool.name}/{self.region}: {self.nodes} x {self.gpus_per_node} x {self.gpu_type}, "
            f"{self.strategy}{off}, micro {self.micro_batch_size} x accum {self.gradient_accumulation}, {ckpt}{levers}, "
            f"{self.required_bytes / GiB:.1f}/{self.pool.gpu_memory_bytes / GiB:.0f} GiB"
        )

    def _shape(self) -> dict[str, Any]:
        """The fields the plan status and the CLI's JSON share, in their order (camelCase)."""
        return {
            "nodePool": self.pool.name,
            "region": self.region,
            "gpuType": self.gpu_type,
            "nodes": self.nodes,
            "gpusPerNode": self.gpus_per_node,
            "gpus": self.gpus,
            "method": self.method,
            "strategy": self.strategy,
            "offload": self.offload,
            "optimizer": self.optimizer,
            "microBatchSize": self.micro_batch_size,
            "gradientAccumulation": self.gradient_accumulation,
            "gradientCheckpointing": self.gradient_checkpointing,
            **{camel(field): value for field, value in self.levers.setup_fields().items()},
        }

    def to_status(self) -> api.PlanStatus:
        return api.PlanStatus.model_validate(
            {
                **self._shape(),
                "leverSavings": {to_camel(k): round(v / GiB, 2) for k, v in self.lever_savings_bytes.items()} or None,
                "predictedPeak": round(self.predicted_peak_bytes / GiB, 2),
                "required": round(self.required_bytes / GiB, 2),
                "gpuMemory": round(self.pool.gpu_memory_bytes / GiB, 2),
                "hostMemory": round(self.host_memory_bytes / GiB, 2),
                # One naming style in the status: camelCase terms, like every other key.
                "breakdown": {to_camel(k): round(v / GiB, 2) for k, v in self.breakdown_bytes.items()},
                "peakPhase": self.peak_phase,
                "calibration": round(self.calibration, 4),
                "estimatedHours": None if self.estimated_hours is None else round(self.estimated_hours, 3),
                "estimatedCost": None if self.estimated_cost is None else round(self.estimated_cost, 2),
                "needsScaleUp": self.needs_scale_up,
                "reason": self.reason,
            }
        )

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON shape (camelCase, the keys the issue names)."""
        return {
            **self._shape(),
            "leverSavingsBytes": dict(self.lever_savings_bytes),
            "attention": self.attention,
            "precision": self.precision,
            "sequenceLength": self.sequence_length,
            "predictedPeakBytes": self.predicted_peak_bytes,
            "requiredBytes": self.required_bytes,
            "gpuMemoryBytes": self.pool.gpu_memory_bytes,
            "memoryHeadroom": self.memory_headroom,
            "calibration": self.calibration,
            "hostMemoryBytes": self.host_memory_bytes,
            "breakdownBytes": dict(self.breakdown_bytes),
            "peakPhase": self.peak_phase,
            "estimate": self.estimate,
            "secondsPerStep": self.seconds_per_step,
            "estimatedHours": self.estimated_hours,
            "estimatedCost": self.estimated_cost,
            "needsScaleUp": self.needs_scale_up,
            "freeNow": self.free_now,
            "allowedRegions": list(self.allowed_regions),
            "changes": list(self.changes),
            "reason": self.reason,
            "runnersUp": list(self.runners_up),
        }


class Infeasible(BaseModel):
    """No plan fits: why, precisely, and the nearest miss."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    message: str
    """One paragraph a person can act on, naming the nearest miss."""
    allowed_regions: list[str] = []
    """Regions the job may use (policy intersected with the job)."""
    nearest_miss: str | None = None
    """The candidate that came closest, and what stopped it."""
    rejected: dict[str, int] = {}
    """How many candidates each constraint rejected."""

    def to_json(self) -> dict[str, Any]:
        return {
            "feasible": False,
            "message": self.message,
            "allowedRegions": list(self.allowed_regions),
            "nearestMiss": self.nearest_miss,
            "rejected": dict(self.rejected),
        }


PlanningResult = Union[Plan, Infeasible]


def plan_key_of(value: "Plan | PlanKey | api.PlanStatus | Iterable[Any]") -> PlanKey:
    """The key of a plan given as a Plan, a PlanKey, a PlanStatus (from a job's status) or a tuple."""
    if isinstance(value, Plan):
        return value.key
    if isinstance(value, PlanKey):
        return value
    if isinstance(value, api.PlanStatus):
        return PlanKey(
            value.node_pool,
            value.nodes,
            value.gpus_per_node,
            value.method,
            value.strategy,
            value.offload,
            value.optimizer,
            value.micro_batch_size,
            value.gradient_checkpointing,
            levers_of(value),
        )
    return PlanKey(*value)
