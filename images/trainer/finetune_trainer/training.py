"""The transformers Trainer, plus what it lacks: phase tracking for failure reports,
fault injection, our own checkpoints and resume, and JSON progress lines."""

from __future__ import annotations

import importlib
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import SequentialSampler
from transformers import Trainer, TrainerCallback

from . import checkpointing, optimizers
from .checkpointing import Checkpoint, CheckpointMeta
from .contract import Phase, ProgressReport, TrainerConfig
from .faults import FaultInjector
from .memory_levers import ranks_per_replica
from .phases import PROGRESS
from .reporting import log_json, rank
from .trainjob_status import StatusReporter


@dataclass
class RunPlan:
    """Where this attempt starts and ends, in optimizer steps and samples."""

    start_step: int
    start_samples: int
    max_steps: int
    global_batch: int
    world_size: int
    resume_from: Checkpoint | None
    restore_optimizer: bool
    # Why the checkpoint's optimizer state is not loaded (None when it is, or on a fresh start).
    optimizer_not_restored: str | None = None


class FineTuneTrainer(Trainer):
    def __init__(self, *args, faults: FaultInjector, cfg: TrainerConfig | None = None, chunked_loss=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.cfg = cfg
        # chunked_loss.ChunkedLoss when lossChunks > 1: compute_loss goes through it.
        self.chunked_loss = chunked_loss
        # Tokens this rank processed this attempt, kept on the device: reading it every
        # micro-batch would synchronise with the GPU.
        self._tokens = None

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, except for two levers: bf16 master weights with AdamW
        (bf16_adamw.BF16AdamW) and the optimizer step in backward (one optimizer per
        parameter, optimizer_in_backward.py). Parameter groups (weight decay or not) are
        the Trainer's own."""
        from .levers import StartupLevers

        cfg = self.cfg
        levers = StartupLevers.of(cfg) if cfg is not None else None
        if levers is None or not levers.custom_optimizer or self.optimizer is not None:
            optimizer = super().create_optimizer(model)
            # The Trainer makes a no-weight-decay group even when nothing is in it (LoRA:
            # biases and norms are frozen). Checkpoints store optimizer state flattened by
            # parameter name, which torch cannot load into an empty group: drop it (before
            # the LR scheduler is made from the groups).
            optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
            _log_optimizer(cfg, optimizer)
            return optimizer
        opt_model = self.model if model is None else model
        cls, kwargs = self._optimizer_class()
        if not levers.optimizer_in_backward:
            decay = set(self.get_decay_parameter_names(opt_model))
            groups = [
                {"params": [p for n, p in opt_model.named_parameters() if n in decay and p.requires_grad],
                 "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in opt_model.named_parameters() if n not in decay and p.requires_grad],
                 "weight_decay": 0.0},
            ]
            self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
            _log_optimizer(cfg, self.optimizer)
            return self.optimizer
        from .optimizer_in_backward import InBackwardOptimizer

        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p, self.args.weight_decay if n in decay else 0.0)
                 for n, p in opt_model.named_parameters() if p.requires_grad]
        self.optimizer = InBackwardOptimizer(named, lambda groups: cls(groups, **kwargs))
        if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
            _embeddings_in_32_bit(opt_model)
        _log_optimizer(cfg, self.optimizer, cls)
        return self.optimizer

    def _optimizer_class(self):
        cfg = self.cfg
        if optimizers.kind(cfg.optimizer).library == "torchao":
            return _torchao_optimizer(cfg, self.args)
        if cfg.method == "full" and cfg.master_weights == "bf16" and cfg.optimizer == "adamw":
            from .bf16_adamw import BF16AdamW
            from .reporting import rank

            return BF16AdamW, {"lr": self.args.learning_rate,
                               "betas": (self.args.adam_beta1, self.args.adam_beta2),
                               "eps": self.args.adam_epsilon, "rounding": cfg.update_rounding,
                               # Each rank draws its own rounding noise (its own shard under FSDP).
                               "seed": cfg.seed * 1000 + rank()}
        return self.get_optimizer_cls_and_kwargs(self.args, self.model)

    @property
    def tokens_seen(self) -> int:
        return 0 if self._tokens is None else int(self._tokens)

    def _get_train_sampler(self, train_dataset=None):
        # The dataset is already in the run's seeded order, starting where the last
        # attempt stopped; shuffling again would break resume.
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The collator's count of real tokens (data.Collator): not an input of the model.
        count = inputs.pop("token_count")
        if not model.training:
            return self._evaluation_loss(model, inputs, return_outputs, num_items_in_batch)
        step = self.state.global_step + 1
        PROGRESS.enter(Phase.FORWARD, step)
        self.faults.maybe_fire(Phase.FORWARD, step)
        self._tokens = count if self._tokens is None else self._tokens + count
        if self.chunked_loss is not None and "shift_labels" in inputs:
            loss = self._split_chunked(model, inputs)
            result = (loss, None) if return_outputs else loss
        elif self.chunked_loss is not None and "labels" in inputs:
            loss = self._chunked(model, inputs, num_items_in_batch)
            result = (loss, None) if return_outputs else loss
        else:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        PROGRESS.enter(Phase.BACKWARD, step)
        if self.faults.pending(Phase.BACKWARD, step) and loss.requires_grad:
            # Fires inside autograd, as a real out-of-memory in backward would.
            loss.register_hook(lambda grad: self.faults.maybe_fire(Phase.BACKWARD, step) or grad)
        return result


    def _split_chunked(self, model, inputs):
        """Sequence parallelism with lossChunks: transformers' own loss of the split (the slices' means
        weighed by their tokens over the group, deepspeed_sp_compute_loss), each slice's mean computed
        by the chunked loss, so the slice's logits never exist whole either."""
        from types import SimpleNamespace

        from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

        chunked = self.chunked_loss

        def slice_loss(**slice_inputs):
            return SimpleNamespace(loss=chunked.slice_mean(model, slice_inputs))

        return deepspeed_sp_compute_loss(self.accelerator, slice_loss, inputs, False,
                                         self.accelerator.parallelism_config)

    def _chunked(self, model, inputs, num_items_in_batch):
        loss = self.chunked_loss.loss(model, inputs, num_items_in_batch)
        # The same scaling as Trainer.compute_loss: gradients are averaged over ranks,
        # the loss was divided by the token count of all ranks.
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes
        return loss

    def _evaluation_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """The held-out loss (Trainer.evaluate, under no_grad): not counted as trained tokens, no fault
        fires, and with lossChunks the logits stay chunked as in training, so evaluation never
        needs the full logits that training avoided."""
        if self.chunked_loss is not None and "labels" in inputs:
            loss = self._chunked(model, inputs, num_items_in_batch)
            # An empty dict: prediction_step takes the logits from it (none: prediction_loss_only).
            return (loss, {}) if return_outputs else loss
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def _log_optimizer(cfg: TrainerConfig | None, optimizer, cls=None) -> None:
    """Which implementation steps the weights (the `optimizer` line): what the config names is not
    proof of what runs. For torch's AdamW also its path (`fused` or `foreach`: their step temporaries
    differ, optimizers.ADAMW_GROUP_MOMENT_COPIES); left out when torch picks it at the step."""
    plain = getattr(optimizer, "optimizer", optimizer)
    per_parameter = getattr(plain, "plain_optimizers", None)  # the step in backward: one per parameter
    if callable(per_parameter):
        plain = next(iter(per_parameter()), plain)
    cls = cls or type(plain)
    defaults = getattr(plain, "defaults", {}) if isinstance(plain, torch.optim.AdamW) else {}
    path = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else None
    log_json("optimizer", optimizer=cfg.optimizer if cfg is not None else None,
             implementation=f"{cls.__module__}.{cls.__qualname__}", **({"adamwPath": path} if path else {}))


