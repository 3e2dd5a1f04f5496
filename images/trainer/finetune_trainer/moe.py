"""LoRA on mixture-of-experts weights (``lora.targetExperts``).

Current transformers (5.x) store the experts of Mixtral, Qwen2-MoE, Qwen3-MoE and
others as fused 3-D parameters (``experts.gate_up_proj``: experts x 2*intermediate x
hidden, ``experts.down_proj``: experts x hidden x intermediate) instead of one Linear per
expert, so a list of ``target_modules`` never reaches them: only attention, shared experts
and the router are adapted. (peft 0.21 turns ``"all-linear"`` on such a model into expert
``target_parameters`` by itself, so there the experts are adapted whatever
``targetExperts`` says.) peft adapts parameters directly
with ``target_parameters`` (its ``ParamWrapper``: one LoRA pair per parameter, rank
``r`` per expert). ``expert_parameter_targets`` finds those parameters by shape and
place (3-D, inside a module whose name ends in ``experts``), so no per-family table is
needed.

LoRA dropout: peft's ParamWrapper adds B@A to the weight (it cannot factor the input
out of ``B(A(dropout(x)))``), so it refuses ``lora_dropout > 0`` with a ValueError for the
whole config. This trainer builds the adapters with dropout 0 and then gives the
Linear-module adapters (attention, router, shared experts) their ``nn.Dropout``; the
expert adapters train without dropout. The levers line at startup says so. The saved
adapter_config.json records dropout 0 (dropout matters only in training, and peft
would refuse to load the adapter otherwise).
"""

from __future__ import annotations

from torch import nn


def expert_parameter_targets(model: nn.Module) -> list[str]:
    """peft ``target_parameters`` names (suffix-matched) of fused 3-D expert weights."""
    names = set()
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if not leaf.endswith("experts"):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.dim() == 3:
                names.add(f"{leaf}.{param_name}")
    return sorted(names)


def restore_linear_dropout(model: nn.Module, adapter: str, dropout: float) -> int:
    """Give every Linear-module LoRA layer (not peft's ParamWrapper, which cannot have
    one) the dropout peft was asked to leave out. Returns how many got it."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper) \
                and adapter in getattr(module, "lora_dropout", {}):
            module.lora_dropout[adapter] = nn.Dropout(p=dropout)
            count += 1
    return count


def has_fused_experts(model: nn.Module) -> bool:
    return bool(expert_parameter_targets(model))


__all__ = ["expert_parameter_targets", "restore_linear_dropout", "has_fused_experts"]
