"""Saved-activation terms that only some families have (issue 16: Qwen3, Qwen3-MoE, Gemma 3,
gpt-oss, OLMo 2). activations.py calls these where a block's saved tensors are added up, so a
family's specifics live here, next to each other, and the memory model stays one walk
through the step.

Every term was read off traced steps (bench/sizing_truth.py on tiny configs of each family,
the per-layer difference between 2- and 4-layer models): bytes per token per decoder block.
"""

from __future__ import annotations

from .architecture import ModelArchitecture


def qk_norm_saved(arch: ModelArchitecture, compute: int, weights_trainable: bool) -> float:
    """q/k RMSNorms (Qwen3 and Gemma 3 per head, OLMo 2 over all of q and k).

    Each saves its input upcast to fp32 and one fp32 rsqrt per normalised row (a head, or
    the token); with a trainable weight also the normalised value (cast back to the compute
    dtype, or in fp32 where the family computes the whole norm in fp32). The projection's
    output it reads was saved by the rotary embedding before; it is the norm's output now.
    """
    width = arch.qk_norm_width
    if not width:
        return 0.0
    rows = arch.num_attention_heads + arch.num_key_value_heads if arch.traits.qk_norm == "head" else 2
    saved = 4 * width + 4 * rows
    if weights_trainable:
        saved += (4 if arch.traits.fp32_norms else compute) * width
    return saved


def sliding_share(arch: ModelArchitecture) -> float:
    """Share of the blocks that attend through a sliding window (Gemma 3: 5 of 6, gpt-oss: 1 of 2)."""
    return arch.num_sliding_layers / arch.num_layers


def grouped_experts_saved(arch: ModelArchitecture, moe_bytes: int, weights_train: bool) -> float:
    """One mixture-of-experts block as transformers 5 runs it by default (experts_implementation
    "grouped_mm"): tokens sorted by expert, each routed copy (S = tokens x top-k rows) through
    one grouped matmul per projection. grouped_mm is not autocast: it runs in the weights'
    dtype (`moe_bytes`: fp32 for full fine-tuning under autocast, else the compute dtype).

    Saved per routed copy: the gate/up output (the activation's input keeps it alive), the
    activation's output, down's output (multiplied by the routing weight), and, when the
    expert weights train, the gathered input and the product (the matmuls' inputs, needed
    for the weight gradients); per token the router's fp32 probabilities and the int64 sort
    permutation and top-k indices. Expert adapters (LoRA) add theirs in `expert_adapter_saved`.
    """
    h, i, k, e = arch.hidden_size, arch.expert_intermediate_size, arch.experts_per_token, arch.num_experts
    saved = 4 * e + 8 * k * 2
    if arch.traits.moe == "gpt_oss":
        # Clamped SwiGLU over interleaved gate/up: the clamped gate, the sigmoid, up + 1 and the
        # GLU are separate tensors next to the gate/up output.
        per_copy = 2 * i + 4 * i + h
    else:
        per_copy = 2 * i + i + h
    if weights_train:
        per_copy += h + i
    return saved + k * moe_bytes * per_copy


def expert_adapter_saved(arch: ModelArchitecture, lin, compute: int, tokens: int) -> float:
    """LoRA on a fused 3-D expert weight (peft's ParamWrapper), bytes per token.

    peft adds B @ A to the whole weight before the grouped matmul runs, so that matmul's input
    (one row per routed copy) is saved for the adapters' gradient, and so is the merged
    weight itself: every expert of the block, in the compute dtype (autocast runs B @ A in
    bf16 and the sum takes the base weight's dtype), once per block whatever the batch.
    Spread over the block's tokens to fit the per-token sum. (First sized in fp32 from the
    tiny traces; Qwen3-30B-A3B without checkpointing, 29B expert weights, showed bf16 to the
    byte: bench/sizing_accuracy.py marks that case in-sample.)
    """
    return arch.experts_per_token * compute * lin.in_features + compute * lin.params / tokens


def eager_sinks_saved(arch: ModelArchitecture, compute: int, seq: int) -> float:
    """gpt-oss eager attention: the scores joined with one sink logit per head and row.

    The softmax runs in the logits' own dtype (the compute dtype, not fp32 as in Llama's
    eager attention) over s + 1 columns; its output is saved (the probabilities are a view
    of it) with the int64 argmax of the max subtracted for stability.
    """
    return compute * arch.num_attention_heads * (seq + 1) + 8 * arch.num_attention_heads


