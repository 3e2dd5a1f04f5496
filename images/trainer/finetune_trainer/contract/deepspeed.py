"""The DeepSpeed config the trainer sends for a ZeRO stage, and the checks a given one must pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def check_deepspeed(ds: dict[str, Any], stage: int, offload: str) -> None:
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ValueError("deepspeed config needs a zero_optimization block")
    if zero.get("stage") != stage:
        raise ValueError(
            f"deepspeed zero_optimization.stage is {zero.get('stage')!r}, strategy says {stage}"
        )
    opt_off = _offload_device(zero.get("offload_optimizer"))
    param_off = _offload_device(zero.get("offload_param"))
    declared = {"none": ("none", "none"), "optimizer": ("cpu", "none"),
                "optimizer+params": ("cpu", "cpu")}[offload]
    actual = ("cpu" if opt_off in ("cpu", "nvme") else "none",
              "cpu" if param_off in ("cpu", "nvme") else "none")
    if actual != declared:
        raise ValueError(
            f"deepspeed offload (optimizer={opt_off}, params={param_off}) "
            f"does not match offload {offload!r}"
        )


def _offload_device(block: Any) -> str:
    if not block:
        return "none"
    if not isinstance(block, dict):
        raise ValueError("deepspeed offload blocks must be objects")
    return str(block.get("device", "none"))


@dataclass(frozen=True)
class ZeroSettings:
    """The DeepSpeed ZeRO settings every config `deepspeed_config` writes, in elements.

    One place for both sides: the trainer writes these into its DeepSpeed config and the
    operator's memory model (finetune_operator/sizing/zero3.py) replays stage 3 with the same
    numbers, so the estimate and the run cannot disagree.
    """

    # 5e7 elements is 100 MB in bf16 per bucket: large enough for full-bandwidth collectives
    # (DeepSpeed's docs tune between 5e7 and 5e8), small enough that the two reduce buckets
    # overlap_comm keeps cost 0.2 GB per GPU, not DeepSpeed's default 2 GB.
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    # Stage 3: elements gathered ahead of the module that runs, per fetch (DeepSpeed's default).
    prefetch_bucket_size: int = 50_000_000
    # Parameters of at most this many elements stay gathered on every rank (norms, biases):
    # DeepSpeed's default.
    param_persistence_threshold: int = 100_000
    # Gathered elements alive at once (bounds the prefetch), and how far ahead in the trace a
    # released parameter is looked for to keep it gathered for its next use: DeepSpeed's defaults.
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    # The optimizer step runs one sub-group of the rank's partition at a time and builds that
    # sub-group's fp32 gradient (4 bytes per element) for it. DeepSpeed's default (1e9) makes
    # that 4 GB per GPU once a partition holds a billion elements; 1e8 keeps it at 0.4 GB and
    # still steps in large fused kernels.
    sub_group_size: int = 100_000_000

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ZeroSettings.{name} must be a positive integer, not {value!r}")

    def scaled(self, divisor: int) -> "ZeroSettings":
        """The settings with every element budget divided by `divisor` (bench/zero_truth.py runs
        small models on the CPU with budgets in the proportion a large model meets them); the
        persistence threshold is per tensor and stays."""
        keep = {"param_persistence_threshold"}
        return ZeroSettings(**{name: getattr(self, name) if name in keep else max(1, getattr(self, name) // divisor)
                               for name in self.__dataclass_fields__})


ZERO_SETTINGS = ZeroSettings()


def deepspeed_config(stage: int, offload: str = "none", settings: ZeroSettings = ZERO_SETTINGS) -> dict[str, Any]:
    """A complete DeepSpeed config for ZeRO ``stage`` that the trainer accepts, with `settings`
    (ZERO_SETTINGS unless a bench scales them).

    Batch sizes, precision and optimizer hyper-parameters are "auto": the transformers
    Trainer fills them from the TrainerConfig, so the renderer need not repeat them and
    a recovery step that changes the micro-batch cannot leave them inconsistent.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, not {stage!r}")
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        # Set explicitly: transformers fills only keys spelled "auto", and DeepSpeed's own
        # defaults (5e8-element buckets, doubled by overlap_comm) would hold gigabytes per
        # GPU that the memory model (sizing/constants.py reads these names) must agree with.
        "reduce_bucket_size": settings.reduce_bucket_size,
        "allgather_bucket_size": settings.allgather_bucket_size,
    }
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = settings.prefetch_bucket_size
        zero["stage3_param_persistence_threshold"] = settings.param_persistence_threshold
        zero["stage3_max_live_parameters"] = settings.max_live_parameters
        zero["stage3_max_reuse_distance"] = settings.max_reuse_distance
        zero["sub_group_size"] = settings.sub_group_size
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "optimizer+params":
        if stage != 3:
            raise ValueError("parameter offload needs ZeRO-3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # Gather the full weights on save so the output folder holds a normal model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
    }
