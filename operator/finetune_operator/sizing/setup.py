"""A fixed training setup: everything that decides per-GPU memory, and nothing left `auto`."""

from __future__ import annotations

from dataclasses import dataclass

from .architecture import ModelArchitecture
from .errors import SizingError

METHODS = ("full", "lora", "qlora")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit")
ATTENTIONS = ("sdpa", "flash", "eager")
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "optimizer+params")


def _choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SizingError(field, f"must be one of {', '.join(allowed)}; got {value!r}")


def _positive(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SizingError(field, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class TrainingSetup:
    """One concrete way of training a model on `world_size` GPUs (enum spellings as in the FineTuneJob API)."""

    architecture: ModelArchitecture
    method: str = "lora"
    lora_rank: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05  # the FineTuneJob API's default; > 0 saves a dropout mask per adapted input
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch_size: int = 1
    sequence_length: int = 2048
    gradient_checkpointing: bool = False
    attention: str = "sdpa"
    strategy: str = "ddp"
    world_size: int = 1
    offload: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, ModelArchitecture):
            raise SizingError("architecture", f"must be a ModelArchitecture, got {type(self.architecture).__name__}")
        _choice("method", self.method, METHODS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("offload", self.offload, OFFLOADS)
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("sequence_length", self.sequence_length)
        _positive("world_size", self.world_size)
        if not isinstance(self.gradient_checkpointing, bool):
            raise SizingError("gradient_checkpointing", f"must be true or false, got {self.gradient_checkpointing!r}")
        if self.method != "full":
            _positive("lora_rank", self.lora_rank)
            if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
                raise SizingError("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
            self.architecture.resolve_lora_targets(self.lora_targets)  # raises on unknown names
        if self.method == "qlora" and self.precision == "fp32":
            raise SizingError("precision", "qlora computes in bf16 or fp16, not fp32")
        # The same rules as the FineTuneJob API (api.ResourcesSpec / FineTuneJobSpec).
        if self.offload != "none" and self.strategy == "ddp":
            raise SizingError("offload", "offload needs a sharded strategy (fsdp, zero1-3); ddp keeps full copies")
        if self.offload == "optimizer+params" and self.strategy in ("zero1", "zero2"):
            raise SizingError("offload", "offloading parameters needs fsdp or zero3")
        if self.offload == "optimizer" and self.strategy == "fsdp":
            raise SizingError("offload", "fsdp offloads parameters together with the optimizer: use optimizer+params")
        if self.method == "qlora" and self.strategy != "ddp":
            raise SizingError("strategy", "qlora runs with strategy ddp: the 4-bit base is replicated")
        if self.optimizer != "adamw" and self.strategy.startswith("zero"):
            raise SizingError("optimizer", "bitsandbytes 8-bit optimizers do not run under DeepSpeed ZeRO; use adamw")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.sequence_length