def _torchao_optimizer(cfg: TrainerConfig, args):
    """torchao's low-bit AdamW (optimizers.py): block-wise quantised moments, each parameter's step
    in fp32 (torchao compiles it per parameter shape). With bf16 master weights, the update is
    rounded to nearest or stochastically (torchao's `bf16_stochastic_round`); fp32 weights need no
    rounding."""
    module, name = optimizers.kind(cfg.optimizer).optimizer_class.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon,
                 "bf16_stochastic_round": cfg.master_weights == "bf16" and cfg.update_rounding == "stochastic"}


def _embeddings_in_32_bit(model) -> None:
    """What Trainer.create_optimizer does for bitsandbytes' 8-bit optimizers (embeddings
    keep 32-bit optimizer state, as bitsandbytes recommends), for the per-parameter
    8-bit optimizers of the step in backward. bitsandbytes reads the overrides at each
    optimizer's first step."""
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


class LeversCallback(TrainerCallback):
    """Levers that need the prepared model: activation offloading replaces the
    checkpoint function transformers installed; the optimizer step in backward under
    DDP switches DDP's own gradient sync off (the hooks average each gradient)."""

    def __init__(self, trainer: "FineTuneTrainer", cfg: TrainerConfig):
        self.trainer = trainer
        self.cfg = cfg
        self.offload_stats = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if self.cfg.activation_offloading:
            from . import activation_offload

            self.offload_stats = activation_offload.install(trainer.model)
        if self.cfg.optimizer_in_backward:
            from torch.nn.parallel import DistributedDataParallel

            from .optimizer_in_backward import InBackwardOptimizer

            inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            if not isinstance(inner, InBackwardOptimizer):
                raise RuntimeError(f"optimizerInBackward: the Trainer runs {type(inner).__name__}")
            if isinstance(trainer.model_wrapped, DistributedDataParallel):
                trainer.model_wrapped.require_backward_grad_sync = False
                inner.average_gradients_over(trainer.model_wrapped.process_group)

    def on_step_end(self, args, state, control, **kwargs):
        stats = self.offload_stats
        if stats is not None and not getattr(self, "_reported", False) and state.is_world_process_zero:
            # Once, after the first step: what activation offloading held in host memory.
            self._reported = True
            log_json("activation-offload", step=state.global_step, tensorsPerStep=stats.tensors,
                     peakHostBytes=stats.peak_live_bytes)


