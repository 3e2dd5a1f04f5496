"""``python -m finetune_trainer --config /etc/finetune/config.json``: one process per GPU
(torchrun starts them). Exits 0, or writes a FailureReport and exits with its code."""

from __future__ import annotations

import argparse
import math
import os
import time
import traceback

from . import checkpointing, optimizers
from .contract import DEFAULT_CONFIG_PATH, DEFAULT_REPORT_PATH, ConfigLoadError, Phase, TrainerConfig, load_trainer_config
from .errors import ConfigError
from .memory_levers import eval_micro_batch, ranks_per_replica, trainer_arguments
from .phases import PROGRESS
from .provenance import AttemptFacts, write_attempt_record
from .reporting import build_report, build_success, log_json, rank, world_size, write_report, write_success


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="finetune_trainer", description=__doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH, help="TrainerConfig JSON")
    parser.add_argument("--report-path", default=None,
                        help="where to write the failure report (default: the config's reportPath)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report_path = args.report_path or DEFAULT_REPORT_PATH
    cfg: TrainerConfig | None = None
    try:
        PROGRESS.enter(Phase.SETUP, 0)
        try:
            cfg = load_trainer_config(args.config)
        except ConfigLoadError as exc:
            raise ConfigError(str(exc)) from exc
        report_path = args.report_path or cfg.report_path
        facts = train(cfg)
        # Inside the try: a teardown that fails is reported like any other failure. Before the
        # export, so that no rank waits in a collective while rank 0 merges (which may take long).
        from .teardown import close_distributed

        close_distributed()
        exported = export_result(cfg) if rank() == 0 else None
        # The measured peaks, which the operator compares with its prediction (calibration), what
        # the attempt trained on (the job's provenance record) and where the export went.
        write_success(build_success(PROGRESS, cfg.attempt, facts.summary(), exported), report_path)
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure becomes a report
        report = build_report(exc, PROGRESS, cfg.attempt if cfg else None)
        log_json("failure", **report.model_dump(mode="json", by_alias=True, exclude_none=True),
                 traceback=traceback.format_exc(limit=20))
        write_report(report, report_path)
        return report.exit_code


def export_result(cfg: TrainerConfig) -> "ExportFacts | None":
    """spec.export on rank 0, after the final save and the teardown (export.py): on the CPU, with the
    training model gone. An ExportError fails the attempt (ConfigError) and leaves the adapter."""
    import gc

    from .contract import ExportFacts
    from .export import export_after_training

    gc.collect()  # the Trainer and its model (reference cycles) before the merge needs the memory
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - the trainer image always has torch
        pass
    PROGRESS.enter(Phase.EXPORT, PROGRESS.step)
    result = export_after_training(cfg)
    if result is None:
        return None
    log_json("export", kind=result.kind, directory=result.directory, shards=result.shards, tensors=result.tensors,
             totalBytes=result.total_bytes, peakRssBytes=result.peak_rss_bytes, seconds=result.seconds,
             untied=list(result.untied) or None)
    return ExportFacts(kind=result.kind, directory=result.directory, shards=result.shards,
                       total_bytes=result.total_bytes, peak_rss_bytes=result.peak_rss_bytes or None,
                       seconds=result.seconds)


def plan_run(cfg: TrainerConfig, num_examples: int, world: int, checkpoint) -> "RunPlan":
    from .checkpointing import optimizer_restore
    from .data import total_samples
    from .training import RunPlan

    # The ranks of one sequence-parallel group share each micro-batch (memory_levers.ranks_per_replica).
    global_batch = cfg.micro_batch_size * cfg.gradient_accumulation * world // ranks_per_replica(cfg)
    start_step = checkpoint.meta.step if checkpoint else 0
    start_samples = checkpoint.meta.samples_consumed if checkpoint else 0
    if cfg.max_steps is not None:
        max_steps = cfg.max_steps
    else:
        remaining = max(0, total_samples(num_examples, cfg.epochs) - start_samples)
        max_steps = start_step + math.ceil(remaining / global_batch)
    restore, why_not = optimizer_restore(checkpoint, cfg.strategy, world, cfg.optimizer) if checkpoint else (False, None)
    return RunPlan(
        start_step=start_step,
        start_samples=start_samples,
        max_steps=max_steps,
        global_batch=global_batch,
        world_size=world,
        resume_from=checkpoint,
        restore_optimizer=restore,
        optimizer_not_restored=why_not,
    )


def usable_checkpoint(cfg: TrainerConfig):
    if cfg.checkpoint is None:
        return None
    if rank() == 0:
        checkpointing.clean_staging(cfg.checkpoint.directory)
    checkpoint = checkpointing.newest_checkpoint(cfg.checkpoint.directory)
    if checkpoint is None:
        return None
    if checkpoint.meta.optimizer is None:
        log_json("info", message=f"checkpoint {checkpoint.path} records no optimizer (written before optimizers "
                                 f"were recorded): taken as {checkpointing.LEGACY_OPTIMIZER}")
    adapters = {"lora", "qlora"}
    if checkpoint.meta.method != cfg.method and not {checkpoint.meta.method, cfg.method} <= adapters:
        log_json("warning", message=f"checkpoint {checkpoint.path} is from method {checkpoint.meta.method}, "
                                    f"this attempt runs {cfg.method}: starting from the base model")
        return None
    # Before anything reads it: a pickled file that would run code fails the attempt (DataError).
    checkpointing.check_files(checkpoint)
    return checkpoint


def training_arguments(cfg: TrainerConfig, max_steps: int, cuda: bool):
    from transformers import TrainingArguments

    from .model_setup import accelerate_fsdp_arguments, fsdp_route, sequence_parallel_arguments

    return TrainingArguments(
        output_dir=cfg.output_directory,
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        # A float below 1 is a ratio of the total steps to transformers: how an epoch-based job
        # (whose step count only the trainer knows) warms up.
        warmup_steps=cfg.warmup_steps or min(cfg.warmup_ratio or 0.0, 0.999),
        lr_scheduler_type=cfg.lr_scheduler,
        max_grad_norm=cfg.max_grad_norm,
        max_steps=max_steps,
        bf16=cfg.precision == "bf16",
        fp16=cfg.precision == "fp16",
        # The Trainer builds the optimizers that name theirs; the trainer builds the rest (and its
        # levers' own): then this is never read.
        optim=optimizers.kind(cfg.optimizer).trainer_optim or "adamw_torch",
        gradient_checkpointing=cfg.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
        deepspeed=cfg.deepspeed if cfg.zero_stage else None,
        logging_steps=cfg.log_every_steps,
        # Evaluation at the plan's micro-batch: no gradients and the same activations at most, so
        # its memory stays under the training peak the plan sized (README, "Evaluation").
        eval_strategy="steps" if cfg.evaluation and cfg.evaluation.every_steps else "no",
        eval_steps=cfg.evaluation.every_steps if cfg.evaluation else None,
        # Under sequence parallelism evaluation runs each rank's sequences whole (memory_levers.eval_micro_batch).
        per_device_eval_batch_size=eval_micro_batch(cfg.evaluation.micro_batch_size if cfg.evaluation else None,
                                                    cfg.micro_batch_size, cfg),
        prediction_loss_only=True,
        save_strategy="no",  # our own atomic, reshardable checkpoints (checkpointing.py)
        report_to=[],
        disable_tqdm=True,
        log_level="warning",
        seed=cfg.seed,
        use_cpu=not cuda,
        # gloo on CPU; with a single process no backend at all (accelerate would
        # otherwise expect a process group).
        ddp_backend="gloo" if not cuda and world_size() > 1 else None,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        # QLoRA under fsdp: the Trainer's accelerate FSDP2 shards the 4-bit base (model_setup).
        **accelerate_fsdp_arguments(cfg, fsdp_route(cfg, world_size())),
        # The levers the Trainer turns on itself (Lever.trainer_arguments: Liger's kernels).
        **trainer_arguments(cfg),
        # Each sequence split over sequenceParallel ranks (DeepSpeed's Ulysses through accelerate).
        **sequence_parallel_arguments(cfg),
    )


def train(cfg: TrainerConfig) -> "AttemptFacts":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import PrinterCallback

    from .data import (Collator, build_examples, check_micro_batch_tokens, eval_examples, held_out_digest, held_out_split, read_jsonl,
                       sample_order, stream_window_tokens)
    from .contract import MICRO_BATCH_TOKENS_COUNT
    from .faults import FaultInjector
    from .model_setup import check_deepspeed_batch, check_runnable, check_sequence_parallel, load_model, load_tokenizer
    from .training import (CheckpointCallback, FineTuneTrainer, LeversCallback, PhaseCallback, ProgressCallback,
                           ResumeCallback)

    started = time.time()
    cuda = torch.cuda.is_available()
    world = world_size()
    PROGRESS.micro_batch_size = cfg.micro_batch_size
    PROGRESS.sequence_length = cfg.sequence_length
    PROGRESS.gradient_accumulation = cfg.gradient_accumulation
    check_runnable(cfg, cuda)
    check_deepspeed_batch(cfg, world)
    check_sequence_parallel(cfg, world)
    from .levers import StartupLevers
    faults = FaultInjector(cfg.fault_injection, cfg.attempt)

    PROGRESS.enter(Phase.DATA, 0)
    tokenizer = load_tokenizer(cfg)
    records = read_jsonl(cfg.dataset.path)
    examples = build_examples(tokenizer, records, cfg.dataset.format, cfg.sequence_length, cfg.dataset.packing,
                              cfg.dataset.padding_free)
    facts = AttemptFacts.read(cfg, len(records), len(examples))
    held_out: list = []
    if cfg.evaluation is not None and cfg.evaluation.dataset is not None:
        held_out = eval_examples(tokenizer, cfg.evaluation.dataset, cfg.sequence_length)
        facts.read_eval(cfg.evaluation.dataset.path, len(held_out))
    elif cfg.evaluation is not None:
        examples, held_out = held_out_split(examples, cfg.evaluation.held_out_fraction, cfg.seed)
        facts.held_out = len(held_out)
    checkpoint = usable_checkpoint(cfg)
    plan = plan_run(cfg, len(examples), world, checkpoint)
    # What micro-batches of this run's data hold (spec.dataset.microBatchTokens): checked against what
    # the plan was sized for, and printed in the start line for the user to declare next time.
    measured = None if cfg.dataset.packing else stream_window_tokens(
        examples, cfg.seed, plan.max_steps * plan.global_batch, MICRO_BATCH_TOKENS_COUNT)
    if measured is not None:
        check_micro_batch_tokens(cfg.dataset.micro_batch_tokens, measured)
    faults.arm_lab_gpu(plan.start_step)  # the lab's GPU only (faults.py); nothing else sets it
    log_json("start", job=cfg.job_name, attempt=cfg.attempt, method=cfg.method, strategy=cfg.strategy,
             worldSize=world, examples=len(examples), microBatchSize=cfg.micro_batch_size,
             gradientAccumulation=cfg.gradient_accumulation, globalBatch=plan.global_batch,
             startStep=plan.start_step, maxSteps=plan.max_steps, heldOut=facts.held_out,
             evalSequences=len(held_out), heldOutSha256=held_out_digest(held_out) if held_out else None,
             resumeFrom=str(checkpoint.path) if checkpoint else None, device="cuda" if cuda else "cpu",
             microBatchTokens=measured)
    # One line that says which memory levers this attempt runs with (levers.py).
    log_json("levers", **StartupLevers.of(cfg).fields())
    remaining = plan.max_steps - plan.start_step
    if remaining <= 0:
        log_json("summary", status="already-complete", step=plan.start_step, maxSteps=plan.max_steps)
        return facts
    order = sample_order(len(examples), plan.start_samples, remaining * plan.global_batch, cfg.seed)
    dataset = [examples[i].item() for i in order]

    # TrainingArguments first: it starts the process group (and, for ZeRO-3, makes
    # from_pretrained partition the weights as they load).
    PROGRESS.enter(Phase.SETUP, plan.start_step)
    try:
        args = training_arguments(cfg, plan.max_steps, cuda)
    except ValueError as exc:
        # transformers rejects combinations it cannot run (its message names them).
        raise ConfigError(f"training arguments: {exc}") from exc
    if cfg.zero_stage and world > 1:
        import deepspeed

        # ZeRO-3's zero.Init inside from_pretrained asks DeepSpeed's comm layer for the
        # world size; make it wrap the process group TrainingArguments started.
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    PROGRESS.enter(Phase.LOAD, plan.start_step)
    # Seeded before the model is built: the LoRA adapters' random initialisation happens
    # there, and the Trainer seeds only later, in its constructor. Without this, two runs of
    # the same config (and the ranks of one run) start from different adapters.
    from transformers import set_seed

    set_seed(cfg.seed)
    model = load_model(cfg, world)
    if checkpoint is not None and not plan.restore_optimizer:
        checkpointing.load_weights(checkpoint, model, lora=cfg.method != "full")
    chunked = None
    if cfg.loss_chunks > 1:
        from .chunked_loss import ChunkedLoss

        try:
            chunked = ChunkedLoss(model, cfg.loss_chunks)
        except ValueError as exc:
            raise ConfigError(f"lossChunks {cfg.loss_chunks}: {exc}") from exc

    eval_dataset = [e.item() for e in held_out] or None
    trainer = FineTuneTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                              data_collator=Collator(tokenizer.pad_token_id,
                                                     flatten=cfg.attention == "flash" or cfg.dataset.padding_free,
                                                     sequence_shards=cfg.sequence_parallel),
                              processing_class=tokenizer,
                              faults=faults, cfg=cfg, chunked_loss=chunked)
    trainer.remove_callback(PrinterCallback)
    progress = ProgressCallback(trainer, plan, attempt=cfg.attempt)
    evaluation = None
    if eval_dataset is not None and cfg.evaluation is not None:
        from .evaluation import EvalCallback

        evaluation = EvalCallback(trainer, cfg.evaluation, cfg.checkpoint.directory if cfg.checkpoint else None,
                                  checkpoint.meta.step if checkpoint is not None else None)
    # The levers callback first: it checks the optimizer before resume loads into it.
    for callback in (LeversCallback(trainer, cfg), PhaseCallback(faults),
                     ResumeCallback(trainer, plan, cfg.method != "full"),
                     CheckpointCallback(trainer, cfg, plan, faults), progress, evaluation):
        if callback is not None:
            trainer.add_callback(callback)

    # Until the first forward, train() wraps the model and builds the optimizer (and
    # DeepSpeed's partitions): memory for those counts as loading.
    PROGRESS.enter(Phase.LOAD, plan.start_step)
    result = trainer.train()
    if eval_dataset is not None and progress.eval_step != trainer.state.global_step:
        trainer.evaluate()  # always at the end (the cadence may not land on the last step)
    progress.close_status()

    PROGRESS.enter(Phase.CHECKPOINT, trainer.state.global_step)
    trainer.save_model(cfg.output_directory)
    if evaluation is not None:  # the best evaluation's model in place of the last step's (keepBest)
        evaluation.finish(facts, cfg.output_directory, trainer.state.global_step)
    elapsed = time.time() - started
    tokens = progress.global_tokens()
    if trainer.is_world_process_zero():
        from .training import memory_fields

        log_json("summary", status="completed", job=cfg.job_name, attempt=cfg.attempt,
                 startStep=plan.start_step, step=trainer.state.global_step, maxSteps=plan.max_steps,
                 finalLoss=progress.last_loss, attemptMeanLoss=round(result.training_loss, 6),
                 evalLoss=progress.eval_loss, evalStep=progress.eval_step,
                 tokens=tokens, tokensPerSecond=round(tokens / max(elapsed, 1e-9), 1),
                 runtimeSeconds=round(elapsed, 2), output=cfg.output_directory, **memory_fields())
    facts.tokens, facts.final_loss, facts.eval_loss = tokens, progress.last_loss, progress.eval_loss
    if trainer.is_world_process_zero():
        write_attempt_record(cfg, facts, trainer.state.global_step)
    return facts
