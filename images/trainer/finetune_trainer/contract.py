"""The contract between the operator and the trainer.

Two documents cross the boundary between the operator and the training pods:

* ``TrainerConfig`` goes in: the renderer serialises it (camelCase JSON) into a
  ConfigMap that is mounted at ``/etc/finetune/config.json``; the trainer reads it.
* ``FailureReport`` comes out: the trainer writes it to the container's termination
  message (``/dev/termination-log``) when it fails; the operator parses it from the
  pod status.

This module imports pydantic only (no torch), because the operator imports it too.
Nothing here is defined a second time anywhere else. The failure reasons and the exit
codes the trainer signals them with are the failure vocabulary's (`failures.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .combinations import EXPORTS, OPTIMIZERS, STRATEGIES, Choices, describe, violations
from .failures import (  # noqa: F401  (the exit codes are the contract's names too)
    EXIT_CONFIG_ERROR,
    EXIT_DATA_ERROR,
    EXIT_GPU_OOM,
    EXIT_HOST_OOM,
    EXIT_OK,
    EXIT_SIGKILL,
    EXIT_SIGTERM,
    EXIT_UNKNOWN,
    FAILURES,
    TRAINER_REPORTED,
    FailureKind,
)
from .memory_levers import LEVERS, choice_values, lever_fields_model

DEFAULT_CONFIG_PATH = "/etc/finetune/config.json"
DEFAULT_REPORT_PATH = "/dev/termination-log"
# The kubelet truncates the termination message at 4096 bytes; stay within it so the
# JSON is never cut in the middle.
TERMINATION_MESSAGE_LIMIT = 4096

# The trainer's name for the one failure vocabulary: a report carries one of the kinds the
# trainer reports itself (failures.TRAINER_REPORTED).
FailureReason = FailureKind


class Phase(str, Enum):
    SETUP = "setup"
    LOAD = "load"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    EXPORT = "export"  # after training: the merged or full folder (export.py)


EXIT_CODE_FOR_REASON: dict[FailureReason, int] = {
    kind: FAILURES[kind].exit_code for kind in TRAINER_REPORTED  # type: ignore[misc]
}
_REASON_FOR_EXIT_CODE = {code: reason for reason, code in EXIT_CODE_FOR_REASON.items()}


def reason_for_exit_code(exit_code: int) -> FailureReason | None:
    """The failure reason our trainer signals with ``exit_code``.

    ``None`` for 0 (success). Every other code that is not one of ours, including
    137 and 143, gives ``Unknown``: a signal death is not something the trainer
    reported, and the operator must look at the container's ``reason`` (``OOMKilled``)
    to tell a kernel OOM kill from any other kill.
    """
    if exit_code == EXIT_OK:
        return None
    return _REASON_FOR_EXIT_CODE.get(exit_code, FailureReason.UNKNOWN)


class _Contract(BaseModel):
    """camelCase on the wire (matching the FineTuneJob API), snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )


# --------------------------------------------------------------------------- input


class ModelSource(_Contract):
    path: str = Field(min_length=1, description="Local directory with config.json and weights")
    tokenizer_path: str | None = Field(None, description="Defaults to the model path")
    trust_remote_code: bool = False


class DatasetSource(_Contract):
    """A JSONL file (or a directory of ``*.jsonl`` files).

    Line formats: ``chat`` -> ``{"messages": [{"role": ..., "content": ...}, ...]}``
    rendered with the tokenizer's chat template; ``instruction`` ->
    ``{"instruction": ..., "input": optional, "response" | "output": ...}``;
    ``text`` -> ``{"text": ...}``.
    """

    path: str = Field(min_length=1)
    format: Literal["chat", "instruction", "text"] = "chat"
    packing: bool = False


