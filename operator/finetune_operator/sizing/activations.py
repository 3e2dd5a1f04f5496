"""Saved activations: the bytes per token that autograd keeps for backward, enumerated from the
shapes following the modules transformers runs (a decoder block's norms, attention, MLP and
peft's adapters), and the head's and the loss's high points. The family-specific terms are in
families.py. `saved_activations` multiplies them by the tokens and the layers, as gradient
checkpointing and activation offloading keep them; memory.py places them in the phases.

Liger's kernels (training.ligerKernel) change three of these terms, read from liger-kernel 0.8.5's
source (not traced: Triton runs on GPUs only; bench/gpu_levers.py measures them): the norms'
(`_liger_norm_saved`), the SwiGLU MLP's (gate and up, not the activation's output) and the head's
and loss's (`_liger_logits_bytes`). RoPE keeps cos and sin either way. Their backward runs in place
(RMSNorm, SwiGLU): the block backward's transients are still the plain ones (an over-estimate)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import families, saved_modules
from .architecture import ModelArchitecture
from .errors import SizingError
from .regime import Regime
from .setup import TrainingSetup


@dataclass(frozen=True)
class SavedActivations:
    """What forward saves for backward in one micro-batch, bytes (the logits' high points per token)."""

    block_per_token: float  # one decoder block's base tensors (not its adapters'), per token
    shared: float  # shared by all blocks: rotary cos/sin, the attention mask
    around: float  # outside the blocks: the final norm, the head's input, the embedding output
    block_input: float  # one block's input (the residual stream)
    kept: float  # the blocks' saved tensors (checkpointing: their inputs) on the GPU through forward
    kept_lora: float  # the adapters' saved tensors (none kept under checkpointing)
    recompute: float  # one block recomputed in backward (checkpointing)
    offloaded_to_host: float  # the kept block inputs activation offloading moves to host memory
    logits_forward_per_token: float
    logits_backward_per_token: float


def saved_activations(setup: TrainingSetup, regime: Regime) -> SavedActivations:
    """The saved activations of the whole model for this setup's micro-batch."""
    arch = setup.architecture
    if setup.liger_kernel and arch.family not in LIGER_FAMILIES:
        raise SizingError("liger_kernel", f"Liger's kernels are modelled for the {', '.join(LIGER_FAMILIES)} families "
                          f"(RMSNorm, SwiGLU MLP, RoPE, fused loss); model family {arch.family} is not")
    tokens = setup.tokens_per_micro_batch
    layers = arch.num_layers
    hidden = arch.hidden_size
    block_per_token, lora_per_token = _block_saved_bytes_per_token(arch, setup, regime)
    # Shared by all blocks: rotary cos/sin; eager attention's 4-D causal mask.
    shared = 2 * regime.compute * arch.rotary_dim * tokens
    if setup.attention == "eager":
        shared += regime.compute * setup.rows * setup.row_length ** 2
    elif _sdpa_needs_mask(arch, setup):
        shared += _sdpa_masks(arch, setup) * setup.rows * setup.row_length ** 2  # boolean masks
    # The final norm's saved input and its output (the head's input), the embedding output.
    around = (_norm_saved(arch, regime) + regime.compute * hidden + regime.residual * hidden) * tokens
    if setup.liger_kernel:
        # Liger's final norm keeps its input and 1/rms; its fused loss keeps no input of the head
        # (it computes the head's gradients in forward: _liger_logits_bytes counts them).
        around = (_liger_norm_saved(arch, regime) + regime.residual * hidden) * tokens
    if arch.traits.layer_norm:
        autocast = regime.compute == 2 and not regime.master_bf16
        around = (families.final_layer_norm_saved(arch, regime.residual, autocast) + regime.compute * hidden
                  + regime.residual * hidden + families.embedding_dropout_saved(arch)) * tokens
    if regime.lora:  # what trains outside the blocks: a copy of the head, the head's adapter
        around += saved_modules.saved_per_token(arch, regime.compute, saved_modules.of_setup(setup), setup.lora_rank,
                                                setup.lora_targets, setup.lora_dropout > 0) * tokens
    one_block = (block_per_token + lora_per_token) * tokens
    block_input = regime.residual * hidden * tokens
    offloaded_to_host = 0.0
    if setup.gradient_checkpointing:
        # Non-reentrant checkpointing keeps each block's input; backward recomputes one block.
        kept, kept_lora, recompute = layers * block_input, 0.0, one_block
        if setup.activation_offloading:
            # Lever: the kept block inputs live in host memory; the GPU holds the one being
            # copied out in forward, or brought back for its recompute in backward.
            offloaded_to_host = kept
            kept = block_input
    else:
        kept, kept_lora, recompute = layers * block_per_token * tokens, layers * lora_per_token * tokens, 0.0
    logits_fwd_per_token, logits_bwd_per_token = logits_bytes(arch, setup, regime)
    return SavedActivations(block_per_token, shared, around, block_input, kept, kept_lora, recompute,
                            offloaded_to_host, logits_fwd_per_token, logits_bwd_per_token)


# Where liger-kernel (0.8.5) swaps exactly the modules its terms below count: every RMSNorm (the two
# per block and the final one), the SwiGLU MLP, RoPE and the loss (its apply_liger_kernel_to_<family>).
# Other families patch other modules (GeGLU, experts, q/k norms, no fused loss): not modelled, refused.
LIGER_FAMILIES = ("llama", "mistral", "qwen2")


def _liger_norm_saved(arch: ModelArchitecture, regime: Regime) -> float:
    """Bytes per token Liger's RMSNorm keeps: its input as it came (the residual stream, not an fp32
    copy) and 1/rms in fp32, whether or not its weight trains (its backward recomputes the rest)."""
    return regime.residual * arch.hidden_size + 4


def _norm_saved(arch: ModelArchitecture, regime: Regime) -> float:
    """Bytes per token one RMSNorm saves: its fp32 input, and the normalised value if the weight trains."""
    hidden = arch.hidden_size
    saved = 4 * hidden
    if regime.weights_trainable:
        # Gemma computes the whole norm in fp32; Llama-style norms cast back to the input dtype first.
        saved += 4 * hidden if arch.traits.fp32_norms else regime.residual * hidden
    return saved


_INPUT_OF = {  # which tensor a block linear reads, to find adapters that share one
    "q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
    "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in", "gate": "mlp_in",
    "experts.gate_up_proj": "mlp_in", "down_proj": "mlp_mid", "experts.down_proj": "mlp_mid",
    # phi reads its one LayerNorm's output in attention and MLP; gpt_neox has two.
    "query_key_value": "attn_in", "dense": "attn_out", "fc1": "attn_in", "fc2": "mlp_mid",
    "dense_h_to_4h": "mlp_in", "dense_4h_to_h": "mlp_mid",
}


def _lora_saved(arch: ModelArchitecture, setup: TrainingSetup, regime: Regime) -> float:
    """Bytes per token peft's adapters save: the input each lora_A reads, and x A."""
    if not regime.lora:
        return 0.0
    rank = setup.lora_rank
    dropout = setup.lora_dropout > 0
    # Under FSDP the adapters are gathered in the compute dtype with the base, so peft's
    # cast of the input to the adapter dtype is a no-op and adapters reading the same
    # tensor save that one tensor; the attention output is saved by attention already.
    # Not so in phi and gpt_neox: their LayerNorms' (and gelu_new's) outputs are fp32 under autocast,
    # peft casts them once per adapter, and their attention output is a copy attention did not save.
    shared_inputs = setup.strategy == "fsdp" and regime.compute == 2 and not arch.traits.layer_norm
    saved = 0.0
    seen: set[str] = set()
    for lin in arch.resolve_lora_targets(setup.lora_targets):
        if lin.name in ("experts.gate_up_proj", "experts.down_proj") and arch.traits.moe != "mixtral":
            saved += families.expert_adapter_saved(arch, lin, regime.compute, setup.tokens_per_micro_batch)
            continue
        if lin.name in ("experts.gate_up_proj", "experts.down_proj"):
            # Expert adapters see only their routed tokens: experts_per_token copies in all.
            saved += arch.experts_per_token * (regime.compute * lin.in_features + 4 * rank)
            continue
        saved += regime.compute * rank  # x A, saved by lora_B
        if dropout:
            # Dropout (CUDA's fused kernel) makes a new input per adapter and keeps a bool mask.
            saved += regime.compute * lin.in_features + lin.in_features
        elif shared_inputs:
            source = _INPUT_OF.get(lin.name, lin.name)
            if source not in seen and source != "attn_out":
                saved += regime.compute * lin.in_features
            seen.add(source)
        else:
            # peft casts the input to fp32 (the adapter dtype); autocast casts it back for
            # lora_A, and that per-adapter copy is what lora_A saves.
            saved += regime.compute * lin.in_features
    return saved


def _block_saved_bytes_per_token(arch: ModelArchitecture, setup: TrainingSetup, regime: Regime) -> tuple[float, float]:
    """(base, lora) bytes per token that one decoder block saves for backward.

    Attention scores (eager) are per token too: they scale with the sequence length.
    """
    hidden, inter, q_width, kv_width = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    heads, compute = arch.num_attention_heads, regime.compute
    traits = arch.traits
    seq = setup.row_length

    autocast = compute == 2 and not regime.master_bf16  # the forward runs under autocast
    if traits.layer_norm:
        # phi / gpt_neox: LayerNorms and the linears' inputs, non-gated MLP, dropout masks.
        saved = families.layer_norms_saved(arch, regime.residual, autocast, regime.weights_trainable)
        saved += families.plain_mlp_saved(arch, compute, autocast, regime.weights_trainable)
        saved += families.residual_dropout_saved(arch)
        if setup.attention != "eager":
            saved += families.attention_output_copy_saved(arch, compute, regime.weights_trainable)
    else:
        saved = traits.norms_per_layer * (_liger_norm_saved(arch, regime) if setup.liger_kernel
                                          else _norm_saved(arch, regime))
    saved += families.qk_norm_saved(arch, compute, regime.weights_trainable)
    # Gemma 2's post-attention / post-feedforward norms read the sub-layer outputs; the
    # pre-norms (two per block) feed linears. Only those two feed linears below.

    # Inputs the base linears save (only when their weights train).
    if regime.weights_trainable and not traits.layer_norm:
        if regime.autocast_fp32_weights:
            # Autocast casts the fp32 norm output separately for every linear that reads it.
            attn_reads = 1 if traits.fused_qkv else 3
            mlp_reads = 1 if (traits.fused_gate_up or arch.is_moe) else 2
            saved += (attn_reads + mlp_reads) * 2 * hidden
        else:
            saved += 2 * compute * hidden  # one norm output per sub-layer, shared by its linears

    # Attention.
    if setup.attention == "eager":
        kv_saved = q_width if arch.num_key_value_heads < heads else kv_width  # repeat_kv copies
        saved += compute * (q_width + 2 * kv_saved) + compute * q_width  # q, repeated k/v, contiguous output
        if traits.fused_qkv and traits.layer_norm:
            saved += compute * (q_width + kv_width)  # gpt_neox: v is a view, the whole query_key_value output stays
        if traits.attention_sinks:
            saved += families.eager_sinks_saved(arch, compute, seq)
        else:
            saved += (4 + compute) * heads * seq  # softmax output in fp32, and its cast for probs @ v
        if arch.attn_logit_softcapping:
            saved += compute * heads * seq  # tanh output
    else:
        # q, k, v, output, logsumexp (under sequence parallelism the kernel's, over the whole sequence
        # and a share of the heads: as many bytes per token, but for replicated key/value heads)
        saved += compute * (2 * q_width + 2 * _kernel_kv_width(arch, setup)) + 4 * heads
        if setup.sequence_parallel > 1:
            # Under Ulysses one more output-sized tensor per block stays until backward: the block's
            # measured excess over an unsplit run of its slice (bench/sequence_parallel_truth.py: one
            # q-wide tensor per block, with and without checkpointing; in-sample, added after those rows).
            saved += compute * q_width
        if traits.fused_qkv:
            saved += compute * (q_width + kv_width)  # v is a view: the whole fused qkv output stays alive
        if _sdpa_needs_mask(arch, setup):
            # With a mask sdpa runs the memory-efficient kernel, which converts the boolean
            # mask to the compute dtype and saves it for backward: one b x s x s per block.
            # transformers hands sdpa grouped keys and values only without a mask
            # (use_gqa_in_sdpa): masked, repeat_kv copies them to every query head, and the
            # kernel saves the copies in place of k and v.
            repeated = 2 * compute * (q_width - kv_width) if arch.num_key_value_heads < heads else 0
            saved += (compute * seq + repeated) * _sdpa_masked_share(arch, setup)

    # MLP.
    if traits.plain_mlp:
        pass  # counted with the LayerNorms above
    elif arch.is_moe and traits.moe != "mixtral":
        saved += families.grouped_experts_saved(arch, 4 if regime.autocast_fp32_weights else compute,
                                                regime.weights_trainable)
    elif arch.is_moe:
        top_k = arch.experts_per_token
        saved += 4 * arch.num_experts  # router logits/probabilities (fp32)
        # gathered in, gate_up, act, product, down out
        saved += top_k * (compute * hidden + compute * 2 * inter + compute * inter + compute * inter + compute * hidden)
    else:
        # gate (act input), act output, up; Liger's fused SwiGLU keeps gate and up only (it
        # recomputes the activation in backward).
        saved += (2 if setup.liger_kernel else 3) * regime.mlp * inter
        if regime.weights_trainable:
            saved += compute * inter  # down's input
    return saved, _lora_saved(arch, setup, regime)


def _kernel_kv_width(arch: ModelArchitecture, setup: TrainingSetup) -> int:
    """Key (or value) elements per token the attention kernel holds. Under sequence parallelism with
    fewer key/value heads than GPUs in the group, Ulysses repeats each key/value head so that every GPU
    gets one (its kv_replication_factor): a GPU then holds one head over the whole sequence."""
    return arch.dim_per_head * max(arch.num_key_value_heads, setup.sequence_parallel)


def ulysses_exchange_per_token(arch: ModelArchitecture, setup: TrainingSetup, regime: Regime) -> float:
    """Bytes per token (of the GPU's slice) that Ulysses' all-to-all adds around one block's attention
    in backward, sequence parallelism only: the gradients of q, k, v and of the output in the layout of
    the exchange, each as its rearranged copy and the all-to-all's output (deepspeed's
    UlyssesSPAttentionHF: `rearrange(...).contiguous()` then `_dim_zero_all_to_all`)."""
    if setup.sequence_parallel <= 1:
        return 0.0
    q_width, kv_width = arch.q_size, _kernel_kv_width(arch, setup)
    return 2 * regime.compute * (2 * q_width + 2 * kv_width)


def _sdpa_needs_mask(arch: ModelArchitecture, setup: TrainingSetup) -> bool:
    """sdpa gets an explicit mask when positions restart in a row (packed, or padding-free: a
    block-diagonal causal mask from the position ids) or a sliding window is shorter than the row;
    otherwise it runs causal without one, as flash does (flash reads boundaries and windows itself)."""
    return setup.attention == "sdpa" and (_restarting_positions(setup) or _window_masks(arch, setup))


def _restarting_positions(setup: TrainingSetup) -> bool:
    """Rows whose positions restart at each example (packed, or padding-free's one row): transformers
    builds them a block-diagonal mask."""
    return setup.packing or setup.padding_free


def _window_masks(arch: ModelArchitecture, setup: TrainingSetup) -> bool:
    # A window no layer uses (Qwen) masks nothing.
    return arch.num_sliding_layers > 0 and setup.row_length > arch.sliding_window


def _sdpa_masks(arch: ModelArchitecture, setup: TrainingSetup) -> int:
    """How many b x s x s boolean masks transformers builds for sdpa: packed, one for the full
    layers and one for the sliding ones (if any); unpacked, the sliding layers' only."""
    if _restarting_positions(setup) and arch.num_sliding_layers > 0:
        return 2
    return 1


def _sdpa_masked_share(arch: ModelArchitecture, setup: TrainingSetup) -> float:
    """The share of the blocks whose sdpa gets a mask: every block when packed, else the sliding ones."""
    return 1.0 if _restarting_positions(setup) else families.sliding_share(arch)


def logits_bytes(arch: ModelArchitecture, setup: TrainingSetup, regime: Regime) -> tuple[float, float]:
    """(forward, backward) high points of the head and loss, bytes per token.

    Forward (mixed precision): logits in bf16, the fp32 upcast for the loss, log_softmax's
    fp32 output (saved), then the upcast is freed and accelerate converts the model's
    logits to fp32: 2 + 4 + 4 = 10 bytes x vocab either way.
    Backward starts with log_softmax's saved output, nll_loss's gradient and the
    log_softmax gradient, all fp32: 12 bytes x vocab.

    Chunked loss (the trainer's chunked_loss.py): the head and the loss run per sequence
    chunk under checkpointing, so forward keeps only each chunk's summed loss and backward
    recomputes one chunk's logits at a time: one chunk's worth of the above, plus the
    recomputed bf16 logits of that chunk in backward.
    """
    vocab = arch.vocab_size
    if setup.liger_kernel:
        return _liger_logits_bytes(arch, setup, regime)
    if setup.loss_chunks > 1:
        per_chunk_fwd = (8 if regime.compute == 4 else 10) * vocab
        per_chunk_bwd = 12 * vocab + regime.compute * vocab
        return per_chunk_fwd / setup.loss_chunks, per_chunk_bwd / setup.loss_chunks
    if regime.compute == 4:
        fwd = 8 * vocab  # logits, log_softmax output
    else:
        fwd = 10 * vocab
    bwd = 12 * vocab
    if arch.final_logit_softcapping:
        fwd += regime.compute * vocab * 2  # tanh output saved, capped logits
        bwd += regime.compute * vocab
    return fwd, bwd


def _liger_logits_bytes(arch: ModelArchitecture, setup: TrainingSetup, regime: Regime) -> tuple[float, float]:
    """(forward, backward) high points of Liger's fused linear cross-entropy, bytes per token.

    liger_kernel/ops/fused_linear_cross_entropy.py (0.8.5) runs the head and the loss on chunks of
    the micro-batch's tokens: ceil(vocab / hidden) chunks' worth of tokens at most, a power of two
    (`chunk_size`), so one chunk's logits are about as large as the head's input. Its forward
    computes the gradients too and keeps them for backward: the gradient of the head's input (one
    `hidden` row per token, in the input's dtype) and, when the head trains, the head weight's
    whole gradient (`zeros_like(weight)`). So at the forward's high point, inside the last chunk:
    the head's input (the final norm's output), its gradient, the per-token loss and mask, one
    chunk's logits in the compute dtype (the kernel writes their gradient in place) and that
    chunk's input gradient before it is copied in; under autocast with fp32 weights also a bf16
    cast of the head's transposed weight, which autocast does not cache (a view), made for each
    chunk. Backward starts with the two gradients the forward kept (scaled in place).

    The weight's gradient is no per-token figure: it is spread over the micro-batch's tokens here,
    so that the phases, which multiply by the tokens, get it whole.
    """
    vocab, hidden = arch.vocab_size, arch.hidden_size
    tokens = setup.tokens_per_micro_batch
    # chunk_size = next_power_of_2(ceil(BT / ceil(V / H))), at most BT (chunk_mem_const 1).
    chunk = min(1 << max(0, math.ceil(tokens / math.ceil(vocab / hidden)) - 1).bit_length(), tokens)
    # zeros_like(weight): the head trains in full fine-tuning only; its dtype is the weights' (fp32 under
    # autocast, else the compute dtype, as FSDP and DeepSpeed gather them and bf16 master weights are).
    weight_grad = vocab * hidden * (4 if regime.autocast_fp32_weights else regime.compute) \
        if regime.weights_trainable else 0
    input_grad = regime.residual * hidden  # grad_input: zeros_like(the head's input)
    forward = (regime.residual * hidden + input_grad + 4 + 1) * tokens  # input, its gradient, loss_1d, mask
    forward += chunk * (vocab + hidden) * regime.compute  # one chunk's logits and its input gradient
    if regime.autocast_fp32_weights:
        forward += 2 * vocab * hidden  # the per-chunk bf16 cast of weight.t()
    return (forward + weight_grad) / tokens, input_grad + weight_grad / tokens
