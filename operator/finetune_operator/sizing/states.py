"""The state that lives through the whole step, per GPU: weights, gradients, optimizer states and
master weights as each strategy stores and shards them (DDP, FSDP, DeepSpeed ZeRO 1-3 through
zero3.py), the buffers alive throughout, what is offloaded to the host or paged to unified
memory, and the NF4 quantisation state of QLoRA. The optimizer step's temporaries are here too:
they are sized from the largest gradient this state holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetune_trainer import optimizers

from . import constants as K
from . import optimizer_state, saved_modules, zero3
from .architecture import ModelArchitecture
from .regime import Regime
from .setup import TrainingSetup


@dataclass(frozen=True)
class StaticState:
    weights: float
    gradients: float
    optimizer: float
    master_weights: float
    buffers_step: float  # buffers alive through the whole step (DDP buckets, ZeRO buckets)
    host_offloaded: float
    unified: float = 0.0  # paged optimizer states (CUDA unified memory, outside torch's allocator)
    largest_gradient: float = 0.0  # the largest single parameter's gradient (shard), bytes
    zero3: "zero3.Zero3Memory | None" = None  # ZeRO-3's terms (its gradient partition lives through the step)


def _allocated(nbytes: float) -> int:
    """Bytes the CUDA caching allocator gives one tensor of `nbytes` (512-byte blocks)."""
    return -(-int(math.ceil(nbytes)) // 512) * 512


def nf4_weight_quant_state_bytes(numel: int) -> int:
    """One NF4 weight's quantisation state (constants.py: double quantisation) as bitsandbytes
    allocates it: ceil(n/64) uint8 absmax, ceil of that /256 fp32 second-level absmax, an fp32
    offset and the two fp32 code tables, each tensor in whole 512-byte blocks."""
    blocks = -(-numel // K.NF4_BLOCKSIZE)
    return (_allocated(blocks) + _allocated(4 * -(-blocks // K.NF4_ABSMAX_BLOCKSIZE)) + _allocated(4)
            + _allocated(4 * K.NF4_CODE_ENTRIES) + _allocated(4 * K.NF4_ABSMAX_CODE_ENTRIES))


def nf4_quant_state_bytes(arch: ModelArchitecture) -> int:
    """The NF4 quantisation state of every quantised weight of the model (QLoRA): FSDP does not
    shard it (no parameter), so under FSDP too every GPU holds all of it."""
    def block(linears) -> int:
        return sum(nf4_weight_quant_state_bytes(lin.in_features * lin.out_features * lin.experts) for lin in linears)

    moe_layers = arch.num_moe_layers
    return moe_layers * block(arch.block_linears()) + (arch.num_layers - moe_layers) * block(arch._dense_block_linears)


def _optimizer_bytes_per_param(setup: TrainingSetup, regime: Regime) -> float:
    """Optimizer state per trainable parameter.

    AdamW keeps two moments in the dtype of what it trains: fp32 (8 bytes) for fp32 master
    weights and for adapters, bf16 (4 bytes) with bf16 master weights, plus Kahan's bf16
    compensation buffer (2 bytes) when the update rounding is kahan. The low-bit optimizers
    (bitsandbytes' and torchao's): block-wise quantised moments of the large tensors, the rest
    in the weights' dtype, tensor by tensor (optimizer_state.py), as an average per parameter.
    """
    kind = optimizers.kind(setup.optimizer)
    if kind.quantised is not None:
        groups = optimizer_state.trained_tensors(setup.architecture, setup.method, setup.lora_rank,
                                                 _targets(setup.lora_targets), saved_modules.of_setup(setup))
        full_bytes = 2.0 if regime.master_bf16 else 4.0
        trained = sum(g.numel * g.count for g in groups)
        return optimizer_state.state_bytes(kind, groups, full_bytes) / trained
    if regime.master_bf16:
        return 4.0 + (2.0 if setup.update_rounding == "kahan" else 0.0)
    return 8.0


def _largest_trainable(setup: TrainingSetup) -> int:
    """Elements of the largest trainable parameter (what a per-parameter step handles at once)."""
    arch = setup.architecture
    if setup.method == "full":
        # Fused 3-D expert weights are one parameter each.
        return max(arch.vocab_size * arch.hidden_size, max(lin.params for lin in arch.block_linears()))
    rank = setup.lora_rank
    blocks = [rank * max(lin.in_features, lin.out_features) * (lin.experts if lin.name.startswith("experts.") else 1)
              for lin in arch.resolve_lora_targets(setup.lora_targets)]
    # Outside the blocks: the trained copies of lora.modulesToSave and the head's adapter.
    return max(blocks + [saved_modules.largest_trainable(arch, rank, setup.lora_targets, saved_modules.of_setup(setup))])


def static_state(setup: TrainingSetup, regime: Regime) -> StaticState:
    arch, world = setup.architecture, setup.world_size
    params = arch.total_params
    strategy = setup.strategy
    optimizer_pp = _optimizer_bytes_per_param(setup, regime)
    offload_optimizer = setup.offload in ("optimizer", "optimizer+params")
    offload_params = setup.offload == "optimizer+params"
    host = 0.0
    largest = _largest_trainable(setup)

    if strategy == "zero3":
        # Stage 3's partitions, persistent parameters and reduce bucket, from the module trace
        # and the settings the trainer's DeepSpeed config writes (zero3.py). QLoRA's quantisation
        # state is no parameter: ZeRO-3 does not partition it, every GPU holds all of it.
        stage3 = _zero3(setup, regime)
        quant_state = float(nf4_quant_state_bytes(arch)) if setup.method == "qlora" else 0.0
        return StaticState(stage3.weights + stage3.persistent + quant_state, stage3.gradients, stage3.optimizer,
                           stage3.master, stage3.reduce_bucket, stage3.host,
                           largest_gradient=regime.compute * largest / world, zero3=stage3)
    if setup.method == "full":
        if strategy in ("zero1", "zero2"):
            # DeepSpeed keeps the compute-dtype weights and gradients, and an fp32 master
            # copy beside fp32 Adam states, each divided by the stage's divisor.
            weight_bytes = float(regime.compute)
            master_pp = 4 if regime.compute == 2 else 0
            weights = weight_bytes * params
            grad_shards = world if strategy == "zero2" else 1
            grads = weight_bytes * params / grad_shards
            master = master_pp * params / world
            opt = optimizer_pp * params / world
            buffers = _zero_buckets(weight_bytes)
            if offload_optimizer:
                host += master + opt
                master, opt = 0.0, 0.0
            return StaticState(weights, grads, opt, master, buffers, host,
                           largest_gradient=weight_bytes * largest / grad_shards)
        # DDP / FSDP: the weights the optimizer updates are the model's weights (fp32, or bf16
        # with bf16 master weights), gradients in the same dtype.
        weight_bytes = 2.0 if regime.master_bf16 else 4.0
        shards = world if strategy == "fsdp" else 1
        weights = weight_bytes * params / shards
        grads = weight_bytes * params / shards
        opt = optimizer_pp * params / shards
        buffers = weight_bytes * params if (strategy == "ddp" and world > 1 and K.DDP_BUCKETS_COPY_GRADIENTS) else 0.0
        unified = 0.0
        if optimizers.kind(setup.optimizer).paged:
            unified, opt = opt, 0.0
        if offload_optimizer:
            host += opt
            opt = 0.0
        if offload_params:
            host += weights + grads
            weights, grads = 0.0, 0.0
        return StaticState(weights, grads, opt, 0.0, buffers, host, unified, weight_bytes * largest / shards)

    # LoRA / QLoRA: frozen base, fp32 adapters (and the fp32 copies of lora.modulesToSave) with
    # their own grads and states.
    trainable = arch.lora_trainable_params(setup.lora_rank, setup.lora_targets) + saved_modules.of_setup(setup).params
    base_bytes = 4 if regime.compute == 4 else 2
    if setup.method == "qlora":
        linear = arch.linear_params
        # The rest: fp32 under DDP (prepare_model_for_kbit_training), the compute dtype under FSDP.
        rest_bytes = regime.residual if strategy != "fsdp" else regime.compute
        base = K.NF4_PACKED_BYTES_PER_PARAM * linear + rest_bytes * (params - linear)
        # The quantisation state is no parameter: FSDP neither shards nor gathers it, so every
        # GPU holds all of it (as every DDP replica does).
        quant_state = float(nf4_quant_state_bytes(arch))
    else:
        base = base_bytes * params
        quant_state = 0.0
    shards = world if strategy == "fsdp" else 1
    weights = (base + 4 * trainable) / shards
    grad_shards = world if strategy in ("fsdp", "zero2") else 1
    grads = 4.0 * trainable / grad_shards
    opt_shards = 1 if strategy == "ddp" else world
    opt = optimizer_pp * trainable / opt_shards
    if strategy.startswith("zero"):
        buffers = _zero_buckets(4.0)
    else:
        buffers = 4.0 * trainable if (strategy == "ddp" and world > 1) else 0.0
    unified = 0.0
    if optimizers.kind(setup.optimizer).paged:
        unified, opt = opt, 0.0
    if offload_optimizer:
        host += opt
        opt = 0.0
    if offload_params:  # fsdp: the sharded base and adapters live on the host
        host += weights
        weights = 0.0
    weights += quant_state  # on the GPU whatever FSDP offloads (it moves parameters only)
    return StaticState(weights, grads, opt, 0.0, buffers, host, unified, 4.0 * largest / grad_shards)


def _targets(targets) -> str | tuple[str, ...]:
    """The setup's LoRA targets in a hashable form (a list comes in from the API)."""
    return targets if isinstance(targets, str) else tuple(targets)


