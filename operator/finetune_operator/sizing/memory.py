"""The per-GPU memory model of one training step, as our trainer runs it.

The estimate follows a step through its three phases and adds up, for each, the
tensors alive at its high point:

* forward (end of the forward, inside the loss): weights, optimizer states, every
  tensor autograd saved for backward, the autocast weight copies, logits and loss;
* backward: the larger of its start (all saved activations still alive, the loss
  gradient of b x s x vocab in fp32 at its widest) and its end (all gradients, DDP
  buckets, the embedding gradient);
* optimizer step: weights, gradients and states (fused AdamW has no temporaries).

`estimate_memory` reads as that recipe; the terms come from the modules named for them:
regime.py (how the setup stores its tensors), states.py (weights, gradients, optimizer
states, their sharding and offloading, the step's temporaries), activations.py (what
autograd saves, enumerated per decoder block from the shapes, following the modules
transformers runs), sharding.py (FSDP's and ZeRO-3's gathered parameters and gradients
in flight at each moment), zero3.py (ZeRO-3 replayed). The figures are peak *allocated*
bytes (what `torch.cuda.max_memory_allocated` reports); the required bytes add the
fragmentation factor and the fixed reserves of constants.py.

How each part was checked:

* Traced (bench/sizing_truth.py, fake tensors on the CPU emulating the CUDA allocator's
  rounding, flash attention and fused dropout; bench/sizing_accuracy.py prints the
  table): full fine-tuning and LoRA, single GPU, DDP (the Reducer's buckets, which run
  in C++ outside the dispatcher, are allocated as the Reducer does), FSDP2 with
  transformers' plan at 2-8 ranks, checkpointing on and off, sdpa and eager, Llama,
  Qwen2, Mistral, Phi-3 and Gemma 2, the families of issue 16 and phi / gpt_neox (issue 28;
  their terms are in families.py), lora.modulesToSave and LoRA on the head (issue 28;
  saved_modules.py). The FSDP moments (head and block
  reduce-scatters, the embedding group kept gathered until the root forward returns)
  and the tied-embedding gradient accumulation were read off traced timelines.
* Derived, not traced: DeepSpeed ZeRO (its partitioning runs in its own C++/CUDA
  code; the terms are its documented storage: bf16 weights and grads, fp32 master and
  Adam states, each divided by the stage's divisor, plus the buckets the trainer's
  DeepSpeed config sets explicitly, contract.deepspeed_config),
  QLoRA and 8-bit optimizers (bitsandbytes needs CUDA; the terms are the NF4 and
  blockwise 8-bit storage sizes, with the dtypes peft's prepare_model_for_kbit_training
  leaves), Mixtral (expert routing is data-dependent, which fake tensors cannot follow;
  tokens are assumed evenly routed). tests/sizing/test_memory.py checks these against
  hand-computed values; bench/sizing_gpu.py measures QLoRA and 8-bit Adam on a GPU.
* The levers of a lean trainer, each a named term: bf16 master weights (states.py:
  `static_state`, `_optimizer_bytes_per_param`, `optimizer_step_temporaries`: 2-byte weights,
  gradients and moments, Kahan's buffer, the bf16 AdamW's per-parameter fp32 temporaries), the
  optimizer step in backward (`_gradients`: one gradient at a time), the chunked loss
  (activations.py's `logits_bytes`: one chunk of logits), activation offloading
  (`SavedActivations.offloaded_to_host`: the kept block inputs go to host memory), paged 8-bit
  AdamW (`StaticState.unified`: outside the allocator, counted on the host), QLoRA under FSDP
  (`static_state`, `sharding_of`: the 4-bit base sharded and gathered per block) and under
  ZeRO-3 (zero3.py: the 4-bit codes as bf16 storage, partitioned and gathered like any bf16
  parameter; checked against DeepSpeed on the CPU with emulated 4-bit layers).
  `lever_savings` says what each saves.
* Not modelled: what lies outside the allocator's peak (CUDA context, cuBLAS
  workspaces, NCCL buffers, allocator caching) is the fragmentation factor and reserve
  of constants.py, which bench/sizing_gpu.py calibrates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from finetune_trainer import optimizers
from finetune_trainer.memory_levers import Levers, levers_of, savings

from . import constants as K
from . import saved_modules
from .allocator import required_factor
from .activations import SavedActivations, saved_activations, ulysses_exchange_per_token
from .errors import SizingError
from .regime import Regime, regime_of
from .setup import TrainingSetup
from .sharding import Sharding, sharding_of
from .states import StaticState, optimizer_step_temporaries, static_state

PHASES = ("forward", "backward", "optimizer")
# Breakdown keys, in the order a person reads them.
TERMS = (
    "weights",
    "gradients",
    "optimizer",
    "master_weights",
    "weight_copies",
    "activations",
    "lora_activations",
    "logits",
    "buffers",
    "optimizer_step",
)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-GPU memory of one setup. `breakdown` holds the terms at the peak phase; they sum to the peak."""

    peak_allocated_bytes: int
    required_bytes: int
    peak_phase: str
    breakdown: Mapping[str, int]
    host_required_bytes: int
    notes: tuple[str, ...] = ()
    phase_peaks: Mapping[str, int] = field(default_factory=dict)
    fragmentation_factor: float = 1.0  # GPU memory needed over allocated: allocator.required_factor(setup)
    reserve_bytes: int = 0
    # Paged 8-bit AdamW states live in CUDA unified memory (cudaMallocManaged): torch's
    # allocator never sees them, so they are not in the peak above (max_memory_allocated)
    # nor in required_bytes; the driver keeps them on the GPU while it has room and pages
    # them to host memory otherwise, so the host figure counts them. Device-level used
    # memory (nvidia-smi) shows what of them is resident.
    unified_memory_bytes: int = 0
    # Bytes the setup keeps in host memory in place of GPU memory (activation offloading).
    activation_offload_bytes: int = 0

    def to_json(self) -> dict:
        """The JSON contract of `finetune-operator estimate -o json`."""
        return {
            "perGPU": {
                "peakAllocatedBytes": int(self.peak_allocated_bytes),
                "requiredBytes": int(self.required_bytes),
                "peakPhase": self.peak_phase,
                "breakdown": {k: int(v) for k, v in self.breakdown.items()},
                "phasePeaks": {k: int(v) for k, v in self.phase_peaks.items()},
                "fragmentationFactor": self.fragmentation_factor,
                "reserveBytes": int(self.reserve_bytes),
            },
            "host": {"requiredBytes": int(self.host_required_bytes),
                     "activationOffloadBytes": int(self.activation_offload_bytes)},
            "unifiedMemoryBytes": int(self.unified_memory_bytes),
            "notes": list(self.notes),
        }


