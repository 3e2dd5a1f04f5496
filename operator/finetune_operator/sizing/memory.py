"""The per-GPU memory model of one training step, as our trainer runs it.

The estimate follows a step through its three phases and adds up, for each, the
tensors alive at its high point:

* forward (end of the forward, inside the loss): weights, optimizer states, every
  tensor autograd saved for backward, the autocast weight copies, logits and loss;
* backward: the larger of its start (all saved activations still alive, the loss
  gradient of b x s x vocab in fp32 at its widest) and its end (all gradients, DDP
  buckets, the embedding gradient);
* optimizer step: weights, gradients and states (fused AdamW has no temporaries).

Saved activations are enumerated per decoder block from the shapes, following the
modules transformers runs (see `_block_saved_bytes_per_token`). The figures are
peak *allocated* bytes (what `torch.cuda.max_memory_allocated` reports); the
required bytes add the fragmentation factor and the fixed reserves of constants.py.

How each part was checked:

* Traced (bench/sizing_truth.py, fake tensors on the CPU emulating the CUDA allocator's
  rounding, flash attention and fused dropout; bench/sizing_accuracy.py prints the
  table): full fine-tuning and LoRA, single GPU, DDP (the Reducer's buckets, which run
  in C++ outside the dispatcher, are allocated as the Reducer does), FSDP2 with
  transformers' plan at 2-8 ranks, checkpointing on and off, sdpa and eager, Llama,
  Qwen2, Mistral, Phi-3 and Gemma 2. The FSDP moments (head and block
  reduce-scatters, the embedding group kept gathered until the root forward returns)
  and the tied-embedding gradient accumulation were read off traced timelines.
* Derived, not traced: DeepSpeed ZeRO (its partitioning runs in its own C++/CUDA
  code; the terms are its documented storage: bf16 weights and grads, fp32 master and
  Adam states, each divided by the stage's divisor, plus transformers' "auto" buckets),
  QLoRA and 8-bit optimizers (bitsandbytes needs CUDA; the terms are the NF4 and
  blockwise 8-bit storage sizes, with the dtypes peft's prepare_model_for_kbit_training
  leaves), Mixtral (expert routing is data-dependent, which fake tensors cannot follow;
  tokens are assumed evenly routed). tests/sizing/test_memory.py checks these against
  hand-computed values; bench/sizing_gpu.py measures QLoRA and 8-bit Adam on a GPU.
* Not modelled: what lies outside the allocator's peak (CUDA context, cuBLAS
  workspaces, NCCL buffers, allocator caching) is the fragmentation factor and reserve
  of constants.py, which bench/sizing_gpu.py calibrates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from . import constants as K
from .architecture import ModelArchitecture
from .setup import TrainingSetup

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
    fragmentation_factor: float = K.FRAGMENTATION_FACTOR
    reserve_bytes: int = 0

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
            "host": {"requiredBytes": int(self.host_required_bytes)},
            "notes": list(self.notes),
        }


# ---- shapes -------------------------------------------------------------------


@dataclass(frozen=True)
class _Regime:
    """How tensors are stored in this setup (derived once from the setup)."""

    compute: int  # bytes of the compute dtype (bf16/fp16: 2, fp32: 4)
    residual: int  # bytes of the residual stream between blocks
    autocast_fp32_weights: bool  # fp32 weights cast per op by autocast (full FT without FSDP/ZeRO)
    weights_trainable: bool  # full fine-tuning
    lora: bool
    qlora: bool
    mlp: int  # bytes of the MLP's intermediate tensors


def _regime(setup: TrainingSetup) -> _Regime:
    compute = 4 if setup.precision == "fp32" else 2
    full = setup.method == "full"
    qlora = setup.method == "qlora"
    # Full FT keeps fp32 weights; without FSDP/ZeRO the forward runs them under
    # autocast, so embeddings (not autocast) and the residual stream stay fp32.
    # QLoRA: peft's prepare_model_for_kbit_training casts everything not quantised
    # (embeddings, norms, head) to fp32, and bitsandbytes returns its outputs in the
    # input's dtype, so the residual stream and the MLP's tensors are fp32 as well.
    autocast_fp32 = full and setup.strategy == "ddp" and compute == 2
    residual = 4 if (autocast_fp32 or compute == 4 or qlora) else compute
    mlp = 4 if qlora else compute
    return _Regime(compute, residual, autocast_fp32, full, not full, qlora, mlp)


def _norm_saved(arch: ModelArchitecture, rg: _Regime) -> float:
    """Bytes per token one RMSNorm saves: its fp32 input, and the normalised value if the weight trains."""
    h = arch.hidden_size
    saved = 4 * h
    if rg.weights_trainable:
        # Gemma computes the whole norm in fp32; Llama-style norms cast back to the input dtype first.
        saved += 4 * h if arch.family == "gemma2" else rg.residual * h
    return saved


_INPUT_OF = {  # which tensor a block linear reads, to find adapters that share one
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
    "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "gate": "mlp_in",
    "experts.gate_up_proj": "mlp_in", "down_proj": "mlp_mid", "experts.down_proj": "mlp_mid",
}


def _lora_saved(arch: ModelArchitecture, setup: TrainingSetup, rg: _Regime) -> float:
    """Bytes per token peft's adapters save: the input each lora_A reads, and x A."""
    if not rg.lora:
        return 0.0
    r = setup.lora_rank
    dropout = setup.lora_dropout > 0
    # Under FSDP the adapters are gathered in the compute dtype with the base, so peft's
    # cast of the input to the adapter dtype is a no-op and adapters reading the same
    # tensor save that one tensor; the attention output is saved by attention already.
    shared_inputs = setup.strategy == "fsdp" and rg.compute == 2
    saved = 0.0
    seen: set[str] = set()
    for lin in arch.resolve_lora_targets(setup.lora_targets):
        if lin.name in ("experts.gate_up_proj", "experts.down_proj"):
            # Expert adapters see only their routed tokens: experts_per_token copies in all.
            saved += arch.experts_per_token * (rg.compute * lin.in_features + 4 * r)
            continue
        saved += rg.compute * r  # x A, saved by lora_B
        if dropout:
            # Dropout (CUDA's fused kernel) makes a new input per adapter and keeps a bool mask.
            saved += rg.compute * lin.in_features + lin.in_features
        elif shared_inputs:
            source = _INPUT_OF.get(lin.name, lin.name)
            if source not in seen and source != "attn_out":
                saved += rg.compute * lin.in_features
            seen.add(source)
        else:
            # peft casts the input to fp32 (the adapter dtype); autocast casts it back for
            # lora_A, and that per-adapter copy is what lora_A saves.
            saved += rg.compute * lin.in_features
    return saved