def _zero_buckets(grad_bytes: float) -> float:
    """DeepSpeed ZeRO-1/2's buffers alive through the step, with the bucket size the trainer's
    config sets (contract.ZERO_SETTINGS; overlap_comm and contiguous_gradients on).

    Measured on DeepSpeed's own code (bench/zero_truth.py, CPU, gloo, 1-2 ranks): stages 1/2
    allocate two reduce buckets of reduce_bucket_size elements (overlap_comm's double buffer)
    whatever the model's size. Stage 3 is zero3.py's.
    """
    return grad_bytes * 2 * K.ZERO_REDUCE_BUCKET_ELEMENTS


def _zero3(setup: TrainingSetup, regime: Regime) -> zero3.Zero3Memory:
    """Stage 3 per rank (zero3.py) for this setup's model, method and world size."""
    trace = zero3.decoder_trace(setup.architecture, setup.method, setup.lora_rank,
                                _targets(setup.lora_targets),
                                setup.method != "full" and setup.lora_dropout > 0, setup.gradient_checkpointing)
    return zero3.rank_memory(trace, world=setup.world_size, compute_bytes=regime.compute,
                             optimizer_bytes_per_param=_optimizer_bytes_per_param(setup, regime),
                             offload=setup.offload, settings=K.ZERO_SETTINGS)


