"""status: what the operator observed and decided (phase, conditions, plans, attempts, progress,
provenance). Read tolerantly, so that statuses other operator versions wrote stay readable."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from kubernetes.utils import parse_quantity
from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

from finetune_trainer.combinations import STRATEGIES
from finetune_trainer.failures import ATTEMPT_OUTCOMES
from finetune_trainer.memory_levers import LEVERS, lever_fields_model

from .schema import ApiModel
from .training import Method, Optimizer


Phase = Literal["Pending", "Queued", "Launching", "Running", "Recovering", "Suspended", "Succeeded", "Failed"]

# Condition types, Kubernetes API conventions (positive polarity, CamelCase reasons).
COND_VALIDATED = "Validated"
COND_PLANNED = "Planned"
COND_RUNNING = "Running"
COND_RECOVERING = "Recovering"
COND_SUCCEEDED = "Succeeded"
COND_FAILED = "Failed"
COND_SUSPENDED = "Suspended"
# A queueing system (Kueue) holds the attempt's training job suspended until it admits it.
COND_QUEUED = "Queued"
# The operator cannot go on without a person: a foreign object holds a name it needs, the
# status cannot be understood, or the API refuses to create the attempt's objects.
COND_BLOCKED = "Blocked"


def _gib_from(value: Any) -> Any:
    """A GiB figure from a Kubernetes quantity ('61.3Gi', '80G') or, as statuses written by
    earlier operator versions hold it, a plain number of GiB."""
    if isinstance(value, str):
        try:
            return float(parse_quantity(value)) / 2**30
        except ValueError:
            raise ValueError(f"not a quantity: {value!r}") from None
    return value


def _gib_text(value: float) -> str:
    """GiB as a quantity a person reads: 61.3Gi, 80Gi."""
    return f"{round(value, 2):.2f}".rstrip("0").rstrip(".") + "Gi"


GiBQuantity = Annotated[
    float,
    BeforeValidator(_gib_from),
    PlainSerializer(_gib_text, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?Gi$"}),
]


def _gib_field(name: str, **kwargs: Any) -> Any:
    """A GiB figure written as `name` (a quantity); read from `name` or from the `<name>GiB`
    number that operator versions before quantities wrote, so their statuses stay readable."""
    return Field(validation_alias=AliasChoices(name, f"{name}GiB"), serialization_alias=name, **kwargs)


def kube_time(value: Any) -> datetime | None:
    """A timestamp as the API server writes it (RFC 3339, `Z` for UTC), or None when it is not one."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


class StatusModel(ApiModel):
    """Status comes back from the API server as JSON: timestamps are strings there.

    Read tolerantly: keys this operator does not know (written by a newer or older operator,
    another tool or a person) are ignored, never fatal; the operator's own fields must still
    have the right types."""

    model_config = ConfigDict(strict=False, extra="ignore")


class Condition(StatusModel):
    """A condition, following the Kubernetes API conventions."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    """Condition type: Validated, Planned, Queued, Running, Recovering, Suspended, Blocked, Succeeded, Failed."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    """One CamelCase word that says why."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """What a person should know."""
    last_transition_time: datetime
    """When the status last changed."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The .metadata.generation the condition was set for."""


class _PlanStatusHead(StatusModel):
    """The plan status's fields before the levers' (PlanStatus's docstring says what it is)."""

    node_pool: str
    """Node pool."""
    region: str
    """Region of the node pool."""
    gpu_type: str
    """GPU type, e.g. H100-80GB."""
    nodes: int
    """Nodes."""
    gpus_per_node: int
    """GPUs per node (processes per node)."""
    gpus: int
    """GPUs in all."""
    method: Method
    """Method (recovery may switch lora to qlora when allowed)."""
    strategy: Literal[STRATEGIES]  # type: ignore[valid-type]
    """Strategy."""
    offload: Literal["none", "optimizer", "optimizer+params"]
    """Offload."""
    optimizer: Optimizer
    """Optimizer."""
    micro_batch_size: int
    """Sequences per GPU per forward pass."""
    gradient_accumulation: int
    """Micro-batches per optimizer step."""
    gradient_checkpointing: bool
    """Activation recomputation."""


