"""The optimizer step in backward (`training.optimizerInBackward`): each parameter's step runs
as soon as its gradient is complete and the gradient is freed, so the full set of gradients
never exists (the trainer's optimizer_in_backward.py; the memory model's `_gradients`,
sizing/memory.py). It needs gradient accumulation 1 and rules out clipping by global norm."""

from __future__ import annotations

from ..rules import OFFLOADING, ZERO, AtLeast, Rule, one_of
from .lever import Lever, LeverField, Setting, switch_ask


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[bool, ...], bool]:
    return switch_ask(training.optimizer_in_backward)


def _words(setting) -> str:
    return "optimizer step in backward"


def _describe_change(old: Setting, new: Setting) -> str:
    on = new["optimizer_in_backward"]
    if on == old["optimizer_in_backward"]:
        return ""
    return "turned " + ("on" if on else "off") + " the optimizer step in backward" + (
        " (no gradient clipping)" if on else "")


LEVER = Lever(
    name="optimizer_in_backward",
    off={"optimizer_in_backward": False},
    auto={"optimizer_in_backward": None},
    schema={"optimizer_in_backward": LeverField(
        bool, "Optimizer step inside backward (gradients freed per parameter; no gradient clipping).")},
    spec={"optimizer_in_backward": LeverField(bool | None, """
        Run each parameter's optimizer step inside backward, as soon as its gradient exists, and free that
        gradient at once: the full set of gradients never exists. Needs gradient accumulation 1 (globalBatchSize =
        microBatchSize x GPUs), strategy ddp or fsdp and no offload; gradient clipping is off then. Omit to let the
        planner decide.""")},
    ask=_ask,
    rules=(
        Rule("oib-zero", {"optimizer_in_backward": one_of(True), "strategy": ZERO}, "optimizer_in_backward",
             "the optimizer step in backward needs ddp or fsdp; DeepSpeed ZeRO runs its own optimizer step"),
        Rule("oib-accumulation", {"optimizer_in_backward": one_of(True), "gradient_accumulation": AtLeast(2)},
             "optimizer_in_backward",
             "the optimizer step in backward needs gradient accumulation 1 (each gradient is applied and freed as"
             " soon as it exists): globalBatchSize must equal microBatchSize x GPUs"),
        Rule("oib-offload", {"optimizer_in_backward": one_of(True), "offload": OFFLOADING}, "optimizer_in_backward",
             "the optimizer step in backward runs on the GPU; it cannot be combined with offload"),
        Rule("oib-clipping", {"optimizer_in_backward": one_of(True), "gradient_clipping": one_of(True)},
             "optimizer_in_backward",
             "the optimizer step in backward cannot clip by global norm (no moment holds all gradients): set"
             " maxGradNorm 0"),
    ),
    quality_cost=2,  # no gradient clipping
    whole_batch=True,
    stops_clipping=True,
    rung="optimizerInBackward",
    rung_after="offload",
    keeps_explicit=True,
    label="optimizer step in backward",
    phrase="the optimizer step in backward",
    words=_words,
    change="optimizer step in backward",
    describe_change=_describe_change,
)