class LoraSettings(_Contract):
    rank: int = Field(16, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    # Also adapt the fused 3-D expert weights of mixture-of-experts layers (peft
    # `target_parameters`), which are parameters, not Linear modules.
    target_experts: bool = False
    # Modules trained in full beside the adapters (peft `modules_to_save`: the input embedding,
    # the output head): peft trains a copy of each, which the trainer keeps in fp32 like the
    # adapters (model_setup.train_in_fp32). None (left out of the JSON, so that a config without
    # it reads the same on a trainer that predates it): none.
    modules_to_save: list[str] | None = None

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(not m for m in value)):
            raise ValueError("targetModules must be 'all-linear' or a non-empty list of module names")
        return value

    @model_validator(mode="after")
    def _saved_apart(self) -> "LoraSettings":
        saved = self.modules_to_save or []
        if any(not m for m in saved) or len(set(saved)) != len(saved):
            raise ValueError("modulesToSave must name distinct modules")
        both = sorted(set(saved) & set(self.target_modules if isinstance(self.target_modules, list) else ()))
        if both:
            raise ValueError(f"modulesToSave: {', '.join(both)} also in targetModules (a module is trained in full "
                             "or adapted, not both)")
        return self


class FsdpSettings(_Contract):
    """FSDP2 as transformers applies it at load time (``DistributedConfig``).

    Always full-shard over all ranks; under bf16 the mixed-precision policy is
    param_dtype=bf16, reduce_dtype=fp32 (see notes/trainer_settings.md); parameters go
    to the host when ``offload`` is "optimizer+params". ``plan`` overrides the model's
    own FSDP plan per module pattern (transformers' ``fsdp_plan``).
    """

    plan: dict[str, Literal["free_full_weight", "keep_full_weight"]] = Field(default_factory=dict)


class CheckpointSettings(_Contract):
    directory: str = Field(min_length=1)
    every_steps: int = Field(200, ge=1)
    keep_last: int = Field(2, ge=1)


class EarlyStopping(_Contract):
    """Stop once `patience` evaluations in a row improved the best eval loss by no more than `min_delta`."""

    patience: int = Field(ge=1)
    min_delta: float = Field(0.0, ge=0)


class EvaluationSettings(_Contract):
    """Evaluation on a held-out part of the dataset or on a dataset of its own (FineTuneJob
    spec.evaluation): exactly one of the two."""

    held_out_fraction: float | None = Field(None, gt=0, le=0.5)
    """The fraction of the built sequences kept out of training, chosen by the seed alone
    (data.held_out_split), so a resumed attempt evaluates on the same samples."""
    dataset: DatasetSource | None = None
    """A separate evaluation dataset, every sequence of it evaluated on; training uses all of
    the training dataset."""
    every_steps: int | None = Field(None, ge=1)
    """Evaluate every this many optimizer steps, and always at the end; None: only at the end."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Sequences per device per evaluation forward; None: the training micro-batch."""
    early_stopping: EarlyStopping | None = None
    keep_best: bool | None = None
    """True: the output is the model of the best evaluation (kept in <checkpoints>/best), not the
    last step's; needs the checkpoint directory (evaluation.py). None (left out of the JSON): no."""

    @model_validator(mode="after")
    def _one_source(self) -> "EvaluationSettings":
        if (self.held_out_fraction is None) == (self.dataset is None):
            raise ValueError("set exactly one of heldOutFraction, dataset")
        return self


class FaultInjection(_Contract):
    """Test-only hook; the operator never sets it.

    ``gpu-oom`` raises ``torch.OutOfMemoryError``, ``error`` raises a RuntimeError
    (-> Unknown), ``kill`` sends SIGKILL to the process (like a preemption) at the
    given global step and phase. ``attempt``: fire only on that attempt (any if unset).
    ``rank``: fire only on that rank (all if unset).
    """

    kind: Literal["gpu-oom", "error", "kill"]
    step: int = Field(ge=0)
    phase: Literal["forward", "backward", "optimizer", "checkpoint"] = "forward"
    attempt: int | None = Field(None, ge=1)
    rank: int | None = Field(None, ge=0)


Strategy = Literal[STRATEGIES]  # type: ignore[valid-type]  (combinations.STRATEGIES: the one list)
Offload = Literal["none", "optimizer", "optimizer+params"]

ZERO_STAGE: dict[str, int] = {"zero1": 1, "zero2": 2, "zero3": 3}


def default_export(method: str) -> str:
    """The export of a job that names none: the adapter for lora/qlora, the weights for full."""
    return "full" if method == "full" else "adapter"


class _TrainerConfigHead(_Contract):
    """The trainer config's fields before the memory levers'."""

    job_name: str = Field(min_length=1)
    attempt: int = Field(1, ge=1)

    model: ModelSource
    dataset: DatasetSource

    method: Literal["full", "lora", "qlora"] = "lora"
    lora: LoraSettings = Field(default_factory=LoraSettings)

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer: Literal[OPTIMIZERS] = "adamw"  # type: ignore[valid-type]  (optimizers.py)


