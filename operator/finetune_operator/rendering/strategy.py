"""The strategy block of the trainer config: a complete DeepSpeed config, or the FSDP settings.

The DeepSpeed config starts from the contract's `deepspeed_config` (the shape the trainer
accepts) and fills every "auto" with the plan's concrete numbers. A concrete config is one
DeepSpeed's own parser can check as it stands (tests do), and one a person can read in the
ConfigMap; the transformers Trainer accepts concrete values as long as they agree with its
arguments, which the trainer builds from the same TrainerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune_trainer.contract import ZERO_STAGE, FsdpSettings, deepspeed_config

from .errors import RenderError

# AdamW's betas and epsilon: the torch and transformers defaults, stated once so the
# DeepSpeed optimizer block and the trainer's own AdamW agree.
ADAM_BETAS = (0.9, 0.999)
ADAM_EPSILON = 1e-8


@dataclass(frozen=True)
class BatchSettings:
    """What the DeepSpeed config repeats from the trainer config; they must agree."""

    micro_batch_size: int
    gradient_accumulation: int
    data_parallel_size: int
    precision: str
    optimizer: str
    learning_rate: float
    weight_decay: float
    max_grad_norm: float


def build_deepspeed_config(strategy: str, offload: str, batch: BatchSettings) -> dict[str, Any]:
    """A complete DeepSpeed config for `strategy` zero1/zero2/zero3 with `offload`."""
    stage = ZERO_STAGE.get(strategy)
    if stage is None:
        raise RenderError("plan.strategy", f"{strategy!r} is not a DeepSpeed ZeRO strategy")
    try:
        config = deepspeed_config(stage, offload)
    except ValueError as error:
        raise RenderError("plan.offload", str(error)) from None
    config["train_micro_batch_size_per_gpu"] = batch.micro_batch_size
    config["gradient_accumulation_steps"] = batch.gradient_accumulation
    config["train_batch_size"] = batch.micro_batch_size * batch.gradient_accumulation * batch.data_parallel_size
    config["gradient_clipping"] = batch.max_grad_norm
    config["bf16"] = {"enabled": batch.precision == "bf16"}
    config["fp16"] = {"enabled": batch.precision == "fp16"}
    if offload != "none":
        # ZeRO-Offload steps the optimizer on the CPU. DeepSpeed refuses a client (torch)
        # optimizer there, so the config names its own AdamW, which it runs as DeepSpeedCPUAdam.
        if batch.optimizer != "adamw":
            raise RenderError(
                "plan.optimizer",
                f"{batch.optimizer} cannot step offloaded optimizer states (DeepSpeed steps them with its own"
                " CPU AdamW); offload needs adamw",
            )
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": batch.learning_rate,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPSILON,
                "weight_decay": batch.weight_decay,
            },
        }
    return config


def build_fsdp_settings(offload: str) -> FsdpSettings:
    """Full shard over all ranks with the model's own FSDP plan (the contract's defaults).

    The trainer reads the offload from the config's `offload`; FSDP moves parameters,
    gradients and optimizer states to the host together, so only `none` and
    `optimizer+params` exist for it.
    """
    if offload == "optimizer":
        raise RenderError("plan.offload", "FSDP offloads parameters and optimizer together; use optimizer+params")
    return FsdpSettings()
