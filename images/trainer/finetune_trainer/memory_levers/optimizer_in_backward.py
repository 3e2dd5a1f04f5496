"""The optimizer step in backward (`training.optimizerInBackward`): each parameter's step runs
as soon as its gradient is complete and the gradient is freed, so the full set of gradients
never exists (the trainer's optimizer_in_backward.py; the memory model's `all_grads`). It needs
gradient accumulation 1 and rules out clipping by global norm."""

from __future__ import annotations

from .lever import Lever, Setting


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[bool, ...], bool]:
    if training.optimizer_in_backward is None:
        return (False, True), False
    return (training.optimizer_in_backward,), True


def _settings(freedom: tuple[bool, ...], base) -> tuple[Setting, ...]:
    return tuple({"optimizer_in_backward": on} for on in freedom)


def _sized(training, method: str, arch, notes: list) -> dict:
    oib = training.optimizer_in_backward
    if oib is None:
        oib = False
        notes.append("training.optimizerInBackward is unset: sized without the optimizer step in backward")
    return {"optimizer_in_backward": oib}


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
    ask=_ask,
    settings=_settings,
    quality_cost=2,  # no gradient clipping
    whole_batch=True,
    stops_clipping=True,
    sized=_sized,
    rung="optimizerInBackward",
    rung_after="offload",
    keeps_explicit=True,
    label="optimizer step in backward",
    phrase="the optimizer step in backward",
    words=lambda setting: "optimizer step in backward",
    change="optimizer step in backward",
    describe_change=_describe_change,
)