# The memory levers (masterWeights ... activationOffloading: each lever's fields as the plan status
# declares them, documented there, off by default) come from the registry, after the head's
# (memory_levers/fields.py); the rest of the config follows in TrainerConfig.
_TrainerConfigLevers = lever_fields_model(_TrainerConfigHead, LEVERS)


class TrainerConfig(_TrainerConfigLevers):
    """The trainer's whole input, one JSON document."""

    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    # Fraction of all optimizer steps spent warming up, for runs by epochs whose step
    # count only the trainer knows; used when warmupSteps is 0 (as in the HF Trainer).
    warmup_ratio: float | None = Field(None, ge=0, le=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float = Field(1.0, ge=0)

    sequence_length: int = Field(2048, ge=8)
    micro_batch_size: int = Field(1, ge=1)
    gradient_accumulation: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    gradient_checkpointing: bool = False
    attention: Literal["sdpa", "flash", "eager"] = "sdpa"

    strategy: Strategy = "ddp"
    fsdp: FsdpSettings | None = None
    # A complete DeepSpeed config for ZeRO-1/2/3 (offload included); batch-size keys
    # may be "auto" so the Trainer fills them from microBatchSize/gradientAccumulation.
    deepspeed: dict[str, Any] | None = None
    offload: Offload = "none"

    checkpoint: CheckpointSettings | None = None
    evaluation: EvaluationSettings | None = None
    output_directory: str = Field(min_length=1)
    # What is written after training succeeds (export.py): "adapter" nothing beyond the adapter the
    # Trainer saved; "merged" <output>/merged, the base with the adapter merged in; "full"
    # <output>/full, full fine-tuning's weights. Both folders in the training dtype, as safetensors
    # shards with index, config and tokenizer. None: by method (export_kind), adapter for lora/qlora,
    # full for full.
    export: Literal[EXPORTS] | None = None  # type: ignore[valid-type]
    seed: int = 42
    report_path: str = DEFAULT_REPORT_PATH
    log_every_steps: int = Field(1, ge=1)

    fault_injection: FaultInjection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "TrainerConfig":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("exactly one of maxSteps and epochs must be set")
        if self.fsdp is not None and self.strategy != "fsdp":
            raise ValueError(f"fsdp settings given but strategy is {self.strategy!r}")
        stage = ZERO_STAGE.get(self.strategy)
        if stage is None:
            if self.deepspeed is not None:
                raise ValueError(f"deepspeed config given but strategy is {self.strategy!r}")
        else:
            if self.deepspeed is None:
                raise ValueError(f"strategy {self.strategy!r} needs a deepspeed config")
            _check_deepspeed(self.deepspeed, stage, self.offload)
        # What combines with what lives in one place (combinations.py), asked by the API,
        # the memory model and the planner as well.
        problems = violations(self.choices())
        if problems:
            raise ValueError(describe(problems))
        if self.evaluation is not None and self.evaluation.keep_best and self.checkpoint is None:
            raise ValueError("evaluation.keepBest needs checkpoint (the best model is kept beside the checkpoints)")
        return self

    @property
    def export_kind(self) -> str:
        """The export this attempt writes: `export`, or the method's default when the config names none
        (left out of the JSON then, so a config without it reads the same on a trainer that predates it)."""
        return self.export or default_export(self.method)

    def choices(self) -> Choices:
        """This config's training choices, as combinations.py reads them."""
        return Choices(
            method=self.method, strategy=self.strategy, offload=self.offload, optimizer=self.optimizer,
            precision=self.precision, gradient_accumulation=self.gradient_accumulation,
            gradient_clipping=self.max_grad_norm > 0, gradient_checkpointing=self.gradient_checkpointing,
            target_experts=self.lora.target_experts if self.method != "full" else None,
            modules_to_save=bool(self.lora.modules_to_save) if self.method != "full" else None,
            export=self.export,
            **choice_values(self),
        )

    @property
    def zero_stage(self) -> int | None:
        return ZERO_STAGE.get(self.strategy)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=2)


