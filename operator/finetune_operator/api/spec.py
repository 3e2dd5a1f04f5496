"""spec: FineTuneJobSpec, its smaller sections (dataset, placement, recovery, checkpoint,
evaluation) and the rules across sections: what may change after creation and which choices
combine, as CEL for the API server and as the same checks in pydantic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from finetune_trainer.combinations import EXPORTS, Choices, cel_rules, first_violation
from finetune_trainer.contract import MICRO_BATCH_TOKENS_COUNT
from finetune_trainer.memory_levers import attention_refusal, choice_values, config_fields, derived_choices, ladder

from .errors import FieldError, field_error
from .model import ModelSpec
from .schema import LABEL_VALUE, ApiModel
from .sources import DataSource, OutputSpec, PvcTarget
from .training import LoraSpec, Method, ResourcesSpec, TrainingSpec


class DatasetSpec(ApiModel):
    """The training data: JSON lines."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!(has(self.packing) && self.packing && has(self.paddingFree) && self.paddingFree)",
                 "message": "set at most one of packing, paddingFree (packed sequences are padding-free already)",
                 "fieldPath": ".paddingFree"},
                {"rule": "!(has(self.packing) && self.packing && has(self.microBatchTokens))",
                 "message": "microBatchTokens sizes unpacked examples; packed sequences are sequenceLength long",
                 "fieldPath": ".microBatchTokens"},
                {"rule": "!has(self.microBatchTokens) || self.microBatchTokens.isSorted()",
                 "message": "microBatchTokens must not decrease (b + 1 consecutive examples hold at least what b do)",
                 "fieldPath": ".microBatchTokens"},
            ]
        }
    )

    source: DataSource
    """Where the JSONL data is."""
    format: Literal["chat", "instruction", "text"] = "chat"
    """`chat`: {"messages": [{"role", "content"}...]} rendered with the tokenizer's chat template;
    `instruction`: {"instruction", "input"?, "output"}; `text`: {"text"}."""
    packing: bool = False
    """Pack whole examples (each cut to `sequenceLength`) into sequences of at most `sequenceLength`
    tokens, best fit. Their boundaries are kept: positions restart at each example and attention never
    crosses one (sdpa and eager: a block-diagonal mask, sized by the planner; flash: its
    variable-length kernel, no mask)."""
    padding_free: bool = False
    """Unpacked examples without padding: each micro-batch's examples are laid end to end in one row,
    positions restarting at each and attention never crossing one, so the model sees only their real
    tokens (as TRL's `padding_free`). A step still trains on the same examples as padded batches. It
    saves memory with `training.attention: flash` (its variable-length kernel); under sdpa and eager
    the row gets a block-diagonal mask of (its tokens)^2, which the planner sizes and which outgrows
    padding's saving for long rows. The planner sizes the row from `microBatchTokens`. Not with `packing`
    (packed sequences are padding-free already)."""
    micro_batch_tokens: Annotated[list[Annotated[int, Field(ge=1)]],
                                  Field(min_length=1, max_length=MICRO_BATCH_TOKENS_COUNT)] | None = None
    """What the data holds, for the planner to size micro-batches by: the i-th value is the most tokens
    that any i consecutive examples of the job's sample order hold (each cut to `sequenceLength`), so
    the first is the longest example. `python -m finetune_trainer.dataset_stats` prints it for a job and
    its data. The planner sizes a padded micro-batch of b rows by the first value and a padding-free one
    (one row) by the b-th (past the list: the last plus the longest example per further example).
    Omitted: any example may be `sequenceLength` long. The sample order depends on the data, the
    tokenizer, `training.seed`, `sequenceLength`, `globalBatchSize`, `maxSteps` or `epochs` and
    `evaluation.heldOutFraction`: the trainer checks the values against the data before it loads the
    model and, where the data holds more, fails the job with a DataError naming this field and the
    right values. Not with `packing` (packed sequences are `sequenceLength` long)."""

    @model_validator(mode="after")
    def _one_batching(self) -> "DatasetSpec":
        if self.packing and self.padding_free:
            raise FieldError("paddingFree", "set at most one of packing, paddingFree (packed sequences are "
                                            "padding-free already)")
        if self.packing and self.micro_batch_tokens is not None:
            raise FieldError("microBatchTokens", "sizes unpacked examples; packed sequences are sequenceLength long")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens != sorted(self.micro_batch_tokens):
            raise FieldError("microBatchTokens", "must not decrease (b + 1 consecutive examples hold at least what b do)")
        return self


Region = Annotated[str, Field(min_length=1, max_length=63, pattern=LABEL_VALUE)]


