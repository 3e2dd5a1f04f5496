"""The trainer's input for one attempt: the job's settings with the plan's choices applied."""

from __future__ import annotations

import math

from finetune_trainer.contract import (
    CheckpointSettings,
    DatasetSource,
    EarlyStopping,
    EvaluationSettings,
    LoraSettings,
    ModelSource,
    TrainerConfig,
)
from finetune_trainer.memory_levers import stops_clipping
from pydantic import ValidationError

from .. import api
from ..planning import Plan
from .errors import RenderError
from .layout import Layout
from .strategy import BatchSettings, build_deepspeed_config, build_fsdp_settings

# The learning rates the API documents for an omitted spec.training.learningRate.
DEFAULT_LEARNING_RATE = {"full": 2e-5, "lora": 2e-4, "qlora": 2e-4}


def build_trainer_config(job: api.FineTuneJob, plan: Plan, attempt: int, layout: Layout) -> TrainerConfig:
    """The TrainerConfig of attempt `attempt` of `job` under `plan`."""
    spec = job.spec
    training = spec.training
    _check_batch(plan, training)
    learning_rate = training.learning_rate or DEFAULT_LEARNING_RATE[plan.method]
    # Clipping by global norm needs every gradient at once; a lever such as the optimizer step in
    # backward frees each as soon as it is applied (combinations.py refuses the two together).
    max_grad_norm = 0.0 if stops_clipping(plan) else 1.0
    weight_decay = 0.0

    fsdp = deepspeed = None
    if plan.strategy == "fsdp":
        fsdp = build_fsdp_settings(plan.offload)
    elif plan.strategy != "ddp":
        deepspeed = build_deepspeed_config(
            plan.strategy,
            plan.offload,
            BatchSettings(
                micro_batch_size=plan.micro_batch_size,
                gradient_accumulation=plan.gradient_accumulation,
                data_parallel_size=plan.data_parallel_size,
                precision=plan.precision,
                optimizer=plan.optimizer,
                learning_rate=learning_rate,
                weight_decay=weight_decay,
                max_grad_norm=max_grad_norm,
            ),
        )

    if training.max_steps is not None:
        warmup = {"warmup_steps": math.ceil(training.warmup_ratio * training.max_steps)}
    else:
        warmup = {"warmup_steps": 0, "warmup_ratio": training.warmup_ratio}

    checkpoint = None
    if spec.checkpoint is not None and layout.checkpoint_path is not None:
        checkpoint = CheckpointSettings(
            directory=layout.checkpoint_path,
            every_steps=spec.checkpoint.every_steps,
            keep_last=spec.checkpoint.keep_last,
        )

    evaluation = None
    if spec.evaluation is not None:
        eval_path = layout.eval_path
        evaluation = EvaluationSettings(
            held_out_fraction=spec.evaluation.held_out_fraction,
            # The eval data is read like the training data (its format and packing).
            dataset=None if eval_path is None else DatasetSource(path=eval_path, format=spec.dataset.format,
                                                                 packing=spec.dataset.packing,
                                                                 padding_free=spec.dataset.padding_free),
            every_steps=spec.evaluation.every_steps, micro_batch_size=spec.evaluation.micro_batch_size,
            early_stopping=None if spec.evaluation.early_stopping is None else EarlyStopping(
                patience=spec.evaluation.early_stopping.patience, min_delta=spec.evaluation.early_stopping.min_delta),
            keep_best=spec.evaluation.keep_best or None)

    try:
        return TrainerConfig(
            job_name=job.metadata.name,
            attempt=attempt,
            model=ModelSource(path=layout.model_path),
            dataset=DatasetSource(path=layout.data_path, format=spec.dataset.format, packing=spec.dataset.packing,
                                  padding_free=spec.dataset.padding_free,
                                  micro_batch_tokens=spec.dataset.micro_batch_tokens),
            method=plan.method,
            lora=_lora(spec, plan),
            precision=plan.precision,
            optimizer=plan.optimizer,
            **plan.levers.setup_fields(),
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            sequence_length=plan.sequence_length,
            micro_batch_size=plan.micro_batch_size,
            gradient_accumulation=plan.gradient_accumulation,
            max_steps=training.max_steps,
            epochs=training.epochs,
            gradient_checkpointing=plan.gradient_checkpointing,
            attention=plan.attention,
            strategy=plan.strategy,
            fsdp=fsdp,
            deepspeed=deepspeed,
            offload=plan.offload,
            checkpoint=checkpoint,
            evaluation=evaluation,
            output_directory=layout.output_path,
            # None: the trainer's default by method (contract.default_export), which is the plan's
            # method: a recovery that switches lora to qlora keeps an omitted export at `adapter`.
            export=spec.export,
            seed=training.seed,
            **warmup,
        )
    except ValidationError as error:
        # The plan and the contract disagree (e.g. qlora under a sharded strategy): a planner bug,
        # but the message must still say which setting.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in error.errors(include_url=False)
        )
        raise RenderError("plan", f"the trainer would refuse this config: {problems}") from None


def _lora(spec: api.FineTuneJobSpec, plan: Plan) -> LoraSettings:
    if plan.method == "full":
        return LoraSettings()  # unused by a full fine-tune; the contract always carries the block
    if spec.lora is None:
        raise RenderError("spec.lora", f"required for method {plan.method}")
    modules = spec.lora.target_modules
    return LoraSettings(
        rank=spec.lora.rank,
        alpha=spec.lora.alpha,
        dropout=spec.lora.dropout,
        target_modules="all-linear" if modules == ["all-linear"] else list(modules),
        target_experts=spec.lora.target_experts,
        modules_to_save=list(spec.lora.modules_to_save) or None,
    )


def _check_batch(plan: Plan, training: api.TrainingSpec) -> None:
    # The global batch is the user's; a plan that changes it would silently change training.
    produced = plan.micro_batch_size * plan.gradient_accumulation * plan.data_parallel_size
    if produced != training.global_batch_size:
        raise RenderError(
            "plan.gradientAccumulation",
            f"micro-batch {plan.micro_batch_size} x accumulation {plan.gradient_accumulation} x {plan.data_parallel_size}"
            f" GPUs = {produced}, but spec.training.globalBatchSize is {training.global_batch_size}",
        )
    if plan.sequence_length != training.sequence_length:
        raise RenderError(
            "plan.sequenceLength",
            f"{plan.sequence_length} differs from spec.training.sequenceLength {training.sequence_length}",
        )