def _check_deepspeed(ds: dict[str, Any], stage: int, offload: str) -> None:
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ValueError("deepspeed config needs a zero_optimization block")
    if zero.get("stage") != stage:
        raise ValueError(
            f"deepspeed zero_optimization.stage is {zero.get('stage')!r}, strategy says {stage}"
        )
    opt_off = _offload_device(zero.get("offload_optimizer"))
    param_off = _offload_device(zero.get("offload_param"))
    declared = {"none": ("none", "none"), "optimizer": ("cpu", "none"),
                "optimizer+params": ("cpu", "cpu")}[offload]
    actual = ("cpu" if opt_off in ("cpu", "nvme") else "none",
              "cpu" if param_off in ("cpu", "nvme") else "none")
    if actual != declared:
        raise ValueError(
            f"deepspeed offload (optimizer={opt_off}, params={param_off}) "
            f"does not match offload {offload!r}"
        )


def _offload_device(block: Any) -> str:
    if not block:
        return "none"
    if not isinstance(block, dict):
        raise ValueError("deepspeed offload blocks must be objects")
    return str(block.get("device", "none"))


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed ZeRO settings every config `deepspeed_config` writes, in elements.

    One place for both sides: the trainer writes these into its DeepSpeed config and the
    operator's memory model (finetune_operator/sizing/zero3.py) replays stage 3 with the same
    numbers, so the estimate and the run cannot disagree.
    """

    # 5e7 elements is 100 MB in bf16 per bucket: large enough for full-bandwidth collectives
    # (DeepSpeed's docs tune between 5e7 and 5e8), small enough that the two reduce buckets
    # overlap_comm keeps cost 0.2 GB per GPU, not DeepSpeed's default 2 GB.
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    # Stage 3: elements gathered ahead of the module that runs, per fetch (DeepSpeed's default).
    prefetch_bucket_size: int = 50_000_000
    # Parameters of at most this many elements stay gathered on every rank (norms, biases):
    # DeepSpeed's default.
    param_persistence_threshold: int = 100_000
    # Gathered elements alive at once (bounds the prefetch), and how far ahead in the trace a
    # released parameter is looked for to keep it gathered for its next use: DeepSpeed's defaults.
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    # The optimizer step runs one sub-group of the rank's partition at a time and builds that
    # sub-group's fp32 gradient (4 bytes per element) for it. DeepSpeed's default (1e9) makes
    # that 4 GB per GPU once a partition holds a billion elements; 1e8 keeps it at 0.4 GB and
    # still steps in large fused kernels.
    sub_group_size: int = 100_000_000

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ZeroSettings.{name} must be a positive integer, not {value!r}")

    def scaled(self, divisor: int) -> "ZeroSettings":
        """The settings with every element budget divided by `divisor` (bench/zero_truth.py runs
        small models on the CPU with budgets in the proportion a large model meets them); the
        persistence threshold is per tensor and stays."""
        keep = {"param_persistence_threshold"}
        return ZeroSettings(**{name: getattr(self, name) if name in keep else max(1, getattr(self, name) // divisor)
                               for name in self.__dataclass_fields__})


ZERO_SETTINGS = ZeroSettings()


def deepspeed_config(stage: int, offload: str = "none", settings: ZeroSettings = ZERO_SETTINGS) -> dict[str, Any]:
    """A complete DeepSpeed config for ZeRO ``stage`` that the trainer accepts, with `settings`
    (ZERO_SETTINGS unless a bench scales them).

    Batch sizes, precision and optimizer hyper-parameters are "auto": the transformers
    Trainer fills them from the TrainerConfig, so the renderer need not repeat them and
    a recovery step that changes the micro-batch cannot leave them inconsistent.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        # Set explicitly: transformers fills only keys spelled "auto", and DeepSpeed's own
        # defaults (5e8-element buckets, doubled by overlap_comm) would hold gigabytes per
        # GPU that the memory model (sizing/constants.py reads these names) must agree with.
        "reduce_bucket_size": settings.reduce_bucket_size,
        "allgather_bucket_size": settings.allgather_bucket_size,
    }
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = settings.prefetch_bucket_size
        zero["stage3_param_persistence_threshold"] = settings.param_persistence_threshold
        zero["stage3_max_live_parameters"] = settings.max_live_parameters
        zero["stage3_max_reuse_distance"] = settings.max_reuse_distance
        zero["sub_group_size"] = settings.sub_group_size
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "optimizer+params":
        if stage != 3:
            raise ValueError("parameter offload needs ZeRO-3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # Gather the full weights on save so the output folder holds a normal model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


class ConfigLoadError(ValueError):
    """The config file is missing, not JSON, or not a valid TrainerConfig."""


def load_trainer_config(path: str | Path = DEFAULT_CONFIG_PATH) -> TrainerConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigLoadError(f"cannot read trainer config {path}: {exc}") from exc
    try:
        return TrainerConfig.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigLoadError(f"invalid trainer config {path}: {problems}") from exc


# -------------------------------------------------------------------------- output


class FailureReport(_Contract):
    """What the trainer writes to the termination message when it fails."""

    reason: FailureReason
    phase: Phase
    # The optimizer step in progress (1-based) in forward/backward/optimizer; the step
    # just completed in checkpoint; the step resumed from (0 on a fresh start) in
    # setup/data/load.
    step: int = Field(ge=0)
    message: str = ""
    exit_code: int
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    device_total_bytes: int | None = Field(None, ge=0)
    micro_batch_size: int | None = Field(None, ge=1)
    sequence_length: int | None = Field(None, ge=1)
    gradient_accumulation: int | None = Field(None, ge=1)
    rank: int = Field(0, ge=0)
    world_size: int | None = Field(None, ge=1)
    attempt: int | None = Field(None, ge=1)

    @field_validator("reason")
    @classmethod
    def _reported_by_the_trainer(cls, reason: FailureReason) -> FailureReason:
        # The vocabulary also holds what only the operator observes (an eviction, a lost node, a
        # hang): no trainer writes those, so a report that says so is not one of ours.
        if reason not in TRAINER_REPORTED:
            raise ValueError(f"{reason.value} is not a reason the trainer reports "
                             f"({', '.join(k.value for k in TRAINER_REPORTED)})")
        return reason

    def to_termination_message(self, limit: int = TERMINATION_MESSAGE_LIMIT) -> str:
        """Compact JSON that fits in ``limit`` bytes (UTF-8); the message is cut to fit."""
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        if len(text.encode()) <= limit:
            return text
        empty = self.model_copy(update={"message": ""}).model_dump_json(
            by_alias=True, exclude_none=True
        )
        budget = limit - len(empty.encode())
        if budget < 0:
            raise ValueError("failure report does not fit the termination message even without a message")
        # JSON escaping can grow the text (quotes, control characters); find the
        # longest prefix of the message whose serialised report fits.
        marker = " …[truncated]"

        def render(cut: int) -> str:
            return self.model_copy(update={"message": self.message[:cut] + marker}).model_dump_json(
                by_alias=True, exclude_none=True
            )

        lo, hi = 0, min(len(self.message), budget)
        if len(render(lo).encode()) > limit:
            return empty
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(render(mid).encode()) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return render(lo)


def parse_failure_report(text: str | None) -> FailureReport | None:
    """The report in a termination message, or None when it holds something else
    (e.g. the log tail that ``FallbackToLogsOnError`` puts there for other images)."""
    if not text:
        return None
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    try:
        return FailureReport.model_validate(data)
    except ValidationError:
        return None


# ------------------------------------------------------------------------ progress

# The marker key and value of a progress line: {"event": "progress", ...}.
PROGRESS_EVENT = "progress"
# A reader looks at most this many characters of one line (a progress line is ~400).
PROGRESS_LINE_LIMIT = 4096


class ProgressReport(_Contract):
    """One line of the trainer's stdout (the pod log) per logging step, written by rank 0:
    a JSON object whose ``event`` is ``progress``. The operator reads the last one from the
    master pod's log (``pods/log``) into ``status.progress``.

    Read tolerantly: keys this model does not know (from a newer trainer) are ignored, so a
    trainer and an operator of different versions still understand each other."""

    model_config = ConfigDict(extra="ignore")

    event: Literal["progress"] = PROGRESS_EVENT
    time: float = Field(gt=0)
    """When the line was written (Unix seconds)."""
    rank: int = Field(0, ge=0)
    attempt: int | None = Field(None, ge=1)
    """The attempt (TrainerConfig.attempt) this process belongs to."""
    step: int = Field(ge=0)
    """Optimizer steps done, counted over all attempts (a resumed attempt continues the count)."""
    max_steps: int = Field(ge=1)
    """The step training ends at; for a run by epochs, what the trainer computed from the data."""
    start_step: int | None = Field(None, ge=0)
    """The step this attempt resumed from (0 on a fresh start)."""
    elapsed_seconds: float | None = Field(None, ge=0)
    """Seconds since this attempt's training loop began (loading not counted)."""
    loss: float | None = None
    """Training loss of the last logging interval (may be NaN or inf when training diverges)."""
    learning_rate: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = Field(None, ge=0)
    """Tokens (all ranks) per second over the last logging interval."""
    samples_consumed: int | None = Field(None, ge=0)
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    host_peak_rss_bytes: int | None = Field(None, ge=0)
    eval_loss: float | None = None
    """Mean loss on the held-out split at its last evaluation (carried on every later line)."""
    eval_step: int | None = Field(None, ge=0)
    """The step that evaluation ran at."""

    @model_validator(mode="after")
    def _steps_consistent(self) -> "ProgressReport":
        if self.start_step is not None and self.start_step > self.step:
            raise ValueError("startStep is after step")
        return self

    def to_log_line(self) -> str:
        """The line as the trainer writes it (one JSON object, no newline; NaN stays NaN)."""
        return json.dumps(self.model_dump(by_alias=True, exclude_none=True))


def parse_progress_line(line: str) -> ProgressReport | None:
    """The progress report in one log line, or None. A prefix before the JSON object (a
    launcher's ``[rank0]:``, a timestamp) is skipped; anything that is not a complete, valid
    progress object (a partial line, another event, garbage) gives None."""
    start = line.find("{")
    if start < 0 or len(line) - start > PROGRESS_LINE_LIMIT or '"progress"' not in line:
        return None
    try:
        data = json.loads(line[start:])
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("event") != PROGRESS_EVENT:
        return None
    try:
        return ProgressReport.model_validate(data)
    except ValidationError:
        return None


def last_progress(text: str) -> ProgressReport | None:
    """The last valid progress report in a log tail (lines may be cut, mixed with other output)."""
    for line in reversed(text.splitlines()):
        report = parse_progress_line(line)
        if report is not None:
            return report
    return None


# ----------------------------------------------- Kubeflow Trainer's trainerStatus
# Kubeflow Trainer v2.2+ (its TrainJobStatus feature gate) takes a status from the training pods
# over HTTPS and writes it to the TrainJob's status.trainerStatus: a percentage, the seconds left
# and up to 256 name/value metrics, each value a string of at most 64 characters. The trainer
# sends its progress report there as metrics named after the report's wire fields; the operator
# reads them back into the same report (progress_from_trainer_status), so one model says what a
# progress report holds however it travels.
TRAINER_STATUS_METRIC_LIMIT = 64
_TRAINER_STATUS_FIELDS = ("time", "attempt", "step", "max_steps", "start_step", "elapsed_seconds", "loss",
                          "learning_rate", "grad_norm", "tokens_per_second", "samples_consumed", "eval_loss",
                          "eval_step", "peak_allocated_bytes", "peak_reserved_bytes", "host_peak_rss_bytes")


def trainer_status_payload(report: ProgressReport, *, remaining_seconds: float | None, updated: str) -> dict[str, Any]:
    """The body the trainer POSTs to Kubeflow Trainer's status endpoint for one progress report.
    `updated` is the report's time as RFC 3339 (the endpoint requires lastUpdatedTime)."""
    metrics = []
    for name in _TRAINER_STATUS_FIELDS:
        value = getattr(report, name)
        if value is None:
            continue
        text = repr(float(value)) if isinstance(value, float) else str(value)  # repr: NaN stays 'nan'
        metrics.append({"name": to_camel(name), "value": text[:TRAINER_STATUS_METRIC_LIMIT]})
    status: dict[str, Any] = {"progressPercentage": min(100, 100 * report.step // report.max_steps),
                              "metrics": metrics, "lastUpdatedTime": updated}
    if remaining_seconds is not None:
        status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, round(remaining_seconds)))
    return {"trainerStatus": status}