# ---- the estimate ---------------------------------------------------------------------


def _notes(setup: TrainingSetup) -> list[str]:
    arch = setup.architecture
    notes: list[str] = []
    if setup.sequence_length > arch.max_position_embeddings:
        notes.append(
            f"sequence_length {setup.sequence_length} exceeds the model's context "
            f"({arch.max_position_embeddings}); the estimate assumes it runs anyway"
        )
    if arch.attn_logit_softcapping and setup.attention == "sdpa":
        notes.append("transformers' sdpa rejects attention soft-capping (Gemma 2); estimated as eager")
    elif arch.traits.eager_only and setup.attention == "sdpa":
        notes.append(f"transformers has no sdpa for {arch.family} (attention sinks); estimated as eager, as the trainer runs it")
    optimizer = optimizers.kind(setup.optimizer)
    if setup.method == "qlora" or optimizer.library == "bitsandbytes":
        notes.append("bitsandbytes (qlora / 8-bit optimizers) needs CUDA; derived from storage sizes, not traced")
    if optimizer.library == "torchao":
        notes.append("torchao's low-bit AdamW states sized tensor by tensor as torchao quantises them (checked against"
                     " its states on the CPU); its per-parameter fp32 step temporaries are derived, not traced")
    if optimizer.paged:
        notes.append("paged 8-bit AdamW states live in CUDA unified memory: not in the allocator's peak (the figure"
                     " torch.cuda.max_memory_allocated reports) nor in the required GPU memory; the driver pages"
                     " them to host memory when the GPU is full, and host memory counts them")
    if setup.strategy == "zero3" and setup.method == "qlora":
        notes.append("QLoRA under ZeRO-3: the 4-bit codes partitioned as bf16 storage (checked against DeepSpeed on the"
                     " CPU with emulated 4-bit layers, bench/zero_truth.py --qlora), the quantisation state whole on"
                     " every GPU")
    if setup.strategy == "zero3":
        notes.append("DeepSpeed ZeRO-3 replayed from the settings the trainer's DeepSpeed config writes (partitions,"
                     " persistent parameters, prefetch and reuse of gathered parameters, reduce bucket, optimizer"
                     " sub-groups; sizing/zero3.py), checked against DeepSpeed's own code on the CPU (bench/zero_truth.py)")
    elif setup.strategy.startswith("zero"):
        notes.append("DeepSpeed ZeRO terms use the bucket sizes the trainer's DeepSpeed config sets, as DeepSpeed's own"
                     " code allocates them on the CPU (bench/zero_truth.py); its states are derived, not traced at size")
    if setup.activation_offloading:
        notes.append("activation offloading keeps each checkpointed block input in host memory; host memory counts it")
    if arch.is_moe and arch.traits.moe != "mixtral":
        # transformers' grouped_mm experts hold tokens x top-k rows however the tokens are routed.
        notes.append("mixture-of-experts layers sized as transformers' grouped_mm experts run them (traced)")
    elif arch.is_moe:
        notes.append("mixture-of-experts activations assume evenly routed tokens; derived, not traced")
    if arch.is_moe:
        if setup.method != "full" and setup.lora_dropout > 0 and any(
                lin.experts > 1 for lin in arch.resolve_lora_targets(setup.lora_targets)):
            notes.append("peft's expert adapters (all-linear on Mixtral and Qwen3-MoE) refuse lora dropout > 0")
    return notes


