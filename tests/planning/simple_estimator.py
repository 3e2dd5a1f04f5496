"""A memory model simple enough to check plans by hand (the search is tested apart from sizing).

Per GPU, in GiB: weights = 2 bytes x params (16 bytes for full fine-tuning: weights, gradients,
fp32 master and two AdamW states), divided by the world size for sharded state
(zero1: optimizer only, zero2: + gradients, fsdp/zero3: everything); offloaded state is 0;
activations = `ACT_GIB_PER_SEQ` per sequence of the micro-batch, a third of it with
checkpointing. required = peak + 1 GiB. Host: 4 GiB per rank plus offloaded state.
"""

from __future__ import annotations

from typing import Any

GiB = 1 << 30
ACT_GIB_PER_SEQ = 4.0


def simple_estimate(setup: Any) -> dict[str, Any]:
    params = setup.architecture.total_params
    w = setup.world_size
    full = setup.method == "full"
    weights = 2 * params if setup.method != "qlora" else params // 2
    grads = 2 * params if full else 0
    optim = 12 * params if full else 0
    sharded = {"ddp": (), "zero1": ("o",), "zero2": ("o", "g"), "fsdp": ("o", "g", "w"), "zero3": ("o", "g", "w")}[setup.strategy]
    host = 4 * GiB
    if "o" in sharded:
        optim //= w
    if "g" in sharded:
        grads //= w
    if "w" in sharded:
        weights //= w
    if setup.offload in ("optimizer", "optimizer+params"):
        host += optim
        optim = 0
    if setup.offload == "optimizer+params":
        host += weights
        weights = 0
    act = int(ACT_GIB_PER_SEQ * GiB * setup.micro_batch_size * (setup.sequence_length / 4096))
    if setup.gradient_checkpointing:
        act //= 3
    peak = weights + grads + optim + act
    return {
        "perGPU": {
            "peakAllocatedBytes": peak,
            "requiredBytes": peak + GiB,
            "peakPhase": "backward",
            "breakdown": {"weights": weights, "gradients": grads, "optimizer": optim, "activations": act},
        },
        "host": {"requiredBytes": host},
        "notes": [],
    }