def progress_from_trainer_status(trainer_status: Any) -> ProgressReport | None:
    """The progress report in a TrainJob's status.trainerStatus, or None: absent, written by
    something other than this trainer (no step/maxSteps/time metrics), or not a valid report.
    Read as tolerantly as a log line: the pod that wrote it is the tenant's."""
    if not isinstance(trainer_status, dict) or not isinstance(trainer_status.get("metrics"), list):
        return None
    known = {to_camel(name) for name in _TRAINER_STATUS_FIELDS}
    data: dict[str, Any] = {"event": PROGRESS_EVENT}
    for metric in trainer_status["metrics"]:
        if isinstance(metric, dict) and metric.get("name") in known and isinstance(metric.get("value"), str):
            try:
                data[metric["name"]] = json.loads(metric["value"]) if metric["value"] not in ("nan", "inf", "-inf") \
                    else float(metric["value"])
            except ValueError:
                return None
    if not {"time", "step", "maxSteps"} <= data.keys():
        return None
    try:
        return ProgressReport.model_validate(data)
    except ValidationError:
        return None


# ------------------------------------------------------------- success summary


class TrainingFacts(_Contract):
    """What one attempt trained on, for the job's provenance record (finetune_operator.provenance).
    Digests only: the file list with each file's sha256 is in the attempt's record in the output
    (provenance/attempt-N.json), which the termination message's 4 KiB could not hold."""

    base_config_sha256: str | None = Field(None, description="sha256 of the base model's config.json")
    dataset_sha256: str = Field(description="sha256 over every dataset file's name and sha256 (provenance.py)")
    dataset_files: int = Field(ge=1)
    dataset_bytes: int = Field(ge=0)
    records: int = Field(ge=0, description="dataset records read")
    examples: int = Field(ge=0, description="sequences built from them (after packing), held-out ones included")
    held_out: int = Field(0, ge=0, description="of those, held out for evaluation (spec.evaluation)")
    tokens: int = Field(ge=0, description="tokens this attempt trained on, all ranks")
    final_loss: float | None = None
    eval_loss: float | None = Field(None, description="held-out loss at the last evaluation (spec.evaluation)")
    best_eval_step: int | None = Field(None, ge=0, description="the step of the lowest eval loss")
    best_eval_loss: float | None = None
    stopped_early_at: int | None = Field(None, ge=0, description="the step early stopping ended training at")
    output_is_best: bool | None = Field(None, description="keepBest: the output holds the best evaluation's model")
    eval_dataset_sha256: str | None = Field(None, description="sha256 over spec.evaluation.dataset's files, when separate")
    eval_examples: int | None = Field(None, ge=0, description="sequences of that separate evaluation dataset")


