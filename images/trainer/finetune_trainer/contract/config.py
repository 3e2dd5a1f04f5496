"""What goes in: `TrainerConfig`, which the renderer serialises (camelCase JSON) into a ConfigMap
mounted at `/etc/finetune/config.json`, and its loading in the pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..combinations import (
    EXPORTS,
    OPTIMIZERS,
    STRATEGIES,
    Choices,
    describe,
    violations,
)
from ..memory_levers import LEVERS, attention_refusal, choice_values, lever_fields_model
from .base import Contract, DEFAULT_CONFIG_PATH, DEFAULT_REPORT_PATH
from .deepspeed import check_deepspeed


# --------------------------------------------------------------------------- input


class ModelSource(Contract):
    path: str = Field(min_length=1, description="Local directory with config.json and weights")
    tokenizer_path: str | None = Field(None, description="Defaults to the model path")
    trust_remote_code: bool = False


# How many values spec.dataset.microBatchTokens may hold (the API's maxItems); the trainer prints as many.
MICRO_BATCH_TOKENS_COUNT = 64


class DatasetSource(Contract):
    """A JSONL file (or a directory of ``*.jsonl`` files).

    Line formats: ``chat`` -> ``{"messages": [{"role": ..., "content": ...}, ...]}``
    rendered with the tokenizer's chat template; ``instruction`` ->
    ``{"instruction": ..., "input": optional, "response" | "output": ...}``;
    ``text`` -> ``{"text": ...}``.
    """

    path: str = Field(min_length=1)
    format: Literal["chat", "instruction", "text"] = "chat"
    packing: bool = False
    # A micro-batch's examples end to end in one row (spec.dataset.paddingFree).
    padding_free: bool = False
    # What the plan was sized for (spec.dataset.microBatchTokens): checked against the data at start.
    micro_batch_tokens: list[int] | None = Field(None, min_length=1, max_length=MICRO_BATCH_TOKENS_COUNT)

    @model_validator(mode="after")
    def _one_batching(self) -> "DatasetSource":
        if self.packing and self.padding_free:
            raise ValueError("dataset: set at most one of packing, padding_free")
        return self


class LoraSettings(Contract):
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


class FsdpSettings(Contract):
    """FSDP2 as transformers applies it at load time (``DistributedConfig``).

    Always full-shard over all ranks; under bf16 the mixed-precision policy is
    param_dtype=bf16, reduce_dtype=fp32 (see notes/trainer_settings.md); parameters go
    to the host when ``offload`` is "optimizer+params". ``plan`` overrides the model's
    own FSDP plan per module pattern (transformers' ``fsdp_plan``).
    """

    plan: dict[str, Literal["free_full_weight", "keep_full_weight"]] = Field(default_factory=dict)


class CheckpointSettings(Contract):
    directory: str = Field(min_length=1)
    every_steps: int = Field(200, ge=1)
    keep_last: int = Field(2, ge=1)


class EarlyStopping(Contract):
    """Stop once `patience` evaluations in a row improved the best eval loss by no more than `min_delta`."""

    patience: int = Field(ge=1)
    min_delta: float = Field(0.0, ge=0)


class EvaluationSettings(Contract):
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


class FaultInjection(Contract):
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


class _TrainerConfigHead(Contract):
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
            check_deepspeed(self.deepspeed, stage, self.offload)
        # What combines with what lives in one place (combinations.py), asked by the API,
        # the memory model and the planner as well.
        problems = violations(self.choices())
        if problems:
            raise ValueError(describe(problems))
        refusal = attention_refusal(self.sequence_parallel, self.attention,
                                    self.dataset.packing or self.dataset.padding_free)
        if refusal:
            raise ValueError(f"sequenceParallel: {refusal}")
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