def estimate_memory(setup: TrainingSetup) -> MemoryEstimate:
    """Per-GPU peak allocated bytes of one training step, with the terms at the peak.

    Read it as the recipe of a step: the state that lives throughout (weights, gradients,
    optimizer states), then forward, backward and the optimizer step, each with the
    tensors alive at its high point; a lever changes the terms it names.
    """
    arch = setup.architecture
    profiled = getattr(arch, "profiled", None)
    if profiled is not None:
        # A family only the pre-flight profile knows: its measured figures (profiling/estimate.py).
        return profiled.estimate(setup)
    notes = _notes(setup)
    if (arch.attn_logit_softcapping or arch.traits.eager_only) and setup.attention == "sdpa":
        setup = replace(setup, attention="eager")
    regime = regime_of(setup)
    static = static_state(setup, regime)
    parts = _StepParts(
        setup=setup, regime=regime, static=static, sharding=sharding_of(setup, regime, static),
        saved=saved_activations(setup, regime), copies=_weight_copies(setup, regime),
        dequant=_dequantised_weight(setup, regime), grads=_gradients(setup, static),
        step_temporaries=optimizer_step_temporaries(setup, regime, static),
    )
    phases = {"forward": _forward(parts), "backward": _backward(parts), "optimizer": _optimizer_step(parts)}
    if static.zero3 is not None:
        # ZeRO-3 allocates its gradient partition once, at start-up: it is there in every phase,
        # and a gradient on its way there is in the replayed buffers (zero3.py).
        for terms in phases.values():
            terms["gradients"] = static.gradients
    totals = {k: round(sum(v.values())) for k, v in phases.items()}
    peak_phase = max(PHASES, key=lambda k: totals[k])
    breakdown = {k: int(round(v)) for k, v in phases[peak_phase].items()}
    peak = sum(breakdown.values())

    reserve = K.CUDA_CONTEXT_RESERVE_BYTES + (K.NCCL_RESERVE_BYTES if setup.world_size > 1 else 0)
    offloaded_to_host = parts.saved.offloaded_to_host
    factor = required_factor(setup)
    return MemoryEstimate(
        peak_allocated_bytes=peak,
        required_bytes=int(math.ceil(peak * factor)) + reserve,
        fragmentation_factor=factor,
        peak_phase=peak_phase,
        breakdown=breakdown,
        host_required_bytes=_host_bytes(setup, static, offloaded_to_host),
        notes=tuple(notes),
        phase_peaks=totals,
        reserve_bytes=reserve,
        unified_memory_bytes=int(round(static.unified)),
        activation_offload_bytes=int(round(offloaded_to_host)),
    )