class ExportFacts(_Contract):
    """What the export after training wrote (export.py; spec.export merged or full)."""

    kind: Literal["merged", "full"]
    directory: str = Field(description="the folder, in the trainer's file system (the output's mount)")
    shards: int = Field(ge=1)
    total_bytes: int = Field(ge=0, description="the weights' bytes, in the training dtype")
    peak_rss_bytes: int | None = Field(None, ge=0, description="rank 0's resident set during the merge, sampled")
    seconds: float | None = Field(None, ge=0)


class SuccessReport(_Contract):
    """What the trainer writes to the termination message when training finished.

    The operator compares the measured peaks with the plan's prediction and learns a
    correction per (GPU product, model family, method, strategy) from it
    (finetune_operator.calibration). Memory fields are None without CUDA.
    """

    outcome: Literal["Succeeded"] = "Succeeded"
    steps: int = Field(ge=0)
    peak_allocated_bytes: int | None = Field(None, ge=0)
    peak_reserved_bytes: int | None = Field(None, ge=0)
    device_total_bytes: int | None = Field(None, ge=0)
    rank: int = Field(0, ge=0)
    world_size: int | None = Field(None, ge=1)
    attempt: int | None = Field(None, ge=1)
    facts: TrainingFacts | None = None
    export: ExportFacts | None = None

    def to_termination_message(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)


