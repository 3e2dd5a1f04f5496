"""Activation offloading (`training.activationOffloading`): the block inputs that gradient
checkpointing keeps go to host memory in forward and come back for the recompute in backward
(the trainer's activation_offload.py; the memory model's `SavedActivations.offloaded_to_host`,
sizing/activations.py). It costs time (PCIe traffic, which the planner prices), not results."""

from __future__ import annotations

from ..rules import Rule, one_of
from .lever import Lever, LeverField, switch_ask


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[bool, ...], bool]:
    return switch_ask(training.activation_offloading)


def _transfer_bytes(arch, micro: int, sequence_length: int) -> float:
    # Every block input goes to the host in forward and comes back in backward (bf16, out and back).
    return 2 * arch.num_layers * arch.hidden_size * micro * sequence_length * 2


def _words(setting) -> str:
    return "activation offloading"


LEVER = Lever(
    name="activation_offloading",
    off={"activation_offloading": False},
    auto={"activation_offloading": None},
    schema={"activation_offloading": LeverField(bool, "Checkpointed activations kept in host memory.")},
    spec={"activation_offloading": LeverField(bool | None, """
        Move the checkpointed activations (each block's input) to host memory during forward and back in
        backward: GPU memory for host memory, which the pod's memory request includes. Needs gradient
        checkpointing. Omit to let the planner decide.""")},
    ask=_ask,
    rules=(
        Rule("activation-offload-checkpointing",
             {"activation_offloading": one_of(True), "gradient_checkpointing": one_of(False)}, "activation_offloading",
             "activation offloading moves checkpointed activations: it needs gradient checkpointing"),
    ),
    quality_cost=1,  # time (host transfers), nothing of the result
    host_memory=True,
    host_transfer_bytes=_transfer_bytes,
    rung="activationOffloading",
    rung_after="sharding",
    label="activation offloading",
    phrase="activation offloading",
    words=_words,
    change="activation offloading",
)
