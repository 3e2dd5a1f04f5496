"""Decoder-only model architectures and their exact parameter counts.

The counts mirror the module structure transformers builds for each family
(checked in tests/sizing/test_architecture.py against models built on the meta
device). Family differences that change parameter counts or activation shapes are
held in `FamilyTraits`, one row per supported `model_type` (traits.py). Presets are
looked up with presets.preset(name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Mapping

from .errors import SizingError, UnknownArchitecture
from .hf_config import architecture_fields
from .traits import (
    FAMILIES,
    HONORS_ATTENTION_BIAS,
    HONORS_MLP_BIAS,
    LAYER_TYPES,
    PLAIN_MLP_ACTIVATIONS,
    FamilyTraits,
    VisionTower,
)

MODULE_KINDS = ("embedding", "attention", "mlp", "router", "norm", "lm_head", "vision")


@dataclass(frozen=True)
class LinearShape:
    """One (possibly expert-batched) weight matrix of a decoder block: out x in, times `experts`."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False
    experts: int = 1

    @property
    def params(self) -> int:
        return self.experts * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ModelArchitecture:
    """The numbers of a decoder-only transformer that decide its memory footprint."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (Mixtral and gpt-oss: each expert's)
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # config flag (q/k/v/o bias) of the families that honour it
    mlp_bias: bool = False  # Llama/Granite config flag
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    name: str = ""
    extra_hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    # Qwen3-MoE: each expert's width (None: intermediate_size) and the decoder layers that
    # keep a dense MLP of intermediate_size (mlp_only_layers, decoder_sparse_step).
    moe_intermediate_size: int | None = None
    dense_layers: tuple[int, ...] = ()
    # Per layer "full_attention" or "sliding_attention" (Gemma 3: five sliding to one full;
    # gpt-oss: alternating). None: every layer slides when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None
    vision: VisionTower | None = None  # a multimodal checkpoint's vision tower (never run on text)
    # phi / gpt_neox: the share of each head rotary rotates (partial_rotary_factor, rotary_pct;
    # None: the family's default), the MLP activation, the dropout rates the trainer runs with
    # (config.json's; phi's resid_pdrop / embd_pdrop, gpt_neox's hidden_dropout on both) and
    # gpt_neox's use_parallel_residual.
    partial_rotary_factor: float | None = None
    hidden_act: str = "gelu_new"
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    parallel_residual: bool = True

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnknownArchitecture(self.family, tuple(sorted(FAMILIES)), field="family")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise SizingError(
                "num_attention_heads",
                f"{self.num_attention_heads} heads do not divide hidden_size {self.hidden_size} "
                "(give head_dim explicitly if the model uses one)",
            )
        if self.head_dim is not None:
            _check_positive("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise SizingError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} key/value heads do not divide {self.num_attention_heads} attention heads",
            )
        if self.traits.moe:
            if not isinstance(self.num_experts, int) or self.num_experts < 1:
                raise SizingError("num_experts", "a mixture-of-experts family needs num_experts >= 1")
            if not isinstance(self.experts_per_token, int) or not 1 <= self.experts_per_token <= self.num_experts:
                raise SizingError(
                    "experts_per_token", f"must be between 1 and num_experts ({self.num_experts}), got {self.experts_per_token}"
                )
        elif self.num_experts:
            raise SizingError("num_experts", f"family {self.family!r} is dense; num_experts must be 0")
        if self.moe_intermediate_size is not None:
            if self.traits.moe != "qwen3_moe":
                raise SizingError("moe_intermediate_size", f"family {self.family!r} has no separate expert width")
            _check_positive("moe_intermediate_size", self.moe_intermediate_size)
        if self.dense_layers:
            if self.traits.moe != "qwen3_moe":
                raise SizingError("dense_layers", f"family {self.family!r} has no dense layers among its experts")
            bad = [i for i in self.dense_layers if not isinstance(i, int) or not 0 <= i < self.num_layers]
            if bad or len(set(self.dense_layers)) != len(self.dense_layers):
                raise SizingError("mlp_only_layers", f"must be distinct layer indices below {self.num_layers}, got {list(self.dense_layers)}")
        if self.sliding_window is not None:
            _check_positive("sliding_window", self.sliding_window)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise SizingError("layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if unknown:
                raise SizingError("layer_types", f"unknown layer types {unknown}; known: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise SizingError("sliding_window", "layer_types has sliding_attention layers but no sliding_window")
        if self.traits.plain_mlp:
            if self.hidden_act not in PLAIN_MLP_ACTIVATIONS:
                raise SizingError("hidden_act", f"{self.hidden_act!r} is not modelled for {self.family}; "
                                  f"known: {', '.join(PLAIN_MLP_ACTIVATIONS)}")
            for name in ("residual_dropout", "embedding_dropout"):
                value = getattr(self, name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
                    raise SizingError(name, f"must be a number in [0, 1), got {value!r}")
        if self.family == "gpt_neox":
            # transformers' GPTNeoX has neither grouped-query attention nor a head_dim, and one
            # hidden_dropout for the embeddings and both residual branches.
            if self.num_key_value_heads != self.num_attention_heads:
                raise SizingError("num_key_value_heads", "gpt_neox has no grouped-query attention: must equal num_attention_heads")
            if self.head_dim is not None:
                raise SizingError("head_dim", "gpt_neox heads are hidden_size / num_attention_heads wide; give no head_dim")
            if self.embedding_dropout != self.residual_dropout:
                raise SizingError("embedding_dropout", "gpt_neox's hidden_dropout is one rate: must equal residual_dropout")
        if self.partial_rotary_factor is not None and not (
                isinstance(self.partial_rotary_factor, (int, float)) and 0 < self.partial_rotary_factor <= 1):
            raise SizingError("partial_rotary_factor", f"must be in (0, 1], got {self.partial_rotary_factor!r}")

    # ---- derived shapes -------------------------------------------------
    @property
    def traits(self) -> FamilyTraits:
        return FAMILIES[self.family]

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that rotary rotates (the cos/sin width): all but in phi and gpt_neox."""
        factor = self.traits.rotary_default if self.partial_rotary_factor is None else self.partial_rotary_factor
        return int(self.dim_per_head * factor)

    @property
    def norm_params(self) -> int:
        """Parameters of one norm over the hidden size: LayerNorm has a bias beside its weight."""
        return (2 if self.traits.layer_norm else 1) * self.hidden_size

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_intermediate_size(self) -> int:
        """Width of one expert's MLP (the dense width for Mixtral and gpt-oss)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def num_sliding_layers(self) -> int:
        """Layers whose attention looks back at most sliding_window tokens."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None:
            return self.num_layers
        return sum(t == "sliding_attention" for t in self.layer_types)

    @property
    def qk_norm_width(self) -> int:
        """Elements per token the q/k RMSNorms read (and weights they hold): q and k of one token."""
        return {"head": self.q_size + self.kv_size, "full": self.q_size + self.kv_size}.get(self.traits.qk_norm, 0)

    @property
    def qk_norm_params(self) -> int:
        """Weights of the q/k norms of one block: per head (shared by the heads) or over all of q and k."""
        return {"head": 2 * self.dim_per_head, "full": self.q_size + self.kv_size}.get(self.traits.qk_norm, 0)

    def block_linears(self) -> tuple[LinearShape, ...]:
        """The weight matrices of one decoder block (a mixture-of-experts block where the model has them)."""
        return self._block_linears

    # Derived numbers are cached on the (frozen) instance: the planner estimates thousands of setups.
    @cached_property
    def _attention_linears(self) -> tuple[LinearShape, ...]:
        h, t = self.hidden_size, self.traits
        qkv_bias = t.qkv_bias or self.attention_bias
        if t.fused_qkv:
            attn = (LinearShape(t.qkv_name, h, self.q_size + 2 * self.kv_size, qkv_bias),)
        else:
            attn = (
                LinearShape("q_proj", h, self.q_size, qkv_bias),
                LinearShape("k_proj", h, self.kv_size, qkv_bias),
                LinearShape("v_proj", h, self.kv_size, qkv_bias),
            )
        out_bias = self.attention_bias or t.head_bias  # phi: every linear has a bias
        return attn + (LinearShape(t.out_proj, self.q_size, h, out_bias),)

    @cached_property
    def _dense_mlp(self) -> tuple[LinearShape, ...]:
        h, i = self.hidden_size, self.intermediate_size
        if self.traits.plain_mlp:
            up, down = self.traits.plain_mlp
            return (LinearShape(up, h, i, True), LinearShape(down, i, h, True))
        if self.traits.fused_gate_up:
            return (LinearShape("gate_up_proj", h, 2 * i), LinearShape("down_proj", i, h))
        return (
            LinearShape("gate_proj", h, i, self.mlp_bias),
            LinearShape("up_proj", h, i, self.mlp_bias),
            LinearShape("down_proj", i, h, self.mlp_bias),
        )

    @cached_property
    def _block_linears(self) -> tuple[LinearShape, ...]:
        h = self.hidden_size
        if not self.is_moe:
            return self._attention_linears + self._dense_mlp
        e, i = self.num_experts, self.expert_intermediate_size
        biased = self.traits.moe == "gpt_oss"
        mlp = (
            LinearShape("router" if biased else "gate", h, e, biased),
            LinearShape("experts.gate_up_proj", h, 2 * i, biased, experts=e),
            LinearShape("experts.down_proj", i, h, biased, experts=e),
        )
        return self._attention_linears + mlp

    @cached_property
    def _dense_block_linears(self) -> tuple[LinearShape, ...]:
        """A dense block of a mixture-of-experts model (Qwen3-MoE's mlp_only_layers)."""
        return self._attention_linears + self._dense_mlp

    @property
    def _block_extra_params(self) -> int:
        """Parameters of one block outside its linears: norms, q/k norms, attention sinks."""
        sinks = self.num_attention_heads if self.traits.attention_sinks else 0
        return self.traits.norms_per_layer * self.norm_params + self.qk_norm_params + sinks

    # ---- parameter counts -------------------------------------------------
    def params_by_kind(self) -> dict[str, int]:
        """Exact parameter counts per module kind (tied head counted once, under embedding)."""
        return dict(self._params_by_kind)

    @cached_property
    def _params_by_kind(self) -> dict[str, int]:
        attn = sum(l.params for l in self._attention_linears) + self.qk_norm_params
        attn += self.num_attention_heads if self.traits.attention_sinks else 0
        moe_mlp = sum(l.params for l in self._block_linears[len(self._attention_linears):])
        router = sum(l.params for l in self._block_linears if l.name in ("gate", "router")) if self.is_moe else 0
        dense_mlp = sum(l.params for l in self._dense_mlp)
        n_moe = self.num_moe_layers
        n_dense = self.num_layers - n_moe
        embed = self.vocab_size * self.hidden_size
        return {
            "embedding": embed,
            "attention": self.num_layers * attn,
            "mlp": n_moe * (moe_mlp - router) + n_dense * dense_mlp,
            "router": n_moe * router,
            "norm": (self.num_layers * self.traits.norms_per_layer + 1) * self.norm_params,
            "lm_head": (0 if self.tie_word_embeddings else embed) + (self.vocab_size if self.traits.head_bias else 0),
            "vision": self.vision.params if self.vision else 0,
        }

    @cached_property
    def total_params(self) -> int:
        return sum(self._params_by_kind.values())

    @cached_property
    def expert_params(self) -> int:
        """Parameters in the experts of all blocks (a token passes through experts_per_token of them)."""
        return self.num_moe_layers * sum(l.params for l in self._block_linears if l.experts > 1 or l.name.startswith("experts."))

    @cached_property
    def active_params(self) -> int:
        """Parameters one token of text passes through (top-k of the experts; not the vision tower)."""
        text = self.total_params - self._params_by_kind["vision"]
        if not self.is_moe:
            return text
        return text - self.expert_params + self.expert_params * self.experts_per_token // self.num_experts

    @cached_property
    def linear_params(self) -> int:
        """Parameters in the linears of all blocks (what NF4 quantises and autocast casts)."""
        n_moe = self.num_moe_layers
        return (n_moe * sum(l.params for l in self._block_linears)
                + (self.num_layers - n_moe) * sum(l.params for l in self._dense_block_linears))

    @cached_property
    def block_params(self) -> int:
        """Parameters of the largest decoder block (what FSDP all-gathers at a time)."""
        largest = self._block_linears if self.num_moe_layers else self._dense_block_linears
        return sum(l.params for l in largest) + self._block_extra_params

    def resolve_lora_targets(self, targets: str | tuple[str, ...]) -> tuple[LinearShape, ...]:
        """The block matrices LoRA adapts; `all-linear` is what peft adapts for the family (never the head).
        The output head may be named too (`head_adapted`): it is no block matrix, so it is not among these."""
        if isinstance(targets, list):
            targets = tuple(targets)
        return _resolve_lora_targets(self, targets)

    def block_kinds(self) -> tuple[tuple[tuple[LinearShape, ...], int], ...]:
        """The blocks' linears with how many blocks have them: mixture-of-experts blocks and the
        dense blocks of a model that mixes both (Qwen3-MoE's mlp_only_layers) apart."""
        n_moe = self.num_moe_layers
        if not n_moe:
            return ((self._block_linears, self.num_layers),)
        return tuple((linears, n) for linears, n in ((self._block_linears, n_moe),
                                                     (self._dense_block_linears, self.num_layers - n_moe)) if n)

    def adapted_linears(self, targets: str | tuple[str, ...]) -> tuple[tuple[LinearShape, int], ...]:
        """Each decoder linear LoRA adapts, with the number of blocks that have it."""
        if isinstance(targets, list):
            targets = tuple(targets)
        self.resolve_lora_targets(targets)  # names checked against the family's modules
        return tuple((lin, n) for linears, n in self.block_kinds() for lin in self._resolve_lora_targets(targets, linears))

    def _resolve_lora_targets(self, targets: str | tuple[str, ...], linears=None) -> tuple[LinearShape, ...]:
        linears = self.block_linears() if linears is None else linears
        known = self.traits.lora_targets
        if targets == "all-linear":
            adapted = self.traits.all_linear or known
            return tuple(l for l in linears if l.name.split(".")[0] in adapted)
        if isinstance(targets, str):
            targets = (targets,)
        if not targets:
            raise SizingError("lora_targets", "must name at least one module or be 'all-linear'")
        chosen = []
        head = self.traits.head_module
        for name in targets:
            if name == head:
                continue  # the output head's adapter (head_adapted), outside the blocks
            if name not in known:
                raise SizingError(
                    "lora_targets", f"{name!r} is not a linear layer of {self.family} blocks nor its output head "
                                    f"{head!r}; known: {', '.join(known + (head,))}"
                )
            chosen.extend(l for l in linears if l.name == name or l.name.startswith(name + "."))
        return tuple(chosen)

    def head_adapted(self, targets: str | tuple[str, ...]) -> bool:
        """Whether LoRA adapts the output head: only when the targets name it (peft's `all-linear`
        leaves the output layer out)."""
        return not isinstance(targets, str) and self.traits.head_module in targets

    def lora_trainable_params(self, rank: int, targets: str | tuple[str, ...] = "all-linear") -> int:
        """Trainable adapter parameters, exactly as peft creates them."""
        if isinstance(targets, list):
            targets = tuple(targets)
        return _lora_trainable_params(self, rank, targets)

    def _lora_trainable_params(self, rank: int, targets: str | tuple[str, ...]) -> int:
        if not isinstance(rank, int) or rank <= 0:
            raise SizingError("lora_rank", f"must be a positive integer, got {rank!r}")

        def per_block(linears) -> int:
            total = 0
            for lin in self._resolve_lora_targets(targets, linears):
                # peft's ParamWrapper gives each expert its own rank-r pair; for the fused
                # gate_up parameter it doubles the rank (observed with peft 0.21, tested).
                r = rank * lin.experts * (2 if lin.name == "experts.gate_up_proj" else 1)
                total += r * (lin.in_features + lin.out_features)
            return total

        self.resolve_lora_targets(targets)  # names checked against the family's modules
        n_moe = self.num_moe_layers
        dense = per_block(self._dense_block_linears) if self.num_layers > n_moe else 0
        vision = self.vision.lora_params(rank, targets) if self.vision else 0
        head = rank * (self.hidden_size + self.vocab_size) if self.head_adapted(targets) else 0
        return n_moe * per_block(self._block_linears) + (self.num_layers - n_moe) * dense + vision + head

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "") -> "ModelArchitecture":
        """Build from a Hugging Face `config.json` (as a dict), keys that do not matter ignored.

        A multimodal checkpoint whose decoder sits in `text_config` (Gemma 3) is sized by that
        decoder; errors then name `text_config.<key>`.
        """
        return cls(**architecture_fields(config, name))

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers turns back into this architecture."""
        cfg: dict[str, Any] = {
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            # Token ids do not change memory; keep them inside any vocabulary.
            "pad_token_id": None,
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
        if self.head_dim is not None:
            cfg["head_dim"] = self.head_dim
        if self.family in HONORS_ATTENTION_BIAS:
            cfg["attention_bias"] = self.attention_bias
        if self.family in HONORS_MLP_BIAS:
            cfg["mlp_bias"] = self.mlp_bias
        if self.traits.moe in ("mixtral", "gpt_oss"):
            cfg["num_local_experts"] = self.num_experts
            cfg["num_experts_per_tok"] = self.experts_per_token
        if self.traits.moe == "qwen3_moe":
            cfg["num_experts"] = self.num_experts
            cfg["num_experts_per_tok"] = self.experts_per_token
            cfg["moe_intermediate_size"] = self.expert_intermediate_size
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = list(self.dense_layers)
        if self.family in ("mistral", "mixtral", "qwen2", "gemma2", "phi3", "gemma3_text", "gpt_oss"):
            cfg["sliding_window"] = self.sliding_window
        if self.family in ("qwen2", "qwen3", "qwen3_moe") and self.sliding_window is not None:
            # transformers' Qwen configs slide only from max_window_layers on, and only when asked.
            first = self.layer_types.index("sliding_attention") if self.layer_types else 0
            cfg.update(use_sliding_window=True, sliding_window=self.sliding_window, max_window_layers=first)
        if self.layer_types is not None:
            cfg["layer_types"] = list(self.layer_types)
        if self.family in ("gemma2", "gemma3_text"):
            cfg["final_logit_softcapping"] = self.final_logit_softcapping
            cfg["attn_logit_softcapping"] = self.attn_logit_softcapping
        if self.traits.layer_norm:
            del cfg["rms_norm_eps"]
            cfg.update(layer_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act, attention_dropout=0.0)
        if self.family == "phi":
            cfg.update(partial_rotary_factor=self.partial_rotary_factor or self.traits.rotary_default,
                       resid_pdrop=self.residual_dropout, embd_pdrop=self.embedding_dropout, qk_layernorm=False)
        if self.family == "gpt_neox":
            # Pythia has neither grouped-query attention nor an MLP bias switch.
            del cfg["num_key_value_heads"]
            cfg.update(rotary_pct=self.partial_rotary_factor or self.traits.rotary_default,
                       rotary_emb_base=self.rope_theta, use_parallel_residual=self.parallel_residual,
                       hidden_dropout=self.residual_dropout)
        cfg.update(self.extra_hf_config)
        return cfg

    def with_layers(self, num_layers: int) -> "ModelArchitecture":
        """The same model cut to `num_layers` blocks (tests and the truth harness use shallow copies)."""
        return replace(
            self,
            num_layers=num_layers,
            dense_layers=tuple(i for i in self.dense_layers if i < num_layers),
            layer_types=None if self.layer_types is None else tuple(self.layer_types[:num_layers]),
        )


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SizingError(name, f"must be a positive integer, got {value!r}")


@lru_cache(maxsize=4096)
def _lora_trainable_params(arch: ModelArchitecture, rank: int, targets) -> int:
    return arch._lora_trainable_params(rank, targets)


@lru_cache(maxsize=4096)
def _resolve_lora_targets(arch: ModelArchitecture, targets) -> tuple[LinearShape, ...]:
    return arch._resolve_lora_targets(targets)