def _block_saved_bytes_per_token(arch: ModelArchitecture, setup: TrainingSetup, rg: _Regime) -> tuple[float, float]:
    """(base, lora) bytes per token that one decoder block saves for backward.

    Attention scores (eager) are per token too: they scale with the sequence length.
    """
    h, i, q, kv = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    nh, c = arch.num_attention_heads, rg.compute
    t = arch.traits
    s = setup.sequence_length

    saved = t.norms_per_layer * _norm_saved(arch, rg)
    # Gemma 2's post-attention / post-feedforward norms read the sub-layer outputs; the
    # pre-norms (two per block) feed linears. Only those two feed linears below.

    # Inputs the base linears save (only when their weights train).
    if rg.weights_trainable:
        if rg.autocast_fp32_weights:
            # Autocast casts the fp32 norm output separately for every linear that reads it.
            attn_reads = 1 if t.fused_qkv else 3
            mlp_reads = 1 if (t.fused_gate_up or arch.is_moe) else 2
            saved += (attn_reads + mlp_reads) * 2 * h
        else:
            saved += 2 * c * h  # one norm output per sub-layer, shared by its linears

    # Attention.
    if setup.attention == "eager":
        kv_saved = q if arch.num_key_value_heads < nh else kv  # repeat_kv copies
        saved += c * (q + 2 * kv_saved) + c * q  # q, repeated k/v, contiguous output
        saved += (4 + c) * nh * s  # softmax output in fp32, and its cast for probs @ v
        if arch.attn_logit_softcapping:
            saved += c * nh * s  # tanh output
    else:
        saved += c * (2 * q + 2 * kv) + 4 * nh  # q, k, v, output, logsumexp
        if t.fused_qkv:
            saved += c * (q + kv)  # v is a view: the whole fused qkv output stays alive
        if _sdpa_needs_mask(arch, setup):
            # With a mask sdpa runs the memory-efficient kernel, which converts the boolean
            # mask to the compute dtype and saves it for backward: one b x s x s per block.
            saved += c * s

    # MLP.
    if arch.is_moe:
        k = arch.experts_per_token
        saved += 4 * arch.num_experts  # router logits/probabilities (fp32)
        saved += k * (c * h + c * 2 * i + c * i + c * i + c * h)  # gathered in, gate_up, act, product, down out
    else:
        saved += 3 * rg.mlp * i  # gate (act input), act output, up
        if rg.weights_trainable:
            saved += c * i  # down's input
    return saved, _lora_saved(arch, setup, rg)


