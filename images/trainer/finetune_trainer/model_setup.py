"""Load tokenizer and model from local paths and apply the method (full, LoRA, QLoRA).

Dtypes follow notes/trainer_settings.md: full fine-tuning loads fp32 master weights
and the Trainer autocasts; LoRA loads the frozen base in the compute dtype and peft
keeps the adapters in fp32; QLoRA loads the base in 4-bit NF4 (bitsandbytes, CUDA).
FSDP is transformers' own FSDP2 at load time (``DistributedConfig``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from .contract import TrainerConfig
from .errors import ConfigError

log = logging.getLogger("finetune_trainer")

ATTENTION = {"sdpa": "sdpa", "flash": "flash_attention_2", "eager": "eager"}
OPTIMIZER = {"adamw": "adamw_torch_fused", "adamw-8bit": "adamw_bnb_8bit", "paged-adamw-8bit": "paged_adamw_8bit"}


def check_runnable(cfg: TrainerConfig, cuda: bool) -> None:
    """What the contract accepts but this node cannot run: a ConfigError, not a crash."""
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    if cfg.method == "qlora":
        if not cuda:
            raise ConfigError("method qlora needs CUDA (4-bit NF4 via bitsandbytes); no GPU is visible")
        if not has_bnb:
            raise ConfigError("method qlora needs the bitsandbytes package, which this image lacks")
    if cfg.optimizer != "adamw":
        if not cuda:
            raise ConfigError(f"optimizer {cfg.optimizer} needs CUDA (bitsandbytes); no GPU is visible")
        if not has_bnb:
            raise ConfigError(f"optimizer {cfg.optimizer} needs the bitsandbytes package, which this image lacks")
    if cfg.attention == "flash":
        if not cuda:
            raise ConfigError("attention flash needs CUDA; no GPU is visible")
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("attention flash needs the flash-attn package, which this image lacks")
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError("precision fp16 needs CUDA; use bf16 or fp32 on CPU")
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path {model_dir} holds no config.json")
    tokenizer_dir = Path(cfg.model.tokenizer_path or cfg.model.path)
    if not tokenizer_dir.is_dir():
        raise ConfigError(f"model.tokenizerPath {tokenizer_dir} does not exist")


def check_deepspeed_batch(cfg: TrainerConfig, world_size: int) -> None:
    """Numbers a DeepSpeed config states instead of "auto" must match this attempt.

    The Trainer would find the mismatch only after loading the model; a retry with the
    same config cannot fix it, so it is a ConfigError, found before anything loads.
    """
    if cfg.deepspeed is None:
        return
    expected = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation,
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation * world_size,
    }
    for key, value in expected.items():
        stated = cfg.deepspeed.get(key, "auto")
        if stated != "auto" and stated != value:
            raise ConfigError(
                f"deepspeed.{key} is {stated} but this attempt runs {value} "
                f"(microBatchSize {cfg.micro_batch_size}, gradientAccumulation {cfg.gradient_accumulation}, "
                f"{world_size} ranks)"
            )


def compute_dtype(cfg: TrainerConfig):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision]


def load_tokenizer(cfg: TrainerConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        cfg.model.tokenizer_path or cfg.model.path,
        trust_remote_code=cfg.model.trust_remote_code,
        local_files_only=True,
    )
    if tokenizer.pad_token_id is None:
        # Padding positions carry label -100 and attention 0, so any id will do.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def attention_for(cfg: TrainerConfig) -> str:
    """The attention kernel to ask transformers for. Gemma 2 soft-caps its attention logits,
    which sdpa cannot do (transformers refuses the model), so sdpa means eager there; the
    memory estimate sizes Gemma 2 as eager for the same reason."""
    wanted = ATTENTION[cfg.attention]
    if wanted == "sdpa" and _model_type(cfg) == "gemma2":
        log.info("gemma2 soft-caps attention logits, which sdpa cannot: using eager attention")
        return "eager"
    return wanted


def _model_type(cfg: TrainerConfig) -> str | None:
    try:
        return json.loads((Path(cfg.model.path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_model(cfg: TrainerConfig, world_size: int):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {
        "trust_remote_code": cfg.model.trust_remote_code,
        "local_files_only": True,
        "attn_implementation": attention_for(cfg),
    }
    if cfg.method == "full":
        kwargs["dtype"] = torch.float32
    elif cfg.method == "lora":
        kwargs["dtype"] = compute_dtype(cfg)
    else:  # qlora
        from transformers import BitsAndBytesConfig

        kwargs["dtype"] = compute_dtype(cfg)
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype(cfg),
        )
    if cfg.strategy == "fsdp" and world_size > 1:
        from transformers.distributed.configuration_utils import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(
            fsdp_size=world_size,
            fsdp_mixed_precision=cfg.precision != "fp32",
            fsdp_cpu_offload=cfg.offload == "optimizer+params",
            fsdp_plan=dict(cfg.fsdp.plan) if cfg.fsdp and cfg.fsdp.plan else None,
        )
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, **kwargs)
    model.config.use_cache = False
    if cfg.method in ("lora", "qlora"):
        model = apply_lora(cfg, model)
    return model


def apply_lora(cfg: TrainerConfig, model):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if cfg.method == "qlora":
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=cfg.lora.target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as exc:
        # peft names the modules it could not find; that is a config problem.
        raise ConfigError(f"lora.targetModules: {exc}") from exc
