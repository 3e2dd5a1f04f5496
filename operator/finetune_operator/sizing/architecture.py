"""Decoder-only model architectures and their exact parameter counts.

The counts mirror the module structure transformers builds for each family
(checked in tests/sizing/test_architecture.py against models built on the meta
device). Family differences that change parameter counts or activation shapes are
held in `FamilyTraits`, one row per supported `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Mapping

from .errors import SizingError, UnknownArchitecture

# Names of the linear layers of a decoder block that LoRA may target, per family.
_DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Mixtral in transformers 5 keeps its experts as 3-D parameters (not nn.Linear);
# peft's "all-linear" targets the router and those parameters too.
_MOE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts")


@dataclass(frozen=True)
class FamilyTraits:
    """Structural facts of one transformers `model_type` that the config does not spell out."""

    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2)
    norms_per_layer: int  # RMSNorms per decoder block (Gemma 2 has four)
    fused_qkv: bool  # one qkv_proj instead of q/k/v (Phi-3)
    fused_gate_up: bool  # one gate_up_proj instead of gate/up (Phi-3)
    lora_targets: tuple[str, ...]
    # Activation function of the MLP: "silu" or "gelu_tanh"; both keep the same tensors.
    scales_embeddings: bool = False  # Gemma multiplies the embeddings by sqrt(hidden)


FAMILIES: dict[str, FamilyTraits] = {
    "llama": FamilyTraits(False, 2, False, False, _DENSE_TARGETS),
    "mistral": FamilyTraits(False, 2, False, False, _DENSE_TARGETS),
    "mixtral": FamilyTraits(False, 2, False, False, _MOE_TARGETS),
    "qwen2": FamilyTraits(True, 2, False, False, _DENSE_TARGETS),
    "gemma2": FamilyTraits(False, 4, False, False, _DENSE_TARGETS, scales_embeddings=True),
    "phi3": FamilyTraits(False, 2, True, True, _PHI3_TARGETS),
}

MODULE_KINDS = ("embedding", "attention", "mlp", "router", "norm", "lm_head")


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
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # Llama/Gemma 2 config flag (q/k/v/o bias)
    mlp_bias: bool = False  # Llama config flag
    num_experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    sliding_window: int | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    name: str = ""
    extra_hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnknownArchitecture(self.family, tuple(sorted(FAMILIES)), field="family")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SizingError(name, f"must be a positive integer, got {value!r}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise SizingError(
                "num_attention_heads",
                f"{self.num_attention_heads} heads do not divide hidden_size {self.hidden_size} "
                "(give head_dim explicitly if the model uses one)",
            )
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim <= 0):
            raise SizingError("head_dim", f"must be a positive integer, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SizingError(
                "num_key_value_heads",
                f"{self.num_key_value_heads} key/value heads do not divide {self.num_attention_heads} attention heads",
            )
        if self.family == "mixtral":
            if self.num_experts < 1:
                raise SizingError("num_experts", "a mixture-of-experts family needs num_experts >= 1")
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise SizingError(
                    "experts_per_token", f"must be between 1 and num_experts ({self.num_experts}), got {self.experts_per_token}"
                )
        elif self.num_experts:
            raise SizingError("num_experts", f"family {self.family!r} is dense; num_experts must be 0")

    # ---- derived shapes -------------------------------------------------
    @property
    def traits(self) -> FamilyTraits:
        return FAMILIES[self.family]

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.dim_per_head

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def block_linears(self) -> tuple[LinearShape, ...]:
        """The weight matrices of one decoder block, by the names transformers gives them."""
        return self._block_linears

    # Derived numbers are cached on the (frozen) instance: the planner estimates thousands of setups.
    @cached_property
    def _block_linears(self) -> tuple[LinearShape, ...]:
        h, i, t = self.hidden_size, self.intermediate_size, self.traits
        qkv_bias = t.qkv_bias or self.attention_bias
        if t.fused_qkv:
            attn = (LinearShape("qkv_proj", h, self.q_size + 2 * self.kv_size),)
        else:
            attn = (
                LinearShape("q_proj", h, self.q_size, qkv_bias),
                LinearShape("k_proj", h, self.kv_size, qkv_bias),
                LinearShape("v_proj", h, self.kv_size, qkv_bias),
            )
        attn += (LinearShape("o_proj", self.q_size, h, self.attention_bias),)
        if self.is_moe:
            e = self.num_experts
            mlp = (
                LinearShape("gate", h, e),
                LinearShape("experts.gate_up_proj", h, 2 * i, experts=e),
                LinearShape("experts.down_proj", i, h, experts=e),
            )
        elif t.fused_gate_up:
            mlp = (LinearShape("gate_up_proj", h, 2 * i), LinearShape("down_proj", i, h))
        else:
            mlp = (
                LinearShape("gate_proj", h, i, self.mlp_bias),
                LinearShape("up_proj", h, i, self.mlp_bias),
                LinearShape("down_proj", i, h, self.mlp_bias),
            )
        return attn + mlp

    # ---- parameter counts -------------------------------------------------
    def params_by_kind(self) -> dict[str, int]:
        """Exact parameter counts per module kind (tied head counted once, under embedding)."""
        return dict(self._params_by_kind)

    @cached_property
    def _params_by_kind(self) -> dict[str, int]:
        linears = self.block_linears()
        attn = sum(l.params for l in linears if l.name in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"))
        router = sum(l.params for l in linears if l.name == "gate")
        mlp = sum(l.params for l in linears) - attn - router
        embed = self.vocab_size * self.hidden_size
        return {
            "embedding": embed,
            "attention": self.num_layers * attn,
            "mlp": self.num_layers * mlp,
            "router": self.num_layers * router,
            "norm": (self.num_layers * self.traits.norms_per_layer + 1) * self.hidden_size,
            "lm_head": 0 if self.tie_word_embeddings else embed,
        }

    @cached_property
    def total_params(self) -> int:
        return sum(self._params_by_kind.values())

    @cached_property
    def linear_params(self) -> int:
        """Parameters in the linears of all blocks (what NF4 quantises and autocast casts)."""
        return self.num_layers * sum(l.params for l in self.block_linears())

    @cached_property
    def block_params(self) -> int:
        """Parameters of one decoder block (what FSDP all-gathers at a time)."""
        return sum(l.params for l in self.block_linears()) + self.traits.norms_per_layer * self.hidden_size

    def resolve_lora_targets(self, targets: str | tuple[str, ...]) -> tuple[LinearShape, ...]:
        """The block matrices LoRA adapts; `all-linear` is every linear of the blocks (never the head)."""
        if isinstance(targets, list):
            targets = tuple(targets)
        return _resolve_lora_targets(self, targets)

    def _resolve_lora_targets(self, targets: str | tuple[str, ...]) -> tuple[LinearShape, ...]:
        linears = self.block_linears()
        if targets == "all-linear":
            return linears
        if isinstance(targets, str):
            targets = (targets,)
        if not targets:
            raise SizingError("lora_targets", "must name at least one module or be 'all-linear'")
        known = self.traits.lora_targets
        chosen = []
        for name in targets:
            if name not in known:
                raise SizingError(
                    "lora_targets", f"{name!r} is not a linear layer of {self.family} blocks; known: {', '.join(known)}"
                )
            chosen.extend(l for l in linears if l.name == name or l.name.startswith(name + "."))
        return tuple(chosen)

    def lora_trainable_params(self, rank: int, targets: str | tuple[str, ...] = "all-linear") -> int:
        """Trainable adapter parameters, exactly as peft creates them."""
        if isinstance(targets, list):
            targets = tuple(targets)
        return _lora_trainable_params(self, rank, targets)

    def _lora_trainable_params(self, rank: int, targets: str | tuple[str, ...]) -> int:
        if not isinstance(rank, int) or rank <= 0:
            raise SizingError("lora_rank", f"must be a positive integer, got {rank!r}")
        per_block = 0
        for lin in self.resolve_lora_targets(targets):
            # peft's ParamWrapper gives each expert its own rank-r pair; for the fused
            # gate_up parameter it doubles the rank (observed with peft 0.21, tested).
            r = rank * lin.experts * (2 if lin.name == "experts.gate_up_proj" else 1)
            per_block += r * (lin.in_features + lin.out_features)
        return self.num_layers * per_block

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str) -> "ModelArchitecture":
        from .presets import PRESETS

        try:
            return PRESETS[name]
        except KeyError:
            raise SizingError("preset", f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str = "") -> "ModelArchitecture":
        """Build from a Hugging Face `config.json` (as a dict)."""
        if not isinstance(config, Mapping):
            raise SizingError("config", f"must be a mapping (a parsed config.json), got {type(config).__name__}")
        family = config.get("model_type")
        if family not in FAMILIES:
            raise UnknownArchitecture(family, tuple(sorted(FAMILIES)))

        def need(key: str) -> Any:
            if key not in config or config[key] is None:
                raise SizingError(key, "missing from the config")
            return config[key]

        heads = need("num_attention_heads")
        rope = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, Mapping) else 10000.0)
        tie_default = family == "gemma2"
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", tie_default)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            attention_bias=bool(config.get("attention_bias", False)) and family in ("llama", "gemma2"),
            mlp_bias=bool(config.get("mlp_bias", False)) and family == "llama",
            num_experts=config.get("num_local_experts", 0) if family == "mixtral" else 0,
            experts_per_token=config.get("num_experts_per_tok", 0) if family == "mixtral" else 0,
            sliding_window=config.get("sliding_window"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            name=name or str(config.get("_name_or_path", "")),
        )

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
        if self.family in ("llama", "gemma2"):
            cfg["attention_bias"] = self.attention_bias
        if self.family == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        if self.family == "mixtral":
            cfg["num_local_experts"] = self.num_experts
            cfg["num_experts_per_tok"] = self.experts_per_token
        if self.family in ("mistral", "mixtral", "qwen2", "gemma2", "phi3"):
            cfg["sliding_window"] = self.sliding_window
        if self.family == "gemma2":
            cfg["final_logit_softcapping"] = self.final_logit_softcapping
            cfg["attn_logit_softcapping"] = self.attn_logit_softcapping
        cfg.update(self.extra_hf_config)
        return cfg

    def with_layers(self, num_layers: int) -> "ModelArchitecture":
        """The same model cut to `num_layers` blocks (tests and the truth harness use shallow copies)."""
        return replace(self, num_layers=num_layers)


@lru_cache(maxsize=4096)
def _lora_trainable_params(arch: ModelArchitecture, rank: int, targets) -> int:
    return arch._lora_trainable_params(rank, targets)


@lru_cache(maxsize=4096)
def _resolve_lora_targets(arch: ModelArchitecture, targets) -> tuple[LinearShape, ...]:
    return arch._resolve_lora_targets(targets)