def _sdpa_needs_mask(arch: ModelArchitecture, setup: TrainingSetup) -> bool:
    """sdpa gets an explicit mask when a sliding window is shorter than the sequence (flash does windows itself)."""
    return setup.attention == "sdpa" and arch.sliding_window is not None and setup.sequence_length > arch.sliding_window


def _logits_bytes(arch: ModelArchitecture, setup: TrainingSetup, rg: _Regime) -> tuple[float, float]:
    """(forward, backward) high points of the head and loss, bytes per token.

    Forward (mixed precision): logits in bf16, the fp32 upcast for the loss, log_softmax's
    fp32 output (saved), then the upcast is freed and accelerate converts the model's
    logits to fp32: 2 + 4 + 4 = 10 bytes x vocab either way.
    Backward starts with log_softmax's saved output, nll_loss's gradient and the
    log_softmax gradient, all fp32: 12 bytes x vocab.
    """
    v = arch.vocab_size
    if rg.compute == 4:
        fwd = 8 * v  # logits, log_softmax output
    else:
        fwd = 10 * v
    bwd = 12 * v
    if arch.final_logit_softcapping:
        fwd += rg.compute * v * 2  # tanh output saved, capped logits
        bwd += rg.compute * v
    return fwd, bwd


# ---- static terms ---------------------------------------------------------------


@dataclass(frozen=True)
class _Static:
    weights: float
    gradients: float
    optimizer: float
    master_weights: float
    buffers_step: float  # buffers alive through the whole step (DDP buckets, ZeRO buckets)
    host_offloaded: float


def _linear_params(arch: ModelArchitecture) -> int:
    return arch.linear_params


def _optimizer_bytes_per_param(setup: TrainingSetup) -> float:
    if setup.optimizer == "adamw":
        return 8.0
    return K.BNB_8BIT_STATE_BYTES_PER_PARAM


def _static(setup: TrainingSetup, rg: _Regime) -> _Static:
    arch, n = setup.architecture, setup.world_size
    p = arch.total_params
    strat = setup.strategy
    opt_pp = _optimizer_bytes_per_param(setup)
    offload_opt = setup.offload in ("optimizer", "optimizer+params")
    offload_params = setup.offload == "optimizer+params"
    host = 0.0

    if setup.method == "full":
        trainable = p
        if strat in ("zero1", "zero2", "zero3"):
            # DeepSpeed bf16: 2-byte model weights and grads, fp32 master + Adam in the optimizer.
            w_b = rg.compute
            master_pp = 4 if rg.compute == 2 else 0
            weights = w_b * p / (n if strat == "zero3" else 1)
            grads = w_b * p / (n if strat in ("zero2", "zero3") else 1)
            master = master_pp * p / n
            opt = opt_pp * p / n
            h2 = arch.hidden_size ** 2
            if strat == "zero3":
                buffers = w_b * 0.9 * h2 + w_b * h2  # prefetch bucket + reduce bucket
            else:
                buffers = w_b * h2 + w_b * min(K.ZERO_ALLGATHER_BUCKET_ELEMENTS, p / n)
            if offload_opt:
                host += master + opt
                master, opt = 0.0, 0.0
            if offload_params and strat == "zero3":
                host += weights
                weights = 0.0
            return _Static(weights, grads, opt, master, buffers, host)
        w_b = 4.0  # fp32 master weights are the weights (full FT, DDP / FSDP)
        div = n if strat == "fsdp" else 1
        weights = w_b * p / div
        grads = 4.0 * p / div
        opt = opt_pp * p / div
        buffers = 4.0 * p if (strat == "ddp" and n > 1 and K.DDP_BUCKETS_COPY_GRADIENTS) else 0.0
        if offload_opt:
            host += opt
            opt = 0.0
        if offload_params:
            host += weights + grads
            weights, grads = 0.0, 0.0
        return _Static(weights, grads, opt, 0.0, buffers, host)

    # LoRA / QLoRA: frozen base, fp32 adapters with their own grads and states.
    trainable = arch.lora_trainable_params(setup.lora_rank, setup.lora_targets)
    base_b = 4 if rg.compute == 4 else 2
    if setup.method == "qlora":
        lin = _linear_params(arch)
        base = K.NF4_BYTES_PER_PARAM * lin + 4 * (p - lin)  # the rest cast to fp32 (see _regime)
    else:
        base = base_b * p
    div = n if strat in ("fsdp", "zero3") else 1
    weights = (base + 4 * trainable) / div
    grad_div = n if strat in ("fsdp", "zero2", "zero3") else 1
    grads = 4.0 * trainable / grad_div
    opt_div = 1 if strat == "ddp" else n
    opt = opt_pp * trainable / opt_div
    buffers = 4.0 * trainable if (strat == "ddp" and n > 1) else 0.0
    if offload_opt:
        host += opt
        opt = 0.0
    if offload_params:  # fsdp / zero3: the sharded base and adapters live on the host
        host += weights
        weights = 0.0
    return _Static(weights, grads, opt, 0.0, buffers, host)


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
    if setup.method == "qlora" or setup.optimizer != "adamw":
        notes.append("bitsandbytes (qlora / 8-bit optimizers) needs CUDA; derived from storage sizes, not traced")
    if setup.strategy.startswith("zero"):
        notes.append("DeepSpeed ZeRO terms use transformers' 'auto' bucket sizes; derived, not traced")
    if arch.is_moe:
        notes.append("mixture-of-experts activations assume evenly routed tokens; derived, not traced")
        if setup.method != "full" and setup.lora_dropout > 0:
            notes.append("peft's expert adapters (all-linear on Mixtral) require lora dropout 0")
    return notes