# ---- the parts the phases are assembled from ---------------------------------------------


@dataclass(frozen=True)
class _WeightCopies:
    """Compute-dtype copies of weights that autocast (or peft) makes, bytes at each moment."""

    forward: float  # all alive at the end of the forward
    backward_start: float
    block: float  # one block's, alive while its backward runs


@dataclass(frozen=True)
class _Gradients:
    """The gradients as the moments of backward hold them, bytes."""

    all: float  # every gradient (the step in backward: only the largest one)
    block: float  # one block's
    embedding: float  # the input embedding's (full fine-tuning, untied)


@dataclass(frozen=True)
class _StepParts:
    """What the phases of one step are assembled from, each worked out once."""

    setup: TrainingSetup
    regime: Regime
    static: StaticState
    sharding: Sharding
    saved: SavedActivations
    copies: _WeightCopies
    dequant: float  # one 4-bit weight dequantised for its matmul (QLoRA)
    grads: _Gradients
    step_temporaries: float  # one optimizer step's transients (states.py)

    @property
    def tokens(self) -> int:
        return self.setup.tokens_per_micro_batch

    def resting(self) -> dict[str, float]:
        """Every term, zero but the state that lives through the step (in TERMS order: the sums add in it)."""
        static = self.static
        return dict(dict.fromkeys(TERMS, 0.0), weights=static.weights, optimizer=static.optimizer,
                    master_weights=static.master_weights)


def _weight_copies(setup: TrainingSetup, regime: Regime) -> _WeightCopies:
    arch = setup.architecture
    embed = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embed
    lora_params = 0 if setup.method == "full" else arch.lora_trainable_params(setup.lora_rank, setup.lora_targets)
    if regime.autocast_fp32_weights:
        # Cached bf16 copies of every fp32 weight: all alive at the end of the forward; without
        # checkpointing the graph keeps them until each block's backward.
        head_copy = 2 * (head or embed)
        copies_fwd = 2 * arch.linear_params + head_copy
        copies_bwd_start = copies_fwd if not setup.gradient_checkpointing else head_copy
        copies_block = 2 * arch.block_params
    elif regime.lora and regime.compute == 2:
        # Cached bf16 copies of the fp32 adapters (FSDP gathers them in bf16 already).
        # (ZeRO-3: DeepSpeed casts the adapters to bf16 with the model and keeps their fp32
        # master copy in the optimizer, zero3.py; nothing to cast per forward.)
        copies_fwd = 0.0 if setup.strategy in ("fsdp", "zero3") else 2 * lora_params
        if regime.qlora and setup.strategy not in ("fsdp", "zero3"):
            # The frozen fp32 head is cast on every call (not cached: it needs no grad) and
            # the cast is saved for the input gradient; a trained copy of the head
            # (lora.modulesToSave) is cast in its place, cached, as large.
            copies_fwd += 2 * embed
        elif saved_modules.of_setup(setup).head and not setup.strategy.startswith("zero"):
            # The trained fp32 copy of the head (lora.modulesToSave): autocast's cached cast of it,
            # kept by the graph until the head's backward (DeepSpeed holds the copy in bf16 already).
            copies_fwd += 2 * embed
        copies_bwd_start = copies_fwd
        copies_block = 0.0
    else:
        copies_fwd = copies_bwd_start = copies_block = 0.0
    return _WeightCopies(copies_fwd, copies_bwd_start, copies_block)


