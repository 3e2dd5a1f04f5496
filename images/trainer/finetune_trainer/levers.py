"""The lean-trainer levers of one attempt: what is on, in one startup line, and the
check that needs the model (the rules between fields live in combinations.py and are
applied when the config is read; each lever's facts are one object in memory_levers/).

The levers (TrainerConfig fields) and the other memory settings the line names:

* ``masterWeights`` bf16: full fine-tuning with bf16 weights, gradients and AdamW
  moments (bf16_adamw.py), ``updateRounding`` nearest/stochastic/kahan;
* ``optimizerInBackward``: per-parameter optimizer steps inside backward
  (optimizer_in_backward.py);
* ``lossChunks`` > 1: chunked cross-entropy (chunked_loss.py);
* ``activationOffloading``: checkpointed activations in host memory (activation_offload.py);
* QLoRA under ``strategy: fsdp``: the 4-bit base sharded (model_setup.py, fsdp_setup);
* ``lora.targetExperts``: LoRA on fused 3-D expert weights (moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import optimizers
from .contract import TrainerConfig
from .errors import ConfigError
from .memory_levers import Levers, camel, config_fields, levers_of


@dataclass(frozen=True)
class StartupLevers:
    """What the attempt's startup line says about memory: the levers and the settings beside them."""

    levers: Levers
    method: str
    optimizer: str
    gradient_checkpointing: bool
    target_experts: bool
    qlora_fsdp: bool
    cpu_offload: bool

    @classmethod
    def of(cls, cfg: TrainerConfig) -> "StartupLevers":
        return cls(
            levers=levers_of(cfg),
            method=cfg.method,
            optimizer=cfg.optimizer,
            gradient_checkpointing=cfg.gradient_checkpointing,
            target_experts=cfg.method != "full" and cfg.lora.target_experts,
            qlora_fsdp=cfg.method == "qlora" and cfg.strategy == "fsdp",
            cpu_offload=cfg.offload != "none",
        )

    @property
    def bf16_master(self) -> bool:
        return self.method == "full" and self.levers.master_weights == "bf16"

    @property
    def optimizer_in_backward(self) -> bool:
        return self.levers.optimizer_in_backward

    @property
    def custom_optimizer(self) -> bool:
        """Whether the trainer builds the optimizer itself instead of the Trainer's default (which
        builds only the optimizers that name a `trainer_optim`, optimizers.py)."""
        return (self.optimizer_in_backward or (self.bf16_master and self.optimizer == "adamw")
                or optimizers.kind(self.optimizer).trainer_optim is None)

    def fields(self) -> dict:
        """The startup line's fields (camelCase, as in the config): every lever's (the registry's),
        then the settings beside them."""
        line = {camel(field): value for field, value in self.levers.setup_fields().items()}
        # Adapters always train in fp32; the rounding applies to bf16 master weights only.
        line["masterWeights"] = self.levers.master_weights if self.method == "full" else "fp32 (adapters)"
        line["updateRounding"] = self.levers.update_rounding if self.bf16_master else None
        return {**line, "optimizer": self.optimizer, "gradientCheckpointing": self.gradient_checkpointing,
                "loraTargetExperts": self.target_experts, "qloraSharded": self.qlora_fsdp,
                "offload": self.cpu_offload}


def check_model(cfg: TrainerConfig, model) -> None:
    """Checks that need the loaded model (before adapters): MoE experts for targetExperts."""
    from . import combinations
    from .moe import has_fused_experts

    if cfg.method == "full":
        return
    moe = has_fused_experts(model)
    problems = combinations.violations(cfg.choices().but(moe=moe))
    if problems:
        raise ConfigError("; ".join(f"{CONFIG_FIELD.get(p.field, p.field)}: {p.message}" for p in problems))


# combinations.py's field names as the config spells them.
CONFIG_FIELD = {"target_experts": "lora.targetExperts", **config_fields()}