# The lever fields (masterWeights ... activationOffloading) come from the registry, between the head's and the rest.
_PlanStatusLevers = lever_fields_model(_PlanStatusHead, LEVERS)


class PlanStatus(_PlanStatusLevers):
    """The plan the current attempt runs with, and why it won."""

    lever_savings: dict[str, GiBQuantity] | None = None
    """The memory levers the plan uses (masterWeights, optimizerInBackward, lossChunks, activationOffloading) and
    the per-GPU memory each saves: the plan's required memory with that lever alone off, less its own (current plan only)."""
    predicted_peak_gi_b: GiBQuantity = _gib_field("predictedPeak")
    """Predicted peak allocated GPU memory per GPU (a quantity, e.g. 61.3Gi)."""
    required_gi_b: GiBQuantity = _gib_field("required")
    """Predicted GPU memory needed per GPU, with fragmentation and reserve (a quantity)."""
    gpu_memory_gi_b: GiBQuantity = _gib_field("gpuMemory")
    """GPU memory per GPU (a quantity, e.g. 80Gi)."""
    host_memory_gi_b: GiBQuantity = _gib_field("hostMemory")
    """Host memory requested per pod (a quantity)."""
    breakdown: dict[str, GiBQuantity] | None = None
    """Predicted per-GPU memory by term (weights, gradients, optimizerStates, activations, ...);
    only on the current plan, not on each attempt's record."""
    peak_phase: str | None = None
    """Training phase where the peak falls (current plan only)."""
    calibration: float = 1.0
    """Factor applied to the estimate, learned from out-of-memory failures of earlier attempts."""
    estimated_hours: float | None = None
    """Predicted wall time to finish, hours."""
    estimated_cost: float | None = None
    """Predicted cost to finish, in the catalog's currency."""
    needs_scale_up: bool = False
    """True when the pool has too few free GPUs now and must scale up."""
    reason: str | None = None
    """Why this plan won (current plan only)."""

    def compact(self) -> "PlanStatus":
        """The plan as an attempt's record keeps it: what ran, without the story of why."""
        return self.model_copy(update={"breakdown": None, "peak_phase": None, "reason": None, "lever_savings": None,
                                       "estimated_hours": None, "estimated_cost": None})


class PodFailure(StatusModel):
    """What one failed pod of an attempt showed. Written to status as soon as the operator sees
    it, so the reason survives the pod's deletion (eviction, cleanup) and an operator restart."""

    pod: str
    """Pod name."""
    kind: str
    """GPUOutOfMemory, HostOutOfMemory, Evicted, NodeLost, DataError, ConfigError or Unknown."""
    source: str
    """Where the verdict came from: report (the trainer's), log, kubelet, pod or exit-code."""
    message: str = ""
    """What the pod said (redacted and shortened)."""
    exit_code: int | None = None
    """Exit code of the training container."""
    phase: str | None = None
    """Training phase of a GPU out-of-memory failure (forward, backward, optimizer, ...)."""
    step: int | None = None
    """Optimizer step the trainer was at."""
    peak_allocated_gi_b: GiBQuantity | None = _gib_field("peakAllocated", default=None)
    """Peak allocated GPU memory the trainer or the CUDA error reported (a quantity)."""
    capacity_gi_b: GiBQuantity | None = _gib_field("capacity", default=None)
    """GPU memory the process could see (a quantity)."""
    tried_to_allocate_gi_b: GiBQuantity | None = _gib_field("triedToAllocate", default=None)
    """Size of the allocation that failed (a quantity)."""
    micro_batch_size: int | None = None
    """Micro-batch size the trainer ran with."""


# How an attempt ended (or that it runs): the failure vocabulary's outcomes (finetune_trainer.failures).
AttemptOutcome = Literal[ATTEMPT_OUTCOMES]  # type: ignore[valid-type]