def optimizer_step_temporaries(setup: TrainingSetup, regime: Regime, static: StaticState) -> float:
    """Transient bytes of one optimizer step. Fused torch AdamW (what the trainer runs) and
    bitsandbytes' kernels update in place; torch's foreach AdamW (a published setup's, when the
    setup says so) holds the square roots of a whole parameter group's second moments at once:
    the fp32 values this GPU steps (one parameter with the step in backward). The trainer's bf16
    AdamW (bf16_adamw.py) computes one parameter at a time in fp32 (gradient, both moments, the
    old weight, and for stochastic rounding the random bits and the rounded value): bytes per
    element of the largest parameter's shard. torchao's low-bit AdamW steps one parameter at a
    time too (`step_temp_bytes_per_value`)."""
    kind = optimizers.kind(setup.optimizer)
    copies = optimizers.ADAMW_GROUP_MOMENT_COPIES[setup.adamw_implementation]
    if copies:
        # The group counted whole: the no-decay group (norms, biases) is under 0.1% of it. Its fp32
        # gradients are what this GPU holds of it (offloaded ones step on the host).
        return copies * (static.largest_gradient if setup.optimizer_in_backward else static.gradients)
    if kind.step_temp_bytes_per_value:
        return kind.step_temp_bytes_per_value * static.largest_gradient / (2.0 if regime.master_bf16 else 4.0)
    if not regime.master_bf16 or setup.optimizer != "adamw":
        return 0.0
    elements = static.largest_gradient / 2.0  # bf16 gradients: 2 bytes per element
    if K.BF16_ADAMW_STEP_SLICE_ELEMENTS:
        elements = min(elements, K.BF16_ADAMW_STEP_SLICE_ELEMENTS)
    per_element = K.BF16_ADAMW_STEP_TEMP_BYTES + K.BF16_ADAMW_ROUNDING_TEMP_BYTES[setup.update_rounding]
    return per_element * elements