@dataclass(frozen=True)
class _Sharding:
    """Gathered parameters and gradients in flight at each moment of the step (bytes)."""

    forward: float
    backward_start: float  # the loss gradient at its widest
    head_reduce: float  # the head's gradient being reduced (FSDP), all activations still alive
    backward_mid: float  # a block's backward
    block_reduce: float  # a block's gradient being reduced (FSDP)
    backward_end: float  # the embedding's backward
    end_grads_missing: float  # sharded gradients not yet written at that moment
    optimizer: float


def _sharding(setup: TrainingSetup, rg: _Regime, st: _Static) -> _Sharding:
    arch, n = setup.architecture, setup.world_size
    block = arch.block_params
    embed = arch.vocab_size * arch.hidden_size
    tied = arch.tie_word_embeddings
    gb = rg.compute  # FSDP/ZeRO-3 gather in the compute dtype (param_dtype)
    if setup.strategy == "fsdp":
        # transformers' FSDP plan: the embedding and each block are groups resharded after
        # forward; the final norm and the head are one group kept gathered until its backward
        # (tied: the embedding is in that group, which then stays gathered through backward).
        # A group's post-backward reshards it, copies its unsharded gradient (compute dtype)
        # into an fp32 reduce-scatter input (reduce_dtype fp32), then frees the unsharded one.
        # Measured on the trace: the embedding group stays gathered until the root's forward
        # returns.
        grad_frac = 1.0 if setup.method == "full" else 0.0  # a frozen base has no gradients
        tail = gb * (embed + arch.hidden_size)
        tail_grad = gb * grad_frac * embed
        reduce = (gb + 4) * grad_frac
        tied_extra = tail + tail_grad if tied else 0.0
        return _Sharding(
            forward=tail + (0.0 if tied else gb * embed),
            backward_start=tail,
            head_reduce=(tail + tail_grad + gb * block) if tied else (gb * block + reduce * (embed + arch.hidden_size)),
            backward_mid=2 * gb * block + gb * grad_frac * block + tied_extra,
            block_reduce=gb * block + reduce * block + tied_extra,
            backward_end=reduce * (embed + (arch.hidden_size if tied else 0)),
            end_grads_missing=4 * grad_frac * embed / n,
            optimizer=0.0,
        )
    if setup.strategy == "zero3":
        gathered = st.buffers_step + 2 * gb * block + gb * (embed + (0 if tied else embed))
        return _Sharding(gathered, gathered, gathered, gathered, gathered, gathered, 0.0, st.buffers_step)
    b = st.buffers_step
    return _Sharding(b, b, b, b, b, b, 0.0, b)


