"""The table of supported families: what each transformers `model_type` builds that its config.json
does not spell out, and the small vocabularies both the architecture and the config reader check.

architecture.py (the shapes and counts) and hf_config.py (reading a config.json) both read these;
they live here so neither has to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass

# Names of the linear layers of a decoder block that LoRA may target, per family.
_DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Mixtral in transformers 5 keeps its experts as 3-D parameters (not nn.Linear);
# peft's "all-linear" targets the router and those parameters too.
_MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts")
_ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")  # the dense layers of a Qwen3-MoE with mlp_only_layers
# phi (phi-1.5, phi-2) and gpt_neox (Pythia): the older GPT layout, a non-gated MLP, biases, LayerNorm.
_PHI_TARGETS = ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")
_GPT_NEOX_TARGETS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")


@dataclass(frozen=True)
class FamilyTraits:
    """Structural facts of one transformers `model_type` that the config does not spell out."""

    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    norms_per_layer: int  # RMSNorms over the hidden size per decoder block (Gemma 2/3 have four)
    fused_qkv: bool  # one qkv_proj instead of q/k/v (Phi-3)
    fused_gate_up: bool  # one gate_up_proj instead of gate/up (Phi-3)
    lora_targets: tuple[str, ...]
    # Activation function of the MLP: "silu" or "gelu_tanh"; both keep the same tensors.
    scales_embeddings: bool = False  # Gemma multiplies the embeddings by sqrt(hidden)
    # RMSNorm on the queries and keys: "head" over each head (Qwen3, Gemma 3), "full" over
    # all of q and all of k (OLMo 2), "" none.
    qk_norm: str = ""
    fp32_norms: bool = False  # Gemma computes the whole RMSNorm in fp32 (Llama casts back first)
    # Mixture of experts, as transformers lays it out: "" dense, "mixtral" (router `gate`, no
    # biases; intermediate_size is the expert width), "qwen3_moe" (router `gate`, experts of
    # moe_intermediate_size, optional dense layers), "gpt_oss" (router `router` and experts
    # with biases).
    moe: str = ""
    attention_sinks: bool = False  # gpt-oss: one learned logit per head joins the softmax
    attention_bias_default: bool = False  # the config's attention_bias when it does not say
    # transformers cannot run sdpa for this family (attention sinks), so sdpa means eager
    # there, in the trainer and in the estimate.
    eager_only: bool = False
    tie_default: bool = False  # the config class's tie_word_embeddings default
    # What peft's "all-linear" adapts, where it is not every name of lora_targets (Qwen3-MoE:
    # not the dense MLP of its mlp_only_layers; observed with peft 0.21, tested).
    all_linear: tuple[str, ...] | None = None
    # The older GPT layout (phi, gpt_neox). LayerNorm (weight and bias) in place of RMSNorm.
    layer_norm: bool = False
    # A non-gated MLP (up, act, down), both linears biased: the names of its two linears.
    plain_mlp: tuple[str, str] | None = None
    out_proj: str = "o_proj"  # the attention's output projection
    qkv_name: str = "qkv_proj"  # the fused q/k/v projection, where fused_qkv
    head_bias: bool = False  # the output head has a bias (phi)
    # Attention and MLP both read the block input (phi always, through its one LayerNorm;
    # gpt_neox where the config's use_parallel_residual says so).
    parallel_block: bool = False
    rotary_default: float = 1.0  # share of a head that rotary rotates when the config does not say
    # The input embedding's and the output head's module names (what lora.modulesToSave and
    # lora.targetModules name them by; gpt_neox's embedding is embed_in, its head lm_head in transformers 5).
    embedding_module: str = "embed_tokens"
    head_module: str = "lm_head"


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(False, 2, False, False, _DENSE_TARGETS),
    "mistral": FamilyTraits(False, 2, False, False, _DENSE_TARGETS),
    "mixtral": FamilyTraits(False, 2, False, False, _MOE_TARGETS, moe="mixtral"),
    "qwen2": FamilyTraits(True, 2, False, False, _DENSE_TARGETS),
    "gemma2": FamilyTraits(False, 4, False, False, _DENSE_TARGETS, scales_embeddings=True, fp32_norms=True,
                           tie_default=True),
    "phi3": FamilyTraits(False, 2, True, True, _PHI3_TARGETS),
    # The families of 2026 (issue 16).
    "qwen3": FamilyTraits(False, 2, False, False, _DENSE_TARGETS, qk_norm="head"),
    # peft's all-linear on Qwen3-MoE: attention, the router `gate` and the 3-D experts (as Mixtral).
    "qwen3_moe": FamilyTraits(False, 2, False, False, _MOE_TARGETS + _DENSE_MLP, qk_norm="head", moe="qwen3_moe",
                              all_linear=_MOE_TARGETS),
    "gemma3_text": FamilyTraits(False, 4, False, False, _DENSE_TARGETS, scales_embeddings=True, qk_norm="head",
                                fp32_norms=True, tie_default=True),
    # peft's all-linear on gpt-oss adapts the attention only (its router and experts are not
    # nn.Linear); the experts need lora.targetExperts.
    "gpt_oss": FamilyTraits(False, 2, False, False, _ATTN_TARGETS, moe="gpt_oss", attention_sinks=True,
                            attention_bias_default=True, eager_only=True),
    "olmo2": FamilyTraits(False, 2, False, False, _DENSE_TARGETS, qk_norm="full"),
    "granite": FamilyTraits(False, 2, False, False, _DENSE_TARGETS),
    # Issue 28: phi-1.5 / phi-2 (one LayerNorm read by attention and MLP in parallel, every
    # linear and the head biased) and Pythia (fused, per-head interleaved query_key_value).
    "phi": FamilyTraits(True, 1, False, False, _PHI_TARGETS, layer_norm=True, plain_mlp=("fc1", "fc2"),
                        out_proj="dense", head_bias=True, parallel_block=True, rotary_default=0.5),
    "gpt_neox": FamilyTraits(False, 2, True, False, _GPT_NEOX_TARGETS, layer_norm=True,
                             plain_mlp=("dense_h_to_4h", "dense_4h_to_h"), out_proj="dense", qkv_name="query_key_value",
                             attention_bias_default=True, rotary_default=0.25, embedding_module="embed_in"),
}

# config.json files whose model_type wraps a text decoder in `text_config` (multimodal
# checkpoints trained as causal LMs on text): the decoder's family.
WRAPPERS: dict[str, str] = {"gemma3": "gemma3_text"}


@dataclass(frozen=True)
class VisionTower:
    """The SigLIP vision tower and projector of a multimodal checkpoint (Gemma 3 4B-27B).

    Training on text never runs it, but transformers builds it (AutoModelForCausalLM of a
    `gemma3` config is Gemma3ForConditionalGeneration), so its weights take memory and
    peft's all-linear puts adapters on its linears. The memory model counts its parameters
    like the decoder's (their gradients and optimizer states never exist, so that errs high
    by at most 12 bytes a parameter, 3% of Gemma 3 12B).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    patch_size: int
    image_size: int
    text_hidden_size: int
    num_channels: int = 3

    LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

    @property
    def params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        patches = (self.image_size // self.patch_size) ** 2
        embeddings = h * self.num_channels * self.patch_size ** 2 + h + patches * h
        layer = 2 * 2 * h + 4 * (h * h + h) + (h * i + i) + (i * h + h)
        projector = h * self.text_hidden_size + h
        return embeddings + self.num_layers * layer + 2 * h + projector

    def lora_params(self, rank: int, targets) -> int:
        """Adapters peft puts on the tower's linears (all-linear, or those named like a target)."""
        h, i = self.hidden_size, self.intermediate_size
        dims = {"q_proj": 2 * h, "k_proj": 2 * h, "v_proj": 2 * h, "out_proj": 2 * h, "fc1": h + i, "fc2": i + h}
        chosen = dims if targets == "all-linear" else {k: v for k, v in dims.items() if k in targets}
        return self.num_layers * rank * sum(chosen.values())



LAYER_TYPES = ("full_attention", "sliding_attention")
# Families whose config's attention_bias puts a bias on q/k/v/o (Qwen2's q/k/v bias is structural).
HONORS_ATTENTION_BIAS = frozenset({"llama", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "gpt_oss", "olmo2", "granite",
                                    "gpt_neox"})
# MLP activations of the plain-MLP families and what each saves (families.plain_mlp_saved).
PLAIN_MLP_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
HONORS_MLP_BIAS = frozenset({"llama", "granite"})