class PlacementSpec(ApiModel):
    """Where the job may run. A hard constraint: pods never land outside these regions."""

    regions: Annotated[list[Region], Field(min_length=1, max_length=32)]
    """Regions the job may use (values of the cluster's region label); narrowed further by the cluster policy."""

    @field_validator("regions")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("regions must be unique")
        return value


# The recovery ladder (recovery/adjust.py climbs it in this order; hostMemory is the host-OOM
# remedy), with each memory lever's rung placed after the rung it names (memory_levers.ladder).
ADJUSTMENTS: tuple[str, ...] = ladder(
    ("gradientCheckpointing", "microBatch", "sharding", "optimizer8bit", "offload", "moreGPUs", "hostMemory", "method"))
Adjustment = Literal[ADJUSTMENTS]  # type: ignore[valid-type]
# Every adjustment but `method` (switching to QLoRA changes what is trained: only when listed).
DEFAULT_ADJUSTMENTS: list[str] = [name for name in ADJUSTMENTS if name != "method"]


class BackoffSpec(ApiModel):
    """Wait before attempt N+1: initialSeconds x 2^(N-1), capped at maxSeconds."""

    initial_seconds: Annotated[int, Field(ge=0, le=86_400)] = 10
    """Wait before the second attempt."""
    max_seconds: Annotated[int, Field(ge=0, le=86_400)] = 600
    """Longest wait between attempts."""


class RecoverySpec(ApiModel):
    """What the operator may change by itself when an attempt runs out of memory."""

    max_attempts: Annotated[int, Field(ge=1, le=20)] | None = None
    """Attempts in all, the first included; 1 turns recovery off. The cluster policy's default (4 unless changed) when omitted."""
    allowed_adjustments: Annotated[list[Adjustment], Field(max_length=len(ADJUSTMENTS))] = list(DEFAULT_ADJUSTMENTS)
    """Changes recovery may make. `method` (switch to QLoRA) is off unless listed. `masterWeights` and
    `optimizerInBackward` change only what the job leaves `auto`/unset: an explicit value is kept."""
    backoff: BackoffSpec = BackoffSpec()
    """Exponential backoff between attempts."""

    @field_validator("allowed_adjustments")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("adjustments must be unique")
        return value


class CheckpointSpec(ApiModel):
    """Checkpoints, so that a recovered attempt resumes instead of starting over."""

    pvc: PvcTarget
    """Volume for checkpoints (ReadWriteMany when the plan spans nodes). Mounted read-write."""
    every_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 200
    """Save every N optimizer steps."""
    keep_last: Annotated[int, Field(ge=1, le=100)] = 2
    """Checkpoints to keep."""


Export = Literal[EXPORTS]  # type: ignore[valid-type]  (combinations.EXPORTS: the one list)


def _immutable(field: str, optional: bool) -> dict[str, str]:
    """A CEL transition rule: `field` cannot change once the job exists."""
    if optional:
        rule = f"has(self.{field}) == has(oldSelf.{field}) && (!has(self.{field}) || self.{field} == oldSelf.{field})"
    else:
        rule = f"self.{field} == oldSelf.{field}"
    return {
        "rule": rule,
        "message": f"{field} is immutable: create a new FineTuneJob to change it (only suspend, recovery and resources may change)",
        "fieldPath": f".{field}",
    }


# After creation only `suspend`, `recovery` and `resources` (which apply to the next plan) may change.
# Changing the model, data or hyper-parameters under a running job would make its checkpoints
# meaningless; changing placement could move a running job's data out of its regions.
IMMUTABLE_FIELDS: list[tuple[str, bool]] = [
    ("model", False),
    ("dataset", False),
    ("method", False),
    ("training", False),
    ("placement", False),
    ("lora", True),
    ("checkpoint", True),
    ("evaluation", True),
    ("output", True),
    ("export", True),
    ("image", True),
    ("queueName", True),
]


# Where each choice of combinations.Choices lives in the spec (below `spec`), for CEL and error paths.
CHOICE_PATHS: dict[str, str] = {
    "method": "method",
    "strategy": "resources.strategy",
    "offload": "resources.offload",
    "optimizer": "training.optimizer",
    "precision": "training.precision",
    "gradient_checkpointing": "training.gradientCheckpointing",
    "target_experts": "lora.targetExperts",
    "export": "export",
    **{choice: f"training.{field}" for choice, field in config_fields().items()},
}

# Choices that say whether a list of the spec is non-empty, and that list's path (for CEL).
LISTED_CHOICES: dict[str, str] = {"modules_to_save": "lora.modulesToSave"}


def _fixed(value: Any) -> Any:
    return None if value == "auto" else value


