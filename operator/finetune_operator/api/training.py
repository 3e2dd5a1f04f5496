"""spec.method, spec.lora, spec.training and spec.resources: what is trained and how, the memory
levers, the strategy and the GPUs; the planner decides what a job leaves `auto`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from finetune_trainer.combinations import OPTIMIZERS, STRATEGIES
from finetune_trainer.memory_levers import LEVERS, AutoOrInt, lever_spec_model

from .errors import field_error
from .schema import (
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_SEQUENCE_LENGTH,
    ApiModel,
    AutoOrMicroBatch,
    AutoOrPositiveInt,
    auto_or_int,
)


Method = Literal["full", "lora", "qlora"]


LoraAdjustableModule = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.\-]+$")]


class LoraSpec(ApiModel):
    """LoRA adapter settings (methods `lora` and `qlora`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!('all-linear' in self.targetModules) || size(self.targetModules) == 1",
                    "message": "targetModules: 'all-linear' stands alone; do not combine it with module names",
                    "fieldPath": ".targetModules",
                },
                {
                    "rule": "!has(self.modulesToSave) || !self.modulesToSave.exists(m, m in self.targetModules)",
                    "message": "modulesToSave: a module is adapted (targetModules) or trained in full, not both",
                    "fieldPath": ".modulesToSave",
                },
            ]
        }
    )

    rank: Annotated[int, Field(ge=1, le=1024)] = 16
    """Rank r of the adapter matrices."""
    alpha: Annotated[float, Field(gt=0, le=100_000)] = 32
    """Scaling numerator: the update is scaled by alpha / rank."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.05
    """Dropout on the adapter input."""
    target_modules: Annotated[list[LoraAdjustableModule], Field(min_length=1, max_length=64)] = ["all-linear"]
    """Modules that get adapters: `[all-linear]` (every linear layer of the blocks, not the output head),
    or module names such as `[q_proj, v_proj]`; the output head (`lm_head`) may be named beside block modules."""
    target_experts: bool = False
    """Also adapt the fused 3-D expert weights of mixture-of-experts layers (peft `target_parameters`),
    which `targetModules` cannot name because they are parameters, not linear layers. Needs a
    mixture-of-experts model (Mixtral, Qwen-MoE)."""

    modules_to_save: Annotated[list[LoraAdjustableModule], Field(max_length=2)] = []
    """Modules trained in full beside the adapters (peft `modules_to_save`), e.g. to train the embeddings of a
    chat template's special tokens: the input embedding and the output head, by the family's module names
    (`embed_tokens`, `lm_head`; Pythia's embedding is `embed_in`). peft trains a copy of each (with tied
    embeddings too) while the original stays frozen; the trainer keeps the copies in fp32 (bf16 under DeepSpeed,
    which keeps fp32 masters), so with AdamW each costs 16 bytes a parameter (Llama 3.1 8B: 8.4 GB each). The
    adapter folder holds the copies; `export: merged` writes them in place of the base's (and unties tied
    embeddings). Strategy ddp, zero1 or zero2."""

    @field_validator("target_modules")
    @classmethod
    def _all_linear_alone(cls, value: list[str]) -> list[str]:
        if "all-linear" in value and len(value) != 1:
            raise ValueError("'all-linear' stands alone; do not combine it with module names")
        return value

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("module names must be unique")
        return value

    @model_validator(mode="after")
    def _saved_or_adapted(self) -> "LoraSpec":
        both = [m for m in self.modules_to_save if m in self.target_modules]
        if both:
            raise field_error("modulesToSave", f"{', '.join(both)}: a module is adapted (targetModules) or trained in "
                                               "full, not both")
        return self


Precision = Literal["bf16", "fp16", "fp32"]
Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]  (finetune_trainer.optimizers: the one list)
Attention = Literal["sdpa", "flash", "eager"]


class _TrainingSpecHead(ApiModel):
    """spec.training's fields before the levers' (TrainingSpec's docstring says what it is)."""

    sequence_length: Annotated[int, Field(ge=16, le=MAX_SEQUENCE_LENGTH)] = 2048
    """Tokens per training sequence (longer examples are truncated)."""
    global_batch_size: Annotated[int, Field(ge=1, le=MAX_GLOBAL_BATCH)] = 32
    """Sequences per optimizer step, over all GPUs: microBatchSize x gradient accumulation x data-parallel size."""
    micro_batch_size: AutoOrMicroBatch = "auto"
    """Sequences per GPU per forward pass; `auto`: the planner picks the largest that fits."""
    max_steps: Annotated[int, Field(ge=1, le=100_000_000)] | None = None
    """Optimizer steps to run. Set this or `epochs`."""
    epochs: Annotated[float, Field(gt=0, le=10_000)] | None = None
    """Passes over the dataset. Set this or `maxSteps`."""
    learning_rate: Annotated[float, Field(gt=0, le=1)] | None = None
    """Peak learning rate; when omitted 2e-4 for lora/qlora and 2e-5 for full fine-tuning."""
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = 0.03
    """Fraction of steps spent warming the learning rate up."""
    precision: Precision = "bf16"
    """Compute precision: `bf16` (Ampere and newer), `fp16`, or `fp32`."""
    optimizer: Optimizer = "adamw"
    """`adamw` (fused torch AdamW), `adamw-8bit` or `paged-adamw-8bit` (bitsandbytes, CUDA only; transformers keeps
    embeddings' states in 32 bits), `torchao-adamw-8bit` or `torchao-adamw-4bit` (torchao's block-wise 8-bit and
    4-bit AdamW, any device; strategy ddp only, and with bf16 master weights nearest or stochastic rounding)."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward to save memory: true or false; omit to let the planner decide."""


def lever_spec_type(declared: Any) -> Any:
    """The pydantic type of a lever's spec field as the registry declares it: its own type, or for
    `AutoOrInt` the API's `auto`-or-integer field (int-or-string with its CEL rule in the CRD)."""
    if isinstance(declared, AutoOrInt):
        return auto_or_int(declared.minimum, declared.maximum, declared.what)
    return declared


# The lever fields (masterWeights ... activationOffloading) come from the registry (each lever's
# `spec`, defaulting to its `auto`), between the head's fields and the rest.
_TrainingSpecLevers = lever_spec_model(_TrainingSpecHead, LEVERS, lever_spec_type)


class TrainingSpec(_TrainingSpecLevers):
    """Training hyper-parameters. The global batch is kept exact whatever the plan."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.maxSteps) != has(self.epochs)",
                    "message": "set exactly one of maxSteps, epochs",
                },
                {
                    "rule": "!has(self.microBatchSize) || type(self.microBatchSize) == string || "
                    "self.globalBatchSize % int(self.microBatchSize) == 0",
                    "message": "globalBatchSize must be a multiple of microBatchSize",
                    "fieldPath": ".globalBatchSize",
                },
            ]
        }
    )

    attention: Attention = "sdpa"
    """Attention kernel: `sdpa` (PyTorch), `flash` (flash-attention 2), `eager` (keeps the s x s scores)."""
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] = 42
    """Random seed of the run: the sample order, the LoRA adapters' initial weights, dropout and stochastic
    rounding. The same spec on the same software gives the same loss curve (checked on the CPU; GPU kernels
    may differ in the last digits)."""

    @model_validator(mode="after")
    def _steps_and_batch(self) -> "TrainingSpec":
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of maxSteps, epochs")
        if isinstance(self.micro_batch_size, int) and self.global_batch_size % self.micro_batch_size:
            raise field_error(
                "globalBatchSize",
                f"must be a multiple of microBatchSize ({self.micro_batch_size}); got {self.global_batch_size}",
            )
        return self


Strategy = Literal[("auto", *STRATEGIES)]  # type: ignore[valid-type]  (combinations.STRATEGIES: the one list)
Offload = Literal["auto", "none", "optimizer", "optimizer+params"]
GpuType = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9.\-_]*$")]


class ResourcesSpec(ApiModel):
    """GPUs and how the model is spread over them. `auto` fields are searched by the planner."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "type(self.gpus) == string || self.maxGPUs >= int(self.gpus)",
                    "message": "maxGPUs must be at least gpus",
                    "fieldPath": ".maxGPUs",
                },
            ]
        }
    )

    gpus: AutoOrPositiveInt = "auto"
    """Total GPUs; `auto`: the planner picks the cheapest count that fits."""
    max_gpus: Annotated[int, Field(ge=1, le=MAX_GPUS, alias="maxGPUs")] = 8
    """Upper bound for `gpus: auto` and for recovery."""
    strategy: Strategy = "auto"
    """`ddp`, `fsdp` (full shard), DeepSpeed `zero1`, `zero2`, `zero3`, or `auto`."""
    offload: Offload = "auto"
    """Move optimizer states (and parameters) to host memory: `none`, `optimizer`, `optimizer+params`, or `auto`."""
    gpu_types: Annotated[list[GpuType], Field(max_length=32)] = []
    """GPU types allowed, e.g. `[H100-80GB, A100-80GB]`; empty means any."""
    node_pool: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^(auto|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$")] = "auto"
    """Node pool to use, or `auto`."""
    memory_headroom: Annotated[float, Field(ge=0, le=0.5)] | None = None
    """Fraction of GPU memory the plan leaves free (0.10 plans to at most 90%); the cluster policy's default when omitted."""

    @model_validator(mode="after")
    def _consistent(self) -> "ResourcesSpec":
        if isinstance(self.gpus, int) and self.max_gpus < self.gpus:
            raise field_error("maxGPUs", f"must be at least gpus ({self.gpus}); got {self.max_gpus}")
        return self