def parse_success_report(text: str | None) -> SuccessReport | None:
    """The success summary in a termination message, or None when it holds anything else."""
    data = _json_object(text)
    if data is None or data.get("outcome") != "Succeeded":
        return None
    try:
        return SuccessReport.model_validate(data)
    except ValidationError:
        return None


def _json_object(text: str | None) -> dict[str, Any] | None:
    if not text or not text.strip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


# --------------------------------------------------------- pre-flight profile
#
# The operator runs `python -m finetune_trainer.profile` in a CPU-only pod for a model whose
# family the analytic memory model does not know. The request goes in as the environment
# variable PROFILE_REQUEST_ENV (compact JSON); the report comes out in the termination message.

PROFILE_REQUEST_ENV = "FINETUNE_PROFILE_REQUEST"
PROFILE_PHASES = ("forward", "backward", "optimizer")


class ProfileSetup(_Contract):
    """One training setup the profile traces: what the trainer would run on `worldSize` GPUs."""

    method: Literal["full", "lora"]
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: Literal["all-linear"] | list[str] = "all-linear"
    # peft's modules_to_save (spec.lora.modulesToSave), trained in fp32 as the trainer trains them;
    # None (left out of the request, for a trainer image that predates it): none.
    lora_modules_to_save: list[str] | None = None
    precision: Literal["bf16", "fp32"] = "bf16"
    attention: Literal["sdpa", "eager"] = "sdpa"
    packing: bool = Field(False, description="examples packed with their boundaries (spec.dataset.packing)")
    sequence_length: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    gradient_checkpointing: bool
    strategy: Literal["ddp", "fsdp"]
    world_size: int = Field(ge=1)

    @property
    def key(self) -> str:
        """Stable and short: the cache key of this setup (with the config's hash)."""
        targets = self.lora_targets if isinstance(self.lora_targets, str) else "+".join(self.lora_targets)
        lora = f"r{self.lora_rank}a{self.lora_alpha:g}d{self.lora_dropout:g}t{targets}" if self.method == "lora" else ""
        if self.method == "lora" and self.lora_modules_to_save:  # without: keys as before, the cache stays valid
            lora += "m" + "+".join(self.lora_modules_to_save)
        return (f"{self.method}{lora}.{self.precision}.{self.attention}.s{self.sequence_length}"
                f".b{self.micro_batch_size}.gc{int(self.gradient_checkpointing)}.{self.strategy}{self.world_size}"
                + (".packed" if self.packing else ""))  # unpacked keys as before: the cache stays valid


