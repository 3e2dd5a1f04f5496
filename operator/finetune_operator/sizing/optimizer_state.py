"""The optimizer's state, tensor by tensor: what AdamW's two moments take for the tensors a job trains.

Full-precision AdamW keeps both moments in the trained weights' dtype, so its state is a number of
bytes per trained parameter. The low-bit optimizers (finetune_trainer/optimizers.py) quantise a
tensor's moments only when it has at least 4096 values in whole blocks, add a scale per block and a
lookup table per tensor, and (bitsandbytes under transformers' Trainer) keep embeddings' states in 32
bits: their state depends on the sizes of the trained tensors, which `trained_tensors` lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from finetune_trainer.optimizers import OptimizerKind

from .architecture import LinearShape, ModelArchitecture
from .saved_modules import SavedModules


@dataclass(frozen=True)
class TensorGroup:
    """`count` trained tensors of `numel` values each (`embedding`: an nn.Embedding's weight)."""

    numel: int
    count: int
    embedding: bool = False


# The planner estimates thousands of setups of a few models.
@lru_cache(maxsize=256)
def trained_tensors(arch: ModelArchitecture, method: str, lora_rank: int = 0,
                    lora_targets: str | tuple[str, ...] = "all-linear",
                    saved: SavedModules = SavedModules()) -> tuple[TensorGroup, ...]:
    """The tensors the optimizer steps: every parameter for full fine-tuning (transformers builds the
    vision tower of a multimodal checkpoint, and the memory model counts it as trained, erring high),
    peft's lora_A (r x in) and lora_B (out x r) of each adapted linear otherwise (the head's too when
    the targets name it), and the copies lora.modulesToSave trains (`saved`)."""
    groups: list[TensorGroup] = []
    if method == "full":
        groups.append(TensorGroup(arch.vocab_size * arch.hidden_size, 1, embedding=True))
        if not arch.tie_word_embeddings:
            groups.append(TensorGroup(arch.vocab_size * arch.hidden_size, 1))
        if arch.traits.head_bias:
            groups.append(TensorGroup(arch.vocab_size, 1))
        for linears, layers in arch.block_kinds():
            for lin in linears:
                groups.append(TensorGroup(lin.experts * lin.in_features * lin.out_features, layers))
                if lin.bias:
                    groups.append(TensorGroup(lin.experts * lin.out_features, layers))
        groups.append(TensorGroup(arch.norm_params, arch.num_layers * arch.traits.norms_per_layer + 1))
        if arch.qk_norm_params:
            groups.append(TensorGroup(arch.qk_norm_params // 2, 2 * arch.num_layers))
        if arch.traits.attention_sinks:
            groups.append(TensorGroup(arch.num_attention_heads, arch.num_layers))
        if arch.vision:
            groups.append(TensorGroup(arch.vision.params, 1))
        return tuple(g for g in groups if g.numel and g.count)
    for lin, layers in arch.adapted_linears(lora_targets):
        rank = _adapter_rank(lin, lora_rank)
        groups.append(TensorGroup(rank * lin.in_features, layers))
        groups.append(TensorGroup(lin.out_features * rank, layers))
    if arch.vision:
        groups.append(TensorGroup(arch.vision.lora_params(lora_rank, lora_targets), 1))
    if arch.head_adapted(lora_targets):
        groups += [TensorGroup(lora_rank * arch.hidden_size, 1), TensorGroup(arch.vocab_size * lora_rank, 1)]
    if saved.embedding:
        groups.append(TensorGroup(saved.embedding, 1, embedding=True))
    if saved.head:
        groups.append(TensorGroup(arch.vocab_size * arch.hidden_size, 1))
        if arch.traits.head_bias:
            groups.append(TensorGroup(arch.vocab_size, 1))
    return tuple(g for g in groups if g.numel and g.count)


def _adapter_rank(lin: LinearShape, rank: int) -> int:
    # peft's ParamWrapper gives each expert its own rank-r pair, and doubles the rank of the
    # fused gate_up parameter (as ModelArchitecture.lora_trainable_params counts them).
    return rank * lin.experts * (2 if lin.name == "experts.gate_up_proj" else 1)


def state_bytes(kind: OptimizerKind, groups: tuple[TensorGroup, ...], full_bytes: float) -> float:
    """Both moments of every trained tensor, unsharded (`full_bytes`: a full-precision moment's
    bytes per value, the trained weights' dtype)."""
    return sum(g.count * kind.state_bytes(g.numel, full_bytes, embedding=g.embedding) for g in groups)