# ---- the older GPT layout: phi (phi-1.5, phi-2) and gpt_neox (Pythia), issue 28 ----------
#
# LayerNorm in place of RMSNorm, a non-gated MLP, dropout from config.json. Under mixed
# precision CUDA's autocast runs layer_norm (and pow) in fp32, which decides what is saved;
# the fake-tensor truth runs them so too (finetune_trainer.profile._fp32_under_autocast).


def reads_block_input(arch: ModelArchitecture) -> bool:
    """Attention and MLP read the block input (phi; gpt_neox with use_parallel_residual)."""
    return arch.traits.parallel_block or (arch.family == "gpt_neox" and arch.parallel_residual)


def layer_norms_saved(arch: ModelArchitecture, residual: int, autocast: bool, weights_trainable: bool) -> float:
    """The block's LayerNorms and the inputs of the linears that read them, bytes per token.

    native_layer_norm saves its input and an fp32 mean and rstd per row. Under autocast a bf16
    input is cast to fp32 first (each norm its own cast, saved); an fp32 input (full fine-tuning's
    residual stream) is saved as it is, once where two norms read the same tensor (gpt_neox's
    parallel residual). The output is fp32 under autocast: every linear that reads it casts it
    to bf16 on its own, and saves that copy when its weight trains; without autocast the
    linears share each norm's output.
    """
    h, norms = arch.hidden_size, arch.traits.norms_per_layer
    saved = 8.0 * norms
    if autocast and residual != 4:
        saved += norms * 4 * h
    else:
        inputs = 1 if reads_block_input(arch) else norms
        saved += inputs * residual * h
    if weights_trainable:
        if autocast:
            attn_reads = 1 if arch.traits.fused_qkv else 3
            saved += (attn_reads + 1) * 2 * h
        else:
            saved += norms * residual * h
    return saved


def attention_output_copy_saved(arch: ModelArchitecture, compute: int, weights_trainable: bool) -> float:
    """q and k leave phi's and gpt_neox's partial rotary through torch.cat, laid out per head, so
    flash attention's output is laid out per head too and transformers' transpose(1, 2).contiguous()
    copies it: when the output projection's weight trains it saves that copy beside the output
    flash saved (Llama's rotary keeps the projection's layout and the copy is a no-op)."""
    return compute * arch.q_size if weights_trainable else 0.0


def final_layer_norm_saved(arch: ModelArchitecture, residual: int, autocast: bool) -> float:
    """The final LayerNorm: its input (cast to fp32 under autocast) and the fp32 mean and rstd."""
    return (4 if autocast else residual) * arch.hidden_size + 8


def plain_mlp_saved(arch: ModelArchitecture, compute: int, autocast: bool, weights_trainable: bool) -> float:
    """A non-gated MLP (fc1 -> act -> fc2), bytes per token.

    gelu and gelu_pytorch_tanh are one kernel that saves its input. gelu_new is transformers'
    Python formula 0.5 x (1 + tanh(c (x + 0.044715 x^3))): pow saves its input, tanh its
    output, the last product both factors (0.5 x and 1 + tanh); under autocast pow runs in
    fp32, so the input it saves, tanh's output, 1 + tanh and the product are fp32 (0.5 x stays
    bf16). fc2 saves its input (the product, cast to bf16 under autocast) when its weight trains.
    """
    i = arch.intermediate_size
    if arch.hidden_act == "gelu_new":
        saved = (12 + compute) * i if autocast else 4 * compute * i
    else:
        saved = compute * i
    if weights_trainable:
        saved += compute * i
    return saved


def residual_dropout_saved(arch: ModelArchitecture) -> float:
    """Dropout on the attention and MLP outputs: the fused kernel's bool mask for each (1 byte)."""
    return 2.0 * arch.hidden_size if arch.residual_dropout > 0 else 0.0


def embedding_dropout_saved(arch: ModelArchitecture) -> float:
    """Dropout on the embeddings' output: one bool mask."""
    return float(arch.hidden_size) if arch.embedding_dropout > 0 else 0.0
