"""How a setup stores its tensors: the dtypes of the compute, the residual stream and the MLP,
and whether weights, adapters or a 4-bit base train. Derived once per estimate from the
setup; the state, activation and sharding terms all read it."""

from __future__ import annotations

from dataclasses import dataclass

from .setup import TrainingSetup


@dataclass(frozen=True)
class Regime:
    """How tensors are stored in this setup (derived once from the setup)."""

    compute: int  # bytes of the compute dtype (bf16/fp16: 2, fp32: 4)
    residual: int  # bytes of the residual stream between blocks
    autocast_fp32_weights: bool  # fp32 weights cast per op by autocast (full FT without FSDP/ZeRO)
    weights_trainable: bool  # full fine-tuning
    lora: bool
    qlora: bool
    mlp: int  # bytes of the MLP's intermediate tensors
    master_bf16: bool  # full FT with bf16 weights, gradients and optimizer states (no fp32 copy)


def regime_of(setup: TrainingSetup) -> Regime:
    compute = 4 if setup.precision == "fp32" else 2
    full = setup.method == "full"
    qlora = setup.method == "qlora"
    master_bf16 = full and setup.master_weights == "bf16"
    # Full FT keeps fp32 weights; without FSDP/ZeRO the forward runs them under
    # autocast, so embeddings (not autocast) and the residual stream stay fp32. With bf16
    # master weights the model simply is bf16: no autocast, no copies.
    # QLoRA under DDP: peft's prepare_model_for_kbit_training casts everything not quantised
    # (embeddings, norms, head) to fp32, and bitsandbytes returns its outputs in the
    # input's dtype, so the residual stream and the MLP's tensors are fp32 as well. Under
    # FSDP (fsdp_qlora) the rest stays in the compute dtype: FSDP shards one dtype per group;
    # under ZeRO-3 too (the trainer skips that cast of partitioned parameters, as TRL does).
    autocast_fp32 = full and setup.strategy == "ddp" and compute == 2 and not master_bf16
    qlora_fp32_rest = qlora and setup.strategy not in ("fsdp", "zero3")
    # LoRA training the embedding in full (lora.modulesToSave): its copy is fp32 and F.embedding is no
    # autocast op, so the residual stream is fp32 too (DeepSpeed casts the whole model to bf16).
    fp32_embedding = (not full and setup.architecture.traits.embedding_module in setup.lora_modules_to_save
                      and not setup.strategy.startswith("zero"))
    residual = 4 if (autocast_fp32 or compute == 4 or qlora_fp32_rest or fp32_embedding) else compute
    mlp = 4 if qlora_fp32_rest else compute
    return Regime(compute, residual, autocast_fp32, full, not full, qlora, mlp, master_bf16)