class ProfileRequest(_Contract):
    config: dict[str, Any] = Field(description="The model's config.json, as the job gives it")
    model_path: str | None = Field(None, description="The model's directory (only to import its code)")
    trust_remote_code: bool = False
    setups: list[ProfileSetup] = Field(min_length=1)


class ProfileMeasurement(_Contract):
    key: str  # ProfileSetup.key
    peaks: dict[str, int]  # per phase (PROFILE_PHASES), peak allocated bytes of the second step
    trainable_params: int = Field(ge=0)
    ddp_bucket_bytes: int = Field(0, ge=0)  # what DDP's reducer adds on more than one rank
    seconds: float = Field(0.0, ge=0)


class ProfileShape(_Contract):
    """The numbers transformers' config gives (under its standard attribute names)."""

    model_type: str
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    tie_word_embeddings: bool = False


class ProfileReport(_Contract):
    """What the profile pod writes to its termination message: measured peaks per setup, or why not."""

    ok: bool
    error: str = ""  # why the model could not be built or traced (ok false)
    error_field: str = ""  # the job field to blame, when one is (e.g. spec.lora.targetModules)
    shape: ProfileShape | None = None
    params: dict[str, int] = Field(default_factory=dict)  # total, embedding, lmHead (0 when tied), trainable
    measurements: list[ProfileMeasurement] = Field(default_factory=list)

    def to_termination_message(self, limit: int = TERMINATION_MESSAGE_LIMIT) -> str:
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        if len(text.encode()) <= limit:
            return text
        if not self.ok:
            return self.model_copy(update={"error": self.error[: max(0, limit - 400)] + " …[truncated]"}) \
                .model_dump_json(by_alias=True, exclude_none=True)
        raise ValueError(f"profile report of {len(self.measurements)} setups does not fit {limit} bytes; "
                         "profile fewer setups per pod")


def parse_profile_report(text: str | None) -> ProfileReport | None:
    data = _json_object(text)
    if data is None or "ok" not in data:
        return None
    try:
        return ProfileReport.model_validate(data)
    except ValidationError:
        return None