class AttemptStatus(StatusModel):
    """One attempt: a PyTorchJob run with one plan."""

    attempt: Annotated[int, Field(ge=1)]
    """Attempt number, from 1."""
    pytorch_job: str = Field(alias="pytorchJob")
    """Name of the attempt's training job: a PyTorchJob, or a TrainJob on the Trainer v2 backend (the field
    keeps its first name so that existing statuses read back)."""
    plan_summary: str = ""
    """The plan in one line."""
    plan: PlanStatus | None = None
    """The plan this attempt ran with."""
    outcome: AttemptOutcome = "Running"
    """How it ended. Unschedulable: its pods found no node within the policy's bound, so it was
    moved or given up. Hung: it ran far longer than predicted (policy hungAfterFactor) and was
    restarted from its last checkpoint."""
    message: str = ""
    """What was observed (phase, step, peak) and, for a retry, what the next attempt changes."""
    observed_peak_gi_b: GiBQuantity | None = _gib_field("observedPeak", default=None)
    """Peak allocated GPU memory the trainer reported (a quantity)."""
    predicted_peak_gi_b: GiBQuantity | None = _gib_field("predictedPeak", default=None)
    """Peak the estimate predicted for this attempt (a quantity)."""
    start_time: datetime | None = None
    """When the attempt's PyTorchJob was created."""
    end_time: datetime | None = None
    """When it ended."""
    failed_pods: list[PodFailure] = []
    """Failed pods of this attempt as the operator saw them (the classification reads these too)."""
    nodes: list[str] = []
    """Nodes the attempt's pods ran on, as the operator saw them scheduled (the provenance record)."""
    images: list[str] = []
    """The trainer image each pod ran, by digest where the kubelet reported one (imageID), else by name."""
    running_since: datetime | None = None
    """When the first of the attempt's pods started on its node: GPU-hours count from here, not from
    the creation of the training job (time queued or waiting for a node holds no GPU)."""


class ProgressStatus(StatusModel):
    """How far the current attempt's training is, from the trainer's last progress line in its
    rank-0 pod's log (read through the API's pods/log, about every 20 seconds)."""

    attempt: Annotated[int, Field(ge=1)]
    """The attempt the figures belong to (a new attempt starts without progress)."""
    step: Annotated[int, Field(ge=0)]
    """Optimizer steps done, counted over all attempts (a resumed attempt continues the count)."""
    total_steps: Annotated[int, Field(ge=1)]
    """The step training ends at (spec.training.maxSteps, or what the trainer computed from epochs)."""
    summary: str = ""
    """step/totalSteps and the percentage, e.g. 120/2000 (6%): the PROGRESS column of kubectl get."""
    loss: float | None = None
    """Training loss at that step (absent when it is not a finite number, see lossNotFinite)."""
    loss_not_finite: bool | None = None
    """True when the trainer logged a NaN or infinite loss (training diverged)."""
    tokens_per_second: float | None = None
    """Tokens per second over all GPUs, over the trainer's last logging interval."""
    eval_loss: float | None = None
    """Mean loss on the held-out split (spec.evaluation) at its last evaluation; exp(evalLoss) is the perplexity."""
    eval_step: int | None = None
    """The step that evaluation ran at."""
    steps_per_second: float | None = None
    """Optimizer steps per second, smoothed over the attempt: what the ETA is computed from."""
    eta: datetime | None = None
    """When training should reach totalSteps at the smoothed rate; absent until the attempt has been
    seen doing at least two steps."""
    updated_at: datetime
    """When the trainer wrote the line these figures come from."""