def spec_choices(spec: "FineTuneJobSpec") -> Choices:
    """The choices a spec fixes (`auto` and unset ones are None: the planner decides them)."""
    training, resources = spec.training, spec.resources
    micro, gpus = training.micro_batch_size, resources.gpus
    accumulation = None
    # The GPUs that split one sequence run its micro-batches together: accumulation is that many times
    # more. Left to the planner, 1: the least it can be, which the rules on accumulation (at least) need.
    split = training.sequence_parallel if isinstance(training.sequence_parallel, int) else 1
    if isinstance(micro, int) and isinstance(gpus, int) and training.global_batch_size % (micro * gpus) == 0:
        accumulation = training.global_batch_size * split // (micro * gpus)
    return Choices(
        method=spec.method,
        strategy=_fixed(resources.strategy),
        offload=_fixed(resources.offload),
        optimizer=training.optimizer,
        precision=training.precision,
        gradient_accumulation=accumulation,
        gradient_checkpointing=training.gradient_checkpointing,
        target_experts=spec.lora.target_experts if spec.lora is not None else None,
        modules_to_save=bool(spec.lora.modules_to_save) if spec.lora is not None else None,
        export=spec.export,
        **choice_values(training, auto_is_none=True),
    )


class EarlyStoppingSpec(ApiModel):
    """Stop training once the eval loss stops improving."""

    patience: Annotated[int, Field(ge=1, le=1000)]
    """Evaluations in a row that may pass without improving the best eval loss; the next step does not run."""
    min_delta: Annotated[float, Field(ge=0)] = 0.0
    """An improvement counts only when the eval loss falls by more than this."""


class EvaluationSpec(ApiModel):
    """Evaluation while it trains: the loss on data the run does not train on."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.heldOutFraction) != has(self.dataset)",
                 "message": "set exactly one of heldOutFraction, dataset"},
                {"rule": "!has(self.earlyStopping) || has(self.everySteps)",
                 "message": "earlyStopping needs everySteps (without it the only evaluation is at the end)",
                 "fieldPath": ".earlyStopping"},
            ]
        }
    )

    held_out_fraction: Annotated[float, Field(gt=0, le=0.5)] | None = None
    """The fraction of the dataset's sequences (after packing) kept out of training and evaluated on,
    chosen by `training.seed` alone, so every attempt, resumed or not, evaluates on the same ones. A
    fraction that leaves no sequence on either side fails the job with a DataError naming this field."""
    dataset: DataSource | None = None
    """A separate evaluation dataset (`pvc` or `s3`, like spec.dataset.source), read in the training
    dataset's `format` and `packing`; all of it is evaluated on, and training uses all of spec.dataset.
    In object storage it is fetched before training by a `fetch-eval` init container (so it runs as a
    PyTorchJob), and its endpoint narrows the regions as the training data's does. A dataset that
    does not exist or holds no example fails the job with a DataError naming this field."""
    every_steps: Annotated[int, Field(ge=1)] | None = None
    """Evaluate every this many optimizer steps; always at the end. Omitted: only at the end."""
    micro_batch_size: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Sequences per GPU per evaluation forward (no gradients, so often larger than training's). The
    planner sizes it: a plan is chosen only where it fits beside the setup's resident memory.
    Omitted: the plan's training micro-batch."""
    early_stopping: EarlyStoppingSpec | None = None
    """Stop once `patience` evaluations in a row did not improve the best eval loss by more than
    `minDelta`; the count carries over a resumed attempt. Needs everySteps."""
    keep_best: bool = False
    """The output is the model of the evaluation with the lowest eval loss (kept beside the
    checkpoints as training goes), not the last step's. Needs spec.checkpoint."""

    @model_validator(mode="after")
    def _one_source(self) -> "EvaluationSpec":
        if (self.held_out_fraction is None) == (self.dataset is None):
            raise FieldError("heldOutFraction", "set exactly one of heldOutFraction, dataset")
        if self.early_stopping is not None and self.every_steps is None:
            raise FieldError("earlyStopping", "needs everySteps (without it the only evaluation is at the end)")
        return self