class PhaseCallback(TrainerCallback):
    def __init__(self, faults: FaultInjector):
        self.faults = faults

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        PROGRESS.enter(Phase.OPTIMIZER, state.global_step + 1)
        self.faults.maybe_fire(Phase.OPTIMIZER, state.global_step + 1)


class ResumeCallback(TrainerCallback):
    """Puts the Trainer at the checkpoint's step before the first batch."""

    def __init__(self, trainer: FineTuneTrainer, plan: RunPlan, lora: bool):
        self.trainer = trainer
        self.plan = plan
        self.lora = lora

    def on_train_begin(self, args, state, control, **kwargs):
        checkpoint = self.plan.resume_from
        if checkpoint is None:
            return
        PROGRESS.enter(Phase.LOAD, checkpoint.meta.step)
        trainer = self.trainer
        engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
        if self.plan.restore_optimizer:
            checkpointing.load_full_state(checkpoint, model=trainer.model, optimizer=trainer.optimizer,
                                          deepspeed_engine=engine, lora=self.lora)
        else:
            # The one line that says so (the weights were loaded before the Trainer wrapped the model).
            log_json("warning", message=f"resuming from {checkpoint.path} without its optimizer state: "
                                        f"{self.plan.optimizer_not_restored}; the optimizer starts fresh, the "
                                        f"weights, LR schedule, step and data position carry over")
        checkpointing.load_scheduler(checkpoint, trainer.lr_scheduler, trainer.optimizer)
        state.global_step = checkpoint.meta.step
        # Loss averaging and throughput count from here, not from step 0.
        trainer._globalstep_last_logged = state.global_step
        trainer._initial_global_step = state.global_step
        log_json("resume", step=checkpoint.meta.step, path=str(checkpoint.path),
                 samplesConsumed=checkpoint.meta.samples_consumed, optimizerRestored=self.plan.restore_optimizer,
                 optimizerNotRestored=self.plan.optimizer_not_restored,
                 fromOptimizer=checkpoint.meta.optimizer_or_legacy,
                 fromMasterWeights=checkpoint.meta.master_weights or "fp32",
                 fromStrategy=checkpoint.meta.strategy, fromWorldSize=checkpoint.meta.world_size,
                 fromMicroBatchSize=checkpoint.meta.micro_batch_size,
                 fromGradientAccumulation=checkpoint.meta.gradient_accumulation)


class CheckpointCallback(TrainerCallback):
    def __init__(self, trainer: FineTuneTrainer, cfg: TrainerConfig, plan: RunPlan, faults: FaultInjector):
        self.trainer = trainer
        self.cfg = cfg
        self.plan = plan
        self.faults = faults

    def on_step_end(self, args, state, control, **kwargs):
        ckpt = self.cfg.checkpoint
        step = state.global_step
        # Not at the last step: the final output is written right after it, and an attempt
        # killed before that redoes the steps since the last checkpoint and writes it then.
        if ckpt is None or step % ckpt.every_steps != 0 or step >= self.plan.max_steps:
            return
        PROGRESS.enter(Phase.CHECKPOINT, step)
        self.faults.maybe_fire(Phase.CHECKPOINT, step)
        trainer = self.trainer
        meta = CheckpointMeta(
            step=step,
            samples_consumed=self.plan.start_samples + (step - self.plan.start_step) * self.plan.global_batch,
            world_size=self.plan.world_size,
            strategy=self.cfg.strategy,
            method=self.cfg.method,
            format="deepspeed" if trainer.is_deepspeed_enabled else "dcp",
            micro_batch_size=self.cfg.micro_batch_size,
            gradient_accumulation=self.cfg.gradient_accumulation,
            attempt=self.cfg.attempt,
            optimizer=self.cfg.optimizer,
            master_weights=self.cfg.master_weights,
            update_rounding=self.cfg.update_rounding,
        )
        checkpointing.save_checkpoint(
            root=Path(ckpt.directory), meta=meta, model=trainer.model, optimizer=trainer.optimizer,
            scheduler=trainer.lr_scheduler,
            deepspeed_engine=trainer.model_wrapped if trainer.is_deepspeed_enabled else None,
            lora=self.cfg.method != "full", keep_last=ckpt.keep_last,
        )
        # The next failure (if any) happens in the next step's forward.
        PROGRESS.enter(Phase.FORWARD, step + 1)