class ProvenanceSummary(StatusModel):
    """What the finished model was trained on, where and at what cost: the summary of the record that
    `finetune-operator record NAME` prints in full. Written when the job succeeds."""

    base_model: str
    """spec.model.name, and the Hub revision where the weights came from the Hub."""
    base_config_sha256: str | None = None
    """sha256 of the base model's config.json as the trainer read it."""
    dataset_sha256: str | None = None
    """sha256 over every dataset file's name and sha256; the file list is in the output's
    provenance/attempt-N.json."""
    dataset_files: int | None = None
    """Dataset files read."""
    records: int | None = None
    """Dataset records read."""
    held_out: int | None = None
    """Sequences held out for evaluation (spec.evaluation.heldOutFraction), never trained on."""
    eval_dataset_sha256: str | None = None
    """sha256 over spec.evaluation.dataset's files (a separate evaluation dataset)."""
    eval_examples: int | None = None
    """Sequences of that separate evaluation dataset."""
    best_eval_step: int | None = None
    """The step of the lowest eval loss (spec.evaluation), and that loss."""
    best_eval_loss: float | None = None
    stopped_early_at: int | None = None
    """The step spec.evaluation.earlyStopping ended training at; absent when it ran to the end."""
    output_is_best: bool | None = None
    """spec.evaluation.keepBest: the output holds the model of bestEvalStep (false: it was not found,
    and the output is the last step's; the trainer's log says so)."""
    tokens_last_attempt: int | None = None
    """Tokens the succeeding attempt trained on (all GPUs); earlier attempts' tokens are not counted."""
    steps: int | None = None
    """Optimizer steps of the whole run (a resumed attempt continues the count)."""
    final_loss: float | None = None
    """Training loss at the last logged step."""
    eval_loss: float | None = None
    """Held-out loss at the last evaluation (spec.evaluation); exp(evalLoss) is the perplexity."""
    attempts: int
    """Attempts the job took."""
    regions: list[str] = []
    """Regions the attempts ran in."""
    gpu_hours: float
    """GPU-hours over every attempt: each attempt's GPUs x (its end - its first pod's start)."""
    energy_kwh_estimate: float | None = None
    """An estimate, not a measurement: GPU-hours x each GPU type's board power from the GPU table
    (host, network and cooling not counted). Absent when a GPU type has no board power in the table."""
    record: str
    """Where the trainer's part of the record is: the output location's provenance/ folder."""
    export: str | None = None
    """Where the export after training went (spec.export merged or full): the output location's merged/ or
    full/ folder, as rank 0's success report says; absent for an adapter."""
    export_bytes: int | None = None
    """The exported weights' bytes (in the training precision)."""


class FineTuneJobStatus(StatusModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase = "Pending"
    """Pending (validated, waiting for a plan that fits), Queued (a queueing system holds the attempt), Launching, Running, Recovering, Suspended, Succeeded or Failed."""
    reason: Annotated[str, Field(max_length=1024)] | None = None
    """Why the job is in its phase, in one CamelCase word: the reason of the condition that matters now (Blocked's, Failed's, Queued's, Planned=False's, ...). Shown by `kubectl get`."""
    conditions: Annotated[
        list[Condition],
        Field(json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}),
    ] = []
    """Validated, Planned, Queued, Running, Recovering, Suspended, Blocked, Succeeded, Failed: at most one of each type."""
    plan: PlanStatus | None = None
    """The plan of the current attempt."""
    attempts: list[AttemptStatus] = []
    """Every attempt so far, oldest first."""
    current_attempt: int | None = None
    """Number of the current attempt."""
    observed_generation: int | None = None
    """The .metadata.generation last acted on."""
    start_time: datetime | None = None
    """When the first attempt was created."""
    completion_time: datetime | None = None
    """When the job succeeded or finally failed."""
    next_attempt_time: datetime | None = None
    """When the next attempt starts (recovery backoff)."""
    progress: ProgressStatus | None = None
    """How far the current attempt's training is (step, loss, tokens per second, ETA), read from the
    trainer's log; kept after the attempt ends (a finished job keeps its last figures), removed when
    another attempt becomes current."""
    provenance: ProvenanceSummary | None = None
    """What the model was trained on, where and at what cost (written on success; see `finetune-operator record`)."""
