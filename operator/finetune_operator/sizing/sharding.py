"""Gathered parameters and gradients in flight at each moment of the step, per GPU: FSDP2's
groups as transformers' plan wraps them (gathered in the compute dtype, reduce-scattered in
fp32), ZeRO-3's gathered parameters and reduce bucket (zero3.py), and otherwise the buffers
that live through the step (DDP's buckets, ZeRO-1/2's, states.py)."""

from __future__ import annotations

from dataclasses import dataclass

from . import constants as K
from .regime import Regime
from .setup import TrainingSetup
from .states import StaticState


@dataclass(frozen=True)
class Sharding:
    """Gathered parameters and gradients in flight at each moment of the step (bytes)."""

    forward: float
    backward_start: float  # the loss gradient at its widest
    head_reduce: float  # the head's gradient being reduced (FSDP), all activations still alive
    backward_mid: float  # a block's backward
    block_reduce: float  # a block's gradient being reduced (FSDP)
    backward_end: float  # the embedding's backward
    end_grads_missing: float  # sharded gradients not yet written at that moment
    optimizer: float


def sharding_of(setup: TrainingSetup, regime: Regime, static: StaticState) -> Sharding:
    arch, world = setup.architecture, setup.world_size
    block = arch.block_params
    embed = arch.vocab_size * arch.hidden_size
    tied = arch.tie_word_embeddings
    gathered_bytes = regime.compute  # FSDP/ZeRO-3 gather in the compute dtype (param_dtype)
    if setup.strategy == "fsdp":
        # transformers' FSDP plan: the embedding and each block are groups resharded after
        # forward; the final norm and the head are one group kept gathered until its backward
        # (tied: the embedding is in that group, which then stays gathered through backward).
        # A group's post-backward reshards it, copies its unsharded gradient (compute dtype)
        # into an fp32 reduce-scatter input (reduce_dtype fp32), then frees the unsharded one.
        # Measured on the trace: the embedding group stays gathered until the root's forward
        # returns.
        grad_frac = 1.0 if setup.method == "full" else 0.0  # a frozen base has no gradients
        block_gathered = gathered_bytes * block
        if regime.qlora:
            # fsdp_qlora gathers the 4-bit storage; bitsandbytes dequantises per matmul.
            linear = sum(lin.params for lin in arch.block_linears())
            block_gathered = K.NF4_PACKED_BYTES_PER_PARAM * linear + gathered_bytes * (block - linear)
        tail = gathered_bytes * (embed + arch.hidden_size)
        tail_grad = gathered_bytes * grad_frac * embed
        reduce = (gathered_bytes + 4) * grad_frac
        tied_extra = tail + tail_grad if tied else 0.0
        return Sharding(
            forward=tail + (0.0 if tied else gathered_bytes * embed),
            backward_start=tail,
            head_reduce=(tail + tail_grad + block_gathered) if tied
            else (block_gathered + reduce * (embed + arch.hidden_size)),
            backward_mid=2 * block_gathered + gathered_bytes * grad_frac * block + tied_extra,
            block_reduce=block_gathered + reduce * block + tied_extra,
            backward_end=reduce * (embed + (arch.hidden_size if tied else 0)),
            end_grads_missing=4 * grad_frac * embed / world,
            optimizer=0.0,
        )
    if static.zero3 is not None:
        # Stage 3 (zero3.py): the parameters gathered at the high point of forward; in backward
        # with the gradients on their way into the reduce bucket; in the step one sub-group's
        # fp32 gradient, while the persistent parameters are partitioned too.
        stage3 = static.zero3
        fwd = static.buffers_step + stage3.gathered_forward
        bwd = static.buffers_step + stage3.gathered_backward
        step = static.buffers_step + stage3.step_above_start
        return Sharding(fwd, bwd, bwd, bwd, bwd, bwd, 0.0, step)
    buffers = static.buffers_step
    return Sharding(buffers, buffers, buffers, buffers, buffers, buffers, 0.0, buffers)