def _dequantised_weight(setup: TrainingSetup, regime: Regime) -> float:
    if not regime.qlora:
        return 0.0
    # bitsandbytes dequantises each 4-bit weight to the compute dtype for its matmul.
    return 2 * max(lin.params // lin.experts for lin in setup.architecture.block_linears())


def _gradients(setup: TrainingSetup, static: StaticState) -> _Gradients:
    arch = setup.architecture
    embed = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embed
    if setup.optimizer_in_backward:
        # Lever: each parameter's step runs in backward the moment its gradient is complete,
        # and the gradient is freed: at most the largest one exists (and its step's temporaries).
        return _Gradients(static.largest_gradient, 0.0, 0.0)
    block_grad = static.gradients * arch.block_params / arch.total_params
    embed_grad = static.gradients * embed / arch.total_params if (setup.method == "full" and head) else 0.0
    return _Gradients(static.gradients, block_grad, embed_grad)


# ---- the phases -------------------------------------------------------------------------


def _forward(parts: _StepParts) -> dict[str, float]:
    """At the end of the forward, inside the loss."""
    setup, regime, saved, tokens = parts.setup, parts.regime, parts.saved, parts.tokens
    forward = parts.resting()
    forward.update(activations=saved.kept + saved.shared + saved.around, lora_activations=saved.kept_lora,
                   weight_copies=parts.copies.forward, logits=saved.logits_forward_per_token * tokens,
                   buffers=parts.sharding.forward + parts.dequant)
    if setup.attention == "eager":
        # Inside the last block's eager attention, before the head: the masked scores, the
        # logits they are joined into and the softmax exist at once (gpt-oss at 8192 tokens:
        # 8 GiB each; seen under FSDP with checkpointing).
        scores = regime.compute * setup.architecture.num_attention_heads * (setup.row_length + 1) * tokens
        in_attention = dict(forward, logits=0.0, activations=forward["activations"] + 3 * scores)
        if sum(in_attention.values()) > sum(forward.values()):
            forward = in_attention
    return forward


def _backward(parts: _StepParts) -> dict[str, float]:
    """The largest of backward's moments."""
    setup, regime, saved, tokens = parts.setup, parts.regime, parts.saved, parts.tokens
    arch, sharding, copies, dequant = setup.architecture, parts.sharding, parts.copies, parts.dequant
    hidden = arch.hidden_size
    embed = arch.vocab_size * hidden
    kept, shared, recompute = saved.kept, saved.shared, saved.recompute
    # At its start: all that forward saved, the loss gradient at its widest.
    bwd_start = parts.resting()
    bwd_start.update(activations=kept + shared + saved.around - saved.block_input, lora_activations=saved.kept_lora,
                     weight_copies=copies.backward_start, logits=saved.logits_backward_per_token * tokens,
                     buffers=sharding.backward_start + dequant)
    candidates = [bwd_start]
    # Right after the head's backward (FSDP reduces its gradient): activations still alive.
    head_reduce = dict(bwd_start, logits=0.0, buffers=sharding.head_reduce + dequant)
    candidates.append(head_reduce)
    # The trained copy of the head (lora.modulesToSave): its weight gradient in its backward.
    head_grad = saved_modules.head_backward_bytes(arch, regime.compute, tokens, saved_modules.of_setup(setup))
    if head_grad:
        candidates.append(dict(bwd_start, logits=0.0, gradients=head_grad))
    # A block's backward holds gradients of its MLP intermediates (the product, the
    # activation's output, up and gate: about three b x s x intermediate at once).
    moe_k = arch.experts_per_token if arch.is_moe else 1
    block_bwd = 3 * regime.mlp * arch.expert_intermediate_size * moe_k * tokens
    # ... and the gradient of the residual stream: the one flowing in and the one being built.
    block_bwd += 2 * regime.residual * hidden * tokens
    # ... and, under sequence parallelism, Ulysses' exchange around the block's attention.
    block_bwd += ulysses_exchange_per_token(arch, setup, regime) * tokens
    if setup.attention == "eager":
        # ... and eager attention's softmax backward: the scores' gradient, as large as the
        # probabilities (gpt-oss at 8192 tokens: 8 GiB a block; seen under FSDP with checkpointing).
        block_bwd += regime.compute * arch.num_attention_heads * (setup.row_length + 1) * tokens
    if not setup.gradient_checkpointing:
        # The first block's backward: everything else forward saved is still alive.
        first = dict(bwd_start, logits=0.0, activations=bwd_start["activations"] + block_bwd,
                     buffers=sharding.backward_mid + dequant)
        candidates.append(first)
    if setup.gradient_checkpointing:
        # In the middle: a block recomputed on top of the kept inputs.
        mid = parts.resting()
        mid.update(activations=kept + shared + recompute + block_bwd,
                   weight_copies=copies.backward_start + copies.block, buffers=sharding.backward_mid + dequant)
        candidates.append(mid)
        candidates.append(dict(mid, activations=kept + shared, buffers=sharding.block_reduce + dequant))
    # At its end: every gradient exists. Two moments compete: block 0's backward (its
    # recompute and weight-gradient transients alive, its own gradients not yet) and the
    # embedding's backward (all gradients).
    grads = parts.grads
    block0 = parts.resting()
    block0.update(gradients=grads.all - grads.block - grads.embedding, activations=recompute + shared + block_bwd,
                  weight_copies=copies.block, buffers=sharding.backward_mid + dequant)
    if setup.method == "full" and not setup.gradient_checkpointing:
        block0["activations"] = saved.block_per_token * tokens + shared + block_bwd  # block 0's own saved tensors
    # Under FSDP a dense block's linears are small next to the block terms above; a fused expert
    # weight is most of its block, and its gradient and cast show (gpt-oss-20b, Qwen3-30B-A3B full).
    if regime.autocast_fp32_weights or (setup.method == "full" and (setup.strategy != "fsdp" or arch.is_moe)):
        # A linear's weight gradient in the compute dtype and its cast to the weight's dtype.
        weight_grad_bytes = regime.compute + (2 if regime.master_bf16 else 4)
        block0["gradients"] += weight_grad_bytes * max(lin.params for lin in arch.block_linears())
    candidates.append(block0)
    bwd_end = parts.resting()
    all_grads = grads.all
    if setup.method == "full" and arch.tie_word_embeddings and setup.strategy != "fsdp" \
            and not setup.optimizer_in_backward:
        # Tied: the embedding's dense V x h gradient is added to the head's out of place,
        # so the old gradient, the new one and their sum exist together for a moment.
        all_grads += 2 * (2 if regime.master_bf16 else 4) * embed
    missing = 0.0 if setup.optimizer_in_backward else sharding.end_grads_missing
    bwd_end.update(gradients=all_grads - missing, buffers=sharding.backward_end + dequant)
    if setup.optimizer_in_backward:
        bwd_end["optimizer_step"] = parts.step_temporaries  # the largest parameter's step, inside backward
    candidates.append(bwd_end)
    return max(candidates, key=lambda d: sum(d.values()))


def _optimizer_step(parts: _StepParts) -> dict[str, float]:
    optimizer = parts.resting()
    if parts.setup.optimizer_in_backward:
        optimizer.update(buffers=parts.sharding.optimizer)  # the steps already ran; no gradients remain
    else:
        optimizer.update(gradients=parts.static.gradients, buffers=parts.sharding.optimizer,
                         optimizer_step=parts.step_temporaries)
    return optimizer


def _host_bytes(setup: TrainingSetup, static: StaticState, offloaded_activations: float) -> int:
    """Host RAM one training process (one GPU) needs: runtime, the weights while loading, offloaded state, data.

    Loading follows the trainer: without a sharded strategy from_pretrained materialises the
    whole model in host memory in its load dtype (fp32 for full fine-tuning with fp32
    master weights, the compute dtype otherwise) before it moves to the GPU; FSDP
    (transformers' DistributedConfig) and ZeRO-3 (zero.Init) load each rank's part shard by
    shard; QLoRA quantises shard by shard. Paged optimizer states may all be paged out to
    host memory, and offloaded activations live there.
    """
    arch = setup.architecture
    params = arch.total_params
    full_fp32 = setup.method == "full" and setup.master_weights == "fp32"
    load_bytes = 4 if (full_fp32 or setup.precision == "fp32") else 2
    if setup.method == "qlora":
        loading = K.HOST_SHARD_BYTES
    elif setup.strategy in ("fsdp", "zero3"):
        loading = load_bytes * params / setup.world_size + K.HOST_SHARD_BYTES
    else:
        loading = load_bytes * params
    return int(K.HOST_PROCESS_BYTES + K.HOST_DATALOADER_BYTES + loading + static.host_offloaded
               + static.unified + offloaded_activations)


# ---- what each lever saves --------------------------------------------------------------


def lever_savings(setup: TrainingSetup, estimator=None) -> dict[str, int]:
    """Per-GPU required bytes each lever in use saves (memory_levers.savings): the estimate with
    that lever alone turned off, less the setup's own."""
    estimate = estimator or estimate_memory

    def required(levers: Levers) -> int | None:
        try:
            return estimate(replace(setup, **levers.setup_fields())).required_bytes
        except SizingError:
            return None

    return savings(levers_of(setup), estimate(setup).required_bytes, required)