class FineTuneJobSpec(ApiModel):
    """What to fine-tune, on what data, how, and where it may run."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [_immutable(f, optional) for f, optional in IMMUTABLE_FIELDS]
            + [
                {
                    "rule": "self.method == 'full' ? !has(self.lora) : has(self.lora)",
                    "message": "lora is required for methods lora and qlora, and not allowed for full",
                    "fieldPath": ".lora",
                },
                {
                    "rule": "!has(self.evaluation) || !has(self.evaluation.keepBest) || !self.evaluation.keepBest"
                    " || has(self.checkpoint)",
                    "message": "evaluation.keepBest needs checkpoint (the best model is kept beside the checkpoints)",
                    "fieldPath": ".evaluation.keepBest",
                },
                {
                    "rule": "!has(self.training) || !has(self.training.microBatchSize) || "
                    "type(self.training.microBatchSize) == string || !has(self.resources) || "
                    "!has(self.resources.gpus) || type(self.resources.gpus) == string || "
                    "self.training.globalBatchSize % (int(self.training.microBatchSize) * int(self.resources.gpus)) == 0",
                    "message": "globalBatchSize must be a multiple of microBatchSize x gpus",
                    "fieldPath": ".training.globalBatchSize",
                },
            ]
            # What combines with what (strategy, offload, optimizer, precision, the levers): generated
            # from the one table the validators below, the planner and the trainer also read. A choice
            # that follows from a field (chunked_loss: lossChunks > 1) has no values of its own there:
            # its rules stay with the validator.
            + cel_rules({choice: path for choice, path in CHOICE_PATHS.items() if choice not in derived_choices()},
                        listed=LISTED_CHOICES)
        }
    )

    model: ModelSpec
    """The model to fine-tune."""
    dataset: DatasetSpec
    """The training data."""
    method: Method
    """`full` (all weights), `lora` (adapters on a frozen base), `qlora` (adapters on a 4-bit base, CUDA only)."""
    lora: LoraSpec | None = None
    """Adapter settings; required for lora and qlora."""
    training: TrainingSpec
    """Hyper-parameters."""
    resources: ResourcesSpec = ResourcesSpec()
    """GPUs and strategy."""
    placement: PlacementSpec
    """Allowed regions (data sovereignty)."""
    recovery: RecoverySpec = RecoverySpec()
    """Self-healing on out-of-memory failures."""
    checkpoint: CheckpointSpec | None = None
    """Checkpoints; without them a recovered attempt starts from step 0."""
    evaluation: EvaluationSpec | None = None
    """Evaluation on a held-out part of the dataset while it trains (eval loss in status.progress)."""
    output: OutputSpec | None = None
    """Where the result goes; the checkpoint volume's `final/` folder when omitted."""
    export: Export | None = None
    """What the job leaves in its output once training succeeded, for a serving stack (vLLM, TGI, KServe's
    Hugging Face runtime) to load as is. `adapter`: the LoRA adapter as trained (the default for lora and
    qlora). `merged` (lora and qlora only): also `merged/`, the base with the adapter merged into it; for qlora
    into the dequantised 4-bit base it trained against. `full` (method full only, its default): also `full/`,
    the fine-tuned weights. Both folders hold safetensors shards of at most 2 GiB in the training precision with
    their index, config.json, generation_config.json and the tokenizer; rank 0 writes them on the CPU after
    training, and the pod's memory request covers it. A merge that fails leaves the adapter and fails the job
    (ConfigError). No GGUF."""
    image: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\s]+$")] | None = None
    """Trainer image override; the cluster's default trainer image when omitted."""
    queue_name: Annotated[str, Field(min_length=1, max_length=63, pattern=LABEL_VALUE)] | None = None
    """Kueue LocalQueue; set as the `kueue.x-k8s.io/queue-name` label on the PyTorchJob."""
    suspend: bool = False
    """Suspend the job: no pods run until it is set back to false."""

    @model_validator(mode="after")
    def _cross_field(self) -> "FineTuneJobSpec":
        if self.evaluation is not None and self.evaluation.keep_best and self.checkpoint is None:
            raise field_error("evaluation.keepBest", "needs checkpoint (the best model is kept beside the checkpoints)")
        if self.method == "full" and self.lora is not None:
            raise field_error("lora", "not allowed with method full (remove it, or use method lora)")
        if self.method in ("lora", "qlora") and self.lora is None:
            raise field_error("lora", f"required for method {self.method} (e.g. lora: {{rank: 16}})")
        problem = first_violation(spec_choices(self))
        if problem is not None:
            raise field_error(CHOICE_PATHS[problem.field], problem.message)
        refusal = attention_refusal(self.training.sequence_parallel, self.training.attention,
                                    self.dataset.packing or self.dataset.padding_free)
        if refusal is not None:
            raise field_error("training.sequenceParallel", refusal)
        split, gpus = self.training.sequence_parallel, self.resources.gpus
        if isinstance(split, int) and isinstance(gpus, int) and gpus % split:
            raise field_error("training.sequenceParallel", f"{split} GPUs per sequence do not divide gpus {gpus}")
        micro, gpus = self.training.micro_batch_size, self.resources.gpus
        if isinstance(micro, int) and isinstance(gpus, int) and self.training.global_batch_size % (micro * gpus):
            raise field_error(
                "training.globalBatchSize",
                f"must be a multiple of microBatchSize x gpus ({micro} x {gpus} = {micro * gpus});"
                f" got {self.training.global_batch_size}",
            )
        return self