def estimate_memory(setup: TrainingSetup) -> MemoryEstimate:
    """Per-GPU peak allocated bytes of one training step, with the terms at the peak."""
    arch = setup.architecture
    notes = _notes(setup)
    if arch.attn_logit_softcapping and setup.attention == "sdpa":
        setup = replace(setup, attention="eager")
    rg = _regime(setup)
    tokens = setup.micro_batch_size * setup.sequence_length
    n = setup.world_size
    st = _static(setup, rg)
    sh = _sharding(setup, rg, st)
    L = arch.num_layers
    h = arch.hidden_size
    embed = arch.vocab_size * h
    head = 0 if arch.tie_word_embeddings else embed

    # ---- activations ----
    base_pt, lora_pt = _block_saved_bytes_per_token(arch, setup, rg)
    # Shared by all blocks: rotary cos/sin; eager attention's 4-D causal mask.
    shared = 2 * rg.compute * arch.dim_per_head * tokens
    if setup.attention == "eager":
        shared += rg.compute * setup.micro_batch_size * setup.sequence_length ** 2
    elif _sdpa_needs_mask(arch, setup):
        shared += setup.micro_batch_size * setup.sequence_length ** 2  # the boolean mask
    # The final norm's saved input and its output (the head's input), the embedding output.
    around = (_norm_saved(arch, rg) + rg.compute * h + rg.residual * h) * tokens
    one_block = (base_pt + lora_pt) * tokens
    if setup.gradient_checkpointing:
        # Non-reentrant checkpointing keeps each block's input; backward recomputes one block.
        kept, kept_lora, recompute = L * rg.residual * h * tokens, 0.0, one_block
    else:
        kept, kept_lora, recompute = L * base_pt * tokens, L * lora_pt * tokens, 0.0
    logits_fwd_pt, logits_bwd_pt = _logits_bytes(arch, setup, rg)

    # ---- autocast weight copies ----
    lora_params = 0 if setup.method == "full" else arch.lora_trainable_params(setup.lora_rank, setup.lora_targets)
    if rg.autocast_fp32_weights:
        # Cached bf16 copies of every fp32 weight: all alive at the end of the forward; without
        # checkpointing the graph keeps them until each block's backward.
        head_copy = 2 * (head or embed)
        copies_fwd = 2 * arch.linear_params + head_copy
        copies_bwd_start = copies_fwd if not setup.gradient_checkpointing else head_copy
        copies_block = 2 * arch.block_params
    elif rg.lora and rg.compute == 2:
        # Cached bf16 copies of the fp32 adapters (FSDP gathers them in bf16 already).
        copies_fwd = 0.0 if setup.strategy == "fsdp" else 2 * lora_params / (n if setup.strategy == "zero3" else 1)
        if rg.qlora:
            # The frozen fp32 head is cast on every call (not cached: it needs no grad) and
            # the cast is saved for the input gradient.
            copies_fwd += 2 * embed
        copies_bwd_start = copies_fwd
        copies_block = 0.0
    else:
        copies_fwd = copies_bwd_start = copies_block = 0.0

    dequant = 0.0
    if rg.qlora:
        # bitsandbytes dequantises each 4-bit weight to the compute dtype for its matmul.
        dequant = 2 * max(l.params // l.experts for l in arch.block_linears())

    static = {"weights": st.weights, "optimizer": st.optimizer, "master_weights": st.master_weights}
    zero = dict.fromkeys(TERMS, 0.0)

    forward = dict(zero, **static)
    forward.update(activations=kept + shared + around, lora_activations=kept_lora, weight_copies=copies_fwd,
                   logits=logits_fwd_pt * tokens, buffers=sh.forward + dequant)

    # Backward at its start: all that forward saved, the loss gradient at its widest.
    bwd_start = dict(zero, **static)
    bwd_start.update(activations=kept + shared + around - rg.residual * h * tokens, lora_activations=kept_lora,
                     weight_copies=copies_bwd_start, logits=logits_bwd_pt * tokens,
                     buffers=sh.backward_start + dequant)
    candidates = [bwd_start]
    # Right after the head's backward (FSDP reduces its gradient): activations still alive.
    head_reduce = dict(bwd_start, logits=0.0, buffers=sh.head_reduce + dequant)
    candidates.append(head_reduce)
    # A block's backward holds gradients of its MLP intermediates (the product, the
    # activation's output, up and gate: about three b x s x intermediate at once).
    moe_k = arch.experts_per_token if arch.is_moe else 1
    block_bwd = 3 * rg.mlp * arch.intermediate_size * moe_k * tokens
    # ... and the gradient of the residual stream: the one flowing in and the one being built.
    block_bwd += 2 * rg.residual * h * tokens
    if not setup.gradient_checkpointing:
        # The first block's backward: everything else forward saved is still alive.
        first = dict(bwd_start, logits=0.0, activations=bwd_start["activations"] + block_bwd,
                     buffers=sh.backward_mid + dequant)
        candidates.append(first)
    if setup.gradient_checkpointing:
        # In the middle: a block recomputed on top of the kept inputs.
        mid = dict(zero, **static)
        mid.update(activations=kept + shared + recompute + block_bwd, weight_copies=copies_bwd_start + copies_block,
                   buffers=sh.backward_mid + dequant)
        candidates.append(mid)
        candidates.append(dict(mid, activations=kept + shared, buffers=sh.block_reduce + dequant))
    # At its end: every gradient exists. Two moments compete: block 0's backward (its
    # recompute and weight-gradient transients alive, its own gradients not yet) and the
    # embedding's backward (all gradients).
    per_block_grad = st.gradients * arch.block_params / arch.total_params
    embed_grad = st.gradients * embed / arch.total_params if (setup.method == "full" and head) else 0.0
    block0 = dict(zero, **static)
    block0.update(gradients=st.gradients - per_block_grad - embed_grad, activations=recompute + shared + block_bwd,
                  weight_copies=copies_block, buffers=sh.backward_mid + dequant)
    if setup.method == "full" and not setup.gradient_checkpointing:
        block0["activations"] = base_pt * tokens + shared + block_bwd  # block 0's own saved tensors
    if rg.autocast_fp32_weights or (setup.method == "full" and setup.strategy != "fsdp"):
        # A linear's weight gradient in the compute dtype and its cast to the weight's dtype.
        block0["gradients"] += (rg.compute + 4) * max(l.params for l in arch.block_linears())
    candidates.append(block0)
    bwd_end = dict(zero, **static)
    grads = st.gradients
    if setup.method == "full" and arch.tie_word_embeddings and setup.strategy != "fsdp":
        # Tied: the embedding's dense V x h gradient is added to the head's out of place,
        # so the old gradient, the new one and their sum exist together for a moment.
        grads += 2 * 4 * embed
    bwd_end.update(gradients=grads - sh.end_grads_missing, buffers=sh.backward_end + dequant)
    candidates.append(bwd_end)
    backward = max(candidates, key=lambda d: sum(d.values()))

    optimizer = dict(zero, **static)
    optimizer.update(gradients=st.gradients, buffers=sh.optimizer)

    phases = {"forward": forward, "backward": backward, "optimizer": optimizer}
    totals = {k: round(sum(v.values())) for k, v in phases.items()}
    peak_phase = max(PHASES, key=lambda k: totals[k])
    breakdown = {k: int(round(v)) for k, v in phases[peak_phase].items()}
    peak = sum(breakdown.values())

    reserve = K.CUDA_CONTEXT_RESERVE_BYTES + (K.NCCL_RESERVE_BYTES if n > 1 else 0)
    return MemoryEstimate(
        peak_allocated_bytes=peak,
        required_bytes=int(math.ceil(peak * K.FRAGMENTATION_FACTOR)) + reserve,
        peak_phase=peak_phase,
        breakdown=breakdown,
        host_required_bytes=_host_bytes(setup, st),
        notes=tuple(notes),
        phase_peaks=totals,
        reserve_bytes=reserve,
    )


def _host_bytes(setup: TrainingSetup, st: _Static) -> int:
    """Host RAM one training process (one GPU) needs: runtime, the weights while loading, offloaded state, data.

    Loading follows the trainer: without a sharded strategy from_pretrained materialises the
    whole model in host memory in its load dtype (fp32 for full fine-tuning, the compute
    dtype for LoRA) before it moves to the GPU; FSDP (transformers' DistributedConfig) and
    ZeRO-3 (zero.Init) load each rank's part shard by shard; QLoRA quantises shard by shard.
    """
    arch = setup.architecture
    p = arch.total_params
    load_b = 4 if (setup.method == "full" or setup.precision == "fp32") else 2
    if setup.method == "qlora":
        loading = K.HOST_SHARD_BYTES
    elif setup.strategy in ("fsdp", "zero3"):
        loading = load_b * p / setup.world_size + K.HOST_SHARD_BYTES
    else:
        loading = load_b * p
    return int(K.HOST_PROCESS_BYTES + K.HOST_DATALOADER_BYTES + loading + st.host_offloaded)
