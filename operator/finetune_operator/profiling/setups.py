"""Which setups the profile measures for a job, and what a profiled model can be planned with.

The planner varies GPUs (W), strategy, checkpointing and micro-batch (b); the job fixes the
method, LoRA settings, precision, attention and sequence length. For a fixed (strategy,
checkpointing) each phase's peak is the largest of a few moments (end of forward, start of
backward, a block's backward, ...), each affine in the sharded state (1/W) and in the tokens (b):
a convex, piecewise-affine function of (1/W, b). So the profile traces the corners of the range the
planner can ask for on a grid, b in {1, 2, 4, ..., bmax} (bmax: the global batch size) and, for
FSDP, W in {1, 2, 4, ..., Wmax} (maxGPUs), and the estimate interpolates bilinearly inside the grid
cell that holds (W, b) (estimate.py): exact on the grid, and never under a convex function inside a
cell (along each edge the chord lies above it, and the bilinear interpolant is a chord between two
edge chords). A pod traces at most MAX_SETUPS_PER_POD of them (its report must fit the 4096-byte
termination message); the rest are traced by the next pod, the cache keeping what each measured. DDP's per-rank memory
does not depend on W except for the reducer's buckets, which the profile reports. A job that fixes
the micro-batch or the GPU count is measured only there.

What the fake-tensor trace cannot run is refused, naming the field: QLoRA and 8-bit optimizers
(bitsandbytes needs CUDA), DeepSpeed ZeRO (its partitioning runs in its own C++ code), offload, fp16.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from finetune_trainer.contract import ProfileRequest, ProfileSetup

from .. import api

PROFILED_STRATEGIES = ("ddp", "fsdp")
# Setups one pod traces: its report (about 220 bytes a setup) must fit the 4096-byte termination message.
MAX_SETUPS_PER_POD = 12


class NotProfilable(ValueError):
    """The job asks for something the profile cannot trace: `field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


def config_hash(config: Mapping[str, Any], trainer_image: str) -> str:
    """Short stable hash of a config.json (key order and whitespace do not matter) and of the trainer
    image that measures it: another image's figures are another image's (the cache is keyed by both)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str) + "\n" + trainer_image
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobProfile:
    """What a job needs measured: the template setup, and the corners of the planner's range."""

    template: ProfileSetup  # method, LoRA, precision, attention, sequence length (W, b, gc, strategy filled later)
    strategies: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    micro_batches: tuple[int, ...]  # grid(bmax), or the job's fixed micro-batch
    worlds: tuple[int, ...]  # FSDP's grid(Wmax), or the job's fixed GPU count

    def worlds_of(self, strategy: str) -> tuple[int, ...]:
        return (1,) if strategy == "ddp" else self.worlds

    def setup(self, strategy: str, gc: bool, world: int, micro: int) -> ProfileSetup:
        return self.template.model_copy(update=dict(
            strategy=strategy, world_size=world, micro_batch_size=micro, gradient_checkpointing=gc))

    def setups(self) -> list[ProfileSetup]:
        out: dict[str, ProfileSetup] = {}
        for strategy in self.strategies:
            for gc in self.checkpointing:
                for world in self.worlds_of(strategy):
                    for micro in self.micro_batches:
                        setup = self.setup(strategy, gc, world, micro)
                        out.setdefault(setup.key, setup)
        return list(out.values())


def job_profile(spec: api.FineTuneJobSpec) -> JobProfile:
    """The setups a job's plan needs measured; NotProfilable names the field the trace cannot run."""
    t, r = spec.training, spec.resources
    if spec.method == "qlora":
        raise NotProfilable("spec.method", "qlora cannot be profiled (bitsandbytes' 4-bit kernels need CUDA); "
                            "use lora or full for a model the analytic memory model does not know")
    if t.optimizer != "adamw":
        raise NotProfilable("spec.training.optimizer", f"{t.optimizer} cannot be profiled (the trace steps fused "
                            "AdamW only); use adamw for a model the analytic memory model does not know")
    if t.precision not in ("bf16", "fp32"):
        raise NotProfilable("spec.training.precision", f"{t.precision} cannot be profiled; use bf16 or fp32")
    if r.offload not in ("auto", "none"):
        raise NotProfilable("spec.resources.offload", "offload cannot be profiled; leave it auto or none")
    if spec.dataset.padding_free:
        raise NotProfilable("spec.dataset.paddingFree", "a padding-free row cannot be profiled (the trace runs padded "
                            "rows, without the row's mask); leave it off for a model the analytic memory model does "
                            "not know")
    if r.strategy == "auto":
        strategies = PROFILED_STRATEGIES
    elif r.strategy in PROFILED_STRATEGIES:
        strategies = (r.strategy,)
    else:
        raise NotProfilable("spec.resources.strategy", f"{r.strategy} (DeepSpeed) cannot be profiled; "
                            "use ddp, fsdp or auto for a model the analytic memory model does not know")
    lora = spec.lora or api.LoraSpec()
    targets = lora.target_modules
    template = ProfileSetup(
        method=spec.method,
        lora_rank=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        lora_targets="all-linear" if targets == ["all-linear"] else list(targets),
        lora_modules_to_save=list(lora.modules_to_save) or None,
        precision=t.precision,
        # flash is traced as the CUDA flash kernel's meta function, like sdpa without a mask
        attention="eager" if t.attention == "eager" else "sdpa",
        packing=spec.dataset.packing,
        sequence_length=t.sequence_length, micro_batch_size=1, gradient_checkpointing=False,
        strategy="ddp", world_size=1,
    )
    if spec.method == "full":
        template = template.model_copy(update=dict(lora_rank=16, lora_alpha=32, lora_dropout=0.0,
                                                   lora_targets="all-linear"))
    checkpointing = (False, True) if t.gradient_checkpointing is None else (t.gradient_checkpointing,)
    micro = (t.micro_batch_size,) if isinstance(t.micro_batch_size, int) else grid(t.global_batch_size)
    worlds = (r.gpus,) if isinstance(r.gpus, int) else grid(r.max_gpus)
    return JobProfile(template, strategies, checkpointing, micro, worlds)


def grid(top: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to `top`, and `top`: where the planner's choices mostly fall (micro-batches divide
    the global batch, GPU counts are powers of two or whole nodes); the estimate is exact there."""
    points, p = {top}, 1
    while p < top:
        points.add(p)
        p *= 2
    return tuple(sorted(points))


def profile_request(spec: api.FineTuneJobSpec, config: Mapping[str, Any], missing: list[ProfileSetup]) -> ProfileRequest:
    """The request for the profile pod: the model's config and (at most MAX_SETUPS_PER_POD of) the setups
    not in the cache."""
    return ProfileRequest(config=dict(config), setups=missing[:MAX_SETUPS_PER_POD])
