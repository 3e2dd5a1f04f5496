"""Load tokenizer and model from local paths and apply the method (full, LoRA, QLoRA).

Dtypes follow notes/trainer_settings.md: full fine-tuning loads fp32 master weights
and the Trainer autocasts (``masterWeights: bf16``: bf16 weights, no fp32 copy); LoRA
loads the frozen base in the compute dtype and peft keeps the adapters in fp32; QLoRA
loads the base in 4-bit NF4 (bitsandbytes, CUDA).

FSDP (``fsdp_route``): full and LoRA fine-tuning use transformers' own FSDP2 at load
time (``DistributedConfig``). QLoRA uses the Trainer's accelerate FSDP2 plugin instead,
as transformers' and peft's FSDP-QLoRA recipe does: the 4-bit weights are stored in the
compute dtype (``bnb_4bit_quant_storage``) so that FSDP can shard them like any bf16
tensor (a uint8 storage would be left unsharded), the plugin wraps the decoder layers
and peft's adapters, and ``offload: optimizer+params`` keeps the shards in host memory.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from . import optimizers
from .contract import TrainerConfig
from .errors import ConfigError
from .memory_levers import LEVERS, camel, ranks_per_replica
from . import reporting

log = logging.getLogger("finetune_trainer")

ATTENTION = {"sdpa": "sdpa", "flash": "flash_attention_2", "eager": "eager"}


def check_runnable(cfg: TrainerConfig, cuda: bool) -> None:
    """What the contract accepts but this node cannot run: a ConfigError, not a crash."""
    has_bnb = importlib.util.find_spec("bitsandbytes") is not None
    if cfg.method == "qlora":
        if not cuda:
            raise ConfigError("method qlora needs CUDA (4-bit NF4 via bitsandbytes); no GPU is visible")
        if not has_bnb:
            raise ConfigError("method qlora needs the bitsandbytes package, which this image lacks")
    optimizer = optimizers.kind(cfg.optimizer)
    if optimizer.cuda_only and not cuda:
        raise ConfigError(f"optimizer {cfg.optimizer} needs CUDA ({optimizer.library}); no GPU is visible")
    if optimizer.library != "torch" and importlib.util.find_spec(optimizer.library) is None:
        raise ConfigError(f"optimizer {cfg.optimizer} needs the {optimizer.library} package, which this image lacks")
    if cfg.attention == "flash":
        if not cuda:
            raise ConfigError("attention flash needs CUDA; no GPU is visible")
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("attention flash needs the flash-attn package, which this image lacks")
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError("precision fp16 needs CUDA; use bf16 or fp32 on CPU")
    for lever in LEVERS:  # what each lever in use needs of the node and the image (Lever.needs_cuda, .package)
        if not lever.in_use(cfg):
            continue
        if lever.needs_cuda and not cuda:
            raise ConfigError(f"{camel(lever.name)}: {lever.needs_cuda} need CUDA; no GPU is visible")
        if lever.package and importlib.util.find_spec(lever.package) is None:
            raise ConfigError(f"{camel(lever.name)} needs the {lever.package} package, which this image lacks")
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"model.path {model_dir} holds no config.json")
    tokenizer_dir = Path(cfg.model.tokenizer_path or cfg.model.path)
    if not tokenizer_dir.is_dir():
        raise ConfigError(f"model.tokenizerPath {tokenizer_dir} does not exist")


def check_sequence_parallel(cfg: TrainerConfig, world_size: int) -> None:
    """What a sequence-parallel config needs of this attempt's ranks (memory_levers/sequence_parallel.py):
    a ConfigError before anything loads."""
    degree = cfg.sequence_parallel
    if degree > 1 and world_size % degree:
        raise ConfigError(f"sequenceParallel {degree} does not divide the {world_size} ranks of this attempt")
    if degree > 1 and cfg.gradient_accumulation % degree:
        # A step must run whole rounds of the group's micro-batches (one of each rank's): otherwise what
        # it trained on is not a prefix of the sample order, and a resume would skip or repeat samples.
        raise ConfigError(f"sequenceParallel {degree} must divide gradientAccumulation "
                          f"{cfg.gradient_accumulation}")
    if degree > 1 and attention_for(cfg) == "eager":
        raise ConfigError(f"sequenceParallel: this model runs eager attention only ({_model_type(cfg)}), and Ulysses "
                          "drops the attention mask that eager attention needs")


def sequence_parallel_arguments(cfg: TrainerConfig) -> dict:
    """The TrainingArguments keywords that split each sequence over `sequenceParallel` ranks: accelerate's
    ParallelismConfig with DeepSpeed's Ulysses (ALST) as its backend. The Trainer then wraps the train
    dataloader in DeepSpeed's adapter (each micro-batch's rows sliced over the ranks of its group), swaps
    the attention function for Ulysses' all-to-all around it, and computes the loss as the token-weighted
    mean of the slices (transformers' deepspeed_sp_compute_loss). Evaluation runs without the split
    (`sp_disable_in_eval`): its batches are not sliced, and each rank attends over its own whole sequence."""
    if cfg.sequence_parallel <= 1:
        return {}
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    world = reporting.world_size()
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True,  # each micro-batch is padded to its own longest row
        sp_attn_implementation=attention_for(cfg),
        sp_disable_in_eval=True,
    )
    return {"parallelism_config": ParallelismConfig(
        sp_size=cfg.sequence_parallel, sp_backend="deepspeed", dp_replicate_size=world // cfg.sequence_parallel,
        sp_handler=handler)}


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
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation * world_size // ranks_per_replica(cfg),
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


# Families transformers refuses to run with sdpa: Gemma 2 soft-caps its attention logits,
# gpt-oss adds a learned sink logit per head. sdpa means eager there; the memory estimate
# sizes them as eager for the same reason (sizing FamilyTraits.eager_only / soft-capping).
_NO_SDPA = {"gemma2": "soft-caps attention logits", "gpt_oss": "has attention sinks"}


def attention_for(cfg: TrainerConfig) -> str:
    """The attention kernel to ask transformers for (sdpa falls back to eager where it cannot run)."""
    wanted = ATTENTION[cfg.attention]
    model_type = _model_type(cfg) if wanted == "sdpa" else None
    if model_type in _NO_SDPA:
        log.info("%s %s, which sdpa cannot: using eager attention", model_type, _NO_SDPA[model_type])
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
    route = fsdp_route(cfg, world_size)
    if cfg.method == "full":
        # masterWeights bf16: the weights themselves are bf16 (the optimizer keeps no fp32 copy).
        kwargs["dtype"] = torch.bfloat16 if cfg.master_weights == "bf16" else torch.float32
    elif cfg.method == "lora":
        kwargs["dtype"] = compute_dtype(cfg)
    else:  # qlora
        from transformers import BitsAndBytesConfig

        kwargs["dtype"] = compute_dtype(cfg)
        kwargs["quantization_config"] = BitsAndBytesConfig(**qlora_quantization(cfg, route))
    if route == FSDP_AT_LOAD:
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
        from .levers import check_model

        check_model(cfg, model)
        model = apply_lora(cfg, model)
    return model


# How FSDP is applied (fsdp_route).
FSDP_NONE = "none"
FSDP_AT_LOAD = "transformers-fsdp2"  # DistributedConfig in from_pretrained
FSDP_ACCELERATE = "accelerate-fsdp2"  # the Trainer's accelerate FSDP plugin (QLoRA)


def fsdp_route(cfg: TrainerConfig, world_size: int) -> str:
    if cfg.strategy != "fsdp" or world_size <= 1:
        return FSDP_NONE
    return FSDP_ACCELERATE if cfg.method == "qlora" else FSDP_AT_LOAD


def qlora_quantization(cfg: TrainerConfig, route: str) -> dict:
    """BitsAndBytesConfig arguments. Under FSDP and ZeRO-3 the packed 4-bit bytes are stored in
    the compute dtype: FSDP shards floating tensors only, and all tensors of one FSDP unit must
    share a dtype (fsdp_qlora's quant_storage trick); ZeRO-3's zero.Init partitions the model as
    it loads in one dtype, and transformers and peft run QLoRA under it with that storage."""
    import torch

    args = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": compute_dtype(cfg),
    }
    if route == FSDP_ACCELERATE or cfg.strategy == "zero3":
        args["bnb_4bit_quant_storage"] = compute_dtype(cfg)
    else:
        args["bnb_4bit_quant_storage"] = torch.uint8
    return args


def prepares_kbit(cfg: TrainerConfig) -> bool:
    """Whether peft's prepare_model_for_kbit_training runs: for QLoRA, except under ZeRO-3. It casts
    every parameter that is not 4-bit to fp32, which ZeRO-3's partitioned parameters (loaded in the
    compute dtype by zero.Init) do not take; the Trainer's gradient checkpointing and the frozen base
    need nothing more. TRL's SFTTrainer skips it for sharded QLoRA the same way. The memory model sizes
    the non-4-bit rest in the compute dtype there (sizing/regime.py)."""
    return cfg.method == "qlora" and cfg.strategy != "zero3"


def accelerate_fsdp_arguments(cfg: TrainerConfig, route: str) -> dict:
    """TrainingArguments keys for the accelerate FSDP route (empty otherwise)."""
    if route != FSDP_ACCELERATE:
        return {}
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            # Each decoder layer (the model's _no_split_modules) is one FSDP unit; with
            # peft, transformers widens the policy to wrap the adapters too.
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": True,
            "cpu_offload": cfg.offload == "optimizer+params",
            # accelerate skips its meta-device loading for 4-bit parameters anyway.
            "cpu_ram_efficient_loading": False,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    }


def apply_lora(cfg: TrainerConfig, model):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if prepares_kbit(cfg):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=cfg.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    from .moe import expert_parameter_targets, has_fused_experts

    expert_targets = None
    dropout = cfg.lora.dropout
    if cfg.lora.target_experts:
        expert_targets = expert_parameter_targets(model)
    # peft (0.21) turns "all-linear" on a model with fused 3-D experts into
    # target_parameters by itself, so a default MoE LoRA job wraps its experts too.
    # peft refuses any dropout once experts are wrapped (moe.py): the adapters are
    # built without it and the Linear ones get it back below.
    experts_wrapped = bool(expert_targets) or (cfg.lora.target_modules == "all-linear" and has_fused_experts(model))
    if experts_wrapped:
        dropout = 0.0
    lora = LoraConfig(
        r=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=dropout,
        target_modules=cfg.lora.target_modules,
        target_parameters=expert_targets,
        modules_to_save=cfg.lora.modules_to_save or None,
        task_type="CAUSAL_LM",
    )
    check_modules_to_save(model, cfg.lora.modules_to_save or [])
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        # peft names the modules it could not find; that is a config problem.
        field = "lora.targetExperts" if expert_targets and "target_parameters" in str(exc) else "lora.targetModules"
        raise ConfigError(f"{field}: {exc}") from exc
    if not cfg.zero_stage:  # DeepSpeed casts the model itself and keeps fp32 masters of what trains
        train_in_fp32(peft_model)
    if experts_wrapped and cfg.lora.dropout > 0:
        from .moe import restore_linear_dropout

        restored = restore_linear_dropout(peft_model, "default", cfg.lora.dropout)
        from .reporting import log_json

        wrapped = ", ".join(expert_targets or expert_parameter_targets(peft_model))
        log_json("info", message=f"lora.dropout {cfg.lora.dropout} applies to the {restored} Linear-module adapters; "
                                 f"the fused expert adapters ({wrapped}) train without dropout "
                                 f"(peft's ParamWrapper cannot apply it)")
    return peft_model


def check_modules_to_save(model, names: list[str]) -> None:
    """Each name of lora.modulesToSave must be a module of the model: peft matches names as suffixes
    and skips a name that matches nothing without a word, which would train nothing in full."""
    module_names = [name for name, _ in model.named_modules()]
    for wanted in names:
        if not any(name == wanted or name.endswith("." + wanted) for name in module_names):
            raise ConfigError(f"lora.modulesToSave: {wanted!r} is not a module of {type(model).__name__}")


def train_in_fp32(model) -> None:
    """Every trainable parameter in fp32: peft keeps the LoRA adapters in fp32 by itself, but the copy it
    trains of a `modules_to_save` module keeps the base's dtype (bf16 for LoRA), where AdamW's small
    updates to embeddings are lost in bf16's rounding. The fp32 copy trains like the adapters: autocast
    casts it per use. The sizing model counts it so (sizing/saved_modules.py)."""
    import torch

    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
