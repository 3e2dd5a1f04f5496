"""Activation offloading (`training.activationOffloading`): the block inputs that gradient
checkpointing keeps go to host memory in forward and come back for the recompute in backward
(the trainer's activation_offload.py; the memory model's `offloaded_to_host`). It costs time
(PCIe traffic, candidates.py prices it), not results."""

from __future__ import annotations

from ..rules import Rule, one_of
from .lever import Lever, Setting


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[bool, ...], bool]:
    if training.activation_offloading is None:
        return (False, True), False
    return (training.activation_offloading,), True


def _settings(freedom: tuple[bool, ...], base) -> tuple[Setting, ...]:
    return tuple({"activation_offloading": on} for on in freedom)


def _transfer_bytes(arch, micro: int, sequence_length: int) -> float:
    # Every block input goes to the host in forward and comes back in backward (bf16, out and back).
    return 2 * arch.num_layers * arch.hidden_size * micro * sequence_length * 2


def _sized(training, method: str, arch, notes: list) -> dict:
    offloading = training.activation_offloading
    if offloading is None:
        offloading = False
        notes.append("training.activationOffloading is unset: sized without activation offloading")
    return {"activation_offloading": offloading}


def _describe_change(old: Setting, new: Setting) -> str:
    if new["activation_offloading"] == old["activation_offloading"]:
        return ""
    return "turned " + ("on" if new["activation_offloading"] else "off") + " activation offloading"


LEVER = Lever(
    name="activation_offloading",
    off={"activation_offloading": False},
    auto={"activation_offloading": None},
    ask=_ask,
    settings=_settings,
    rules=(
        Rule("activation-offload-checkpointing",
             {"activation_offloading": one_of(True), "gradient_checkpointing": one_of(False)}, "activation_offloading",
             "activation offloading moves checkpointed activations: it needs gradient checkpointing"),
    ),
    quality_cost=1,  # time (host transfers), nothing of the result
    host_memory=True,
    host_transfer_bytes=_transfer_bytes,
    sized=_sized,
    rung="activationOffloading",
    rung_after="sharding",
    label="activation offloading",
    phrase="activation offloading",
    words=lambda setting: "activation offloading",
    change="activation offloading",
    describe_change=_describe_change,
)