def memory_fields() -> dict:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {
            "peakAllocatedBytes": int(torch.cuda.max_memory_allocated()),
            "peakReservedBytes": int(torch.cuda.max_memory_reserved()),
        }
    # ru_maxrss is KiB on Linux.
    return {"hostPeakRssBytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


class ProgressCallback(TrainerCallback):
    """One JSON line per logging step (rank 0), and a summary at the end."""

    def __init__(self, trainer: FineTuneTrainer, plan: RunPlan, attempt: int | None = None):
        self.trainer = trainer
        self.plan = plan
        self.attempt = attempt
        self.last_time = time.time()
        self.last_tokens = 0
        self.start_time = time.time()
        self.train_begin = time.time()
        self.last_loss: float | None = None
        self.eval_loss: float | None = None
        self.eval_step: int | None = None
        self.last_report: ProgressReport | None = None
        # Kubeflow Trainer's status endpoint, where the pod was given one (rank 0 only writes).
        self.status: StatusReporter | None = None
        self._status_checked = False

    def on_train_begin(self, args, state, control, **kwargs):
        # Throughput and elapsed time count training, not loading.
        self.last_time = self.train_begin = time.time()

    def global_tokens(self) -> int:
        import torch.distributed as dist

        tokens = torch.tensor([self.trainer.tokens_seen], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                tokens = tokens.cuda()
            dist.all_reduce(tokens)
        # Every rank of a sequence-parallel group counts each micro-batch the group runs (the adapter
        # hands each of them a slice of it, with the whole batch's count).
        cfg = getattr(self.trainer, "cfg", None)
        return int(tokens.item()) // (ranks_per_replica(cfg) if cfg is not None else 1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "eval_loss" in logs:
            self.eval_loss, self.eval_step = round(float(logs["eval_loss"]), 6), state.global_step
            if state.is_world_process_zero:
                log_json("eval", step=state.global_step, evalLoss=self.eval_loss,
                         evalPerplexity=_perplexity(self.eval_loss))
                # The operator reads progress lines only: repeat the last one with the new figure,
                # so an evaluation after the last logging step (the final one) reaches status too.
                if self.last_report is not None:
                    self._write(self.last_report.model_copy(update={
                        "time": round(time.time(), 3), "eval_loss": self.eval_loss, "eval_step": self.eval_step}))
            return
        if "loss" not in logs:
            return
        tokens = self.global_tokens()
        now = time.time()
        rate = (tokens - self.last_tokens) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_tokens = now, tokens
        self.last_loss = float(logs["loss"])
        if state.is_world_process_zero:
            # The line's format is the contract's (the operator parses it from the pod log).
            report = ProgressReport(
                time=round(now, 3),
                rank=rank(),
                attempt=self.attempt,
                step=state.global_step,
                maxSteps=self.plan.max_steps,
                startStep=self.plan.start_step,
                elapsedSeconds=round(now - self.train_begin, 3),
                loss=round(float(logs["loss"]), 6),
                learningRate=logs.get("learning_rate"),
                gradNorm=None if logs.get("grad_norm") is None else round(float(logs["grad_norm"]), 6),
                tokensPerSecond=round(rate, 1),
                samplesConsumed=self.plan.start_samples
                + (state.global_step - self.plan.start_step) * self.plan.global_batch,
                evalLoss=self.eval_loss,
                evalStep=self.eval_step,
                **memory_fields(),
            )
            self._write(report)

    def _write(self, report: ProgressReport) -> None:
        self.last_report = report
        sys.stdout.write(report.to_log_line() + "\n")
        sys.stdout.flush()
        if not self._status_checked:
            self._status_checked = True
            self.status = StatusReporter.from_env()
        if self.status is not None:
            self.status.submit(report, self.train_begin)

    def close_status(self) -> None:
        """Send the last report now (the final evaluation's must not wait out the interval)."""
        if self.status is not None:
            self.status.close()


def _perplexity(loss: float) -> float | None:
    """exp(loss), the usual reading of a language model's held-out loss; None where it overflows."""
    return round(math.exp(loss), 4) if loss < 700 else None
