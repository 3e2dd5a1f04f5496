"""Reading a whole Hugging Face config.json: the keys that decide memory, and nothing else.

A real config.json carries dozens of keys (token ids, rope scaling, dropout rates, the
transformers version, quantization settings, a vision tower's config). Only the keys
below change what a training step holds in memory; the rest are accepted as they are and
left to the trainer, which loads the same file. Each key that matters is checked for its
type here and named in the error; one that is missing is named too, unless transformers
itself gives it a default that every config of the family relies on (then the same default
is used here, so both sides size the same model).

`MEMORY_KEYS` documents them (the CRD's inline architecture lists the same keys).
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import SizingError, UnknownArchitecture
from .traits import FAMILIES, HONORS_ATTENTION_BIAS, HONORS_MLP_BIAS, LAYER_TYPES, PLAIN_MLP_ACTIVATIONS, WRAPPERS, VisionTower

# key -> what it decides. The keys read from config.json; everything else is ignored.
MEMORY_KEYS: dict[str, str] = {
    "model_type": "the family: which modules a block has",
    "vocab_size": "rows of the embedding and of the output head",
    "hidden_size": "width of the residual stream",
    "intermediate_size": "width of the dense MLP (of each expert for Mixtral and gpt-oss)",
    "num_hidden_layers": "number of decoder blocks",
    "num_attention_heads": "query heads",
    "num_key_value_heads": "key/value heads (grouped-query attention)",
    "head_dim": "width of one head",
    "tie_word_embeddings": "whether the output head shares the embedding matrix",
    "max_position_embeddings": "longest trained context (longer sequences give a note)",
    "attention_bias": "biases on q/k/v/o",
    "mlp_bias": "biases on the MLP (Llama, Granite)",
    "num_local_experts": "experts per MoE layer (Mixtral, gpt-oss)",
    "num_experts": "experts per MoE layer (Qwen3-MoE)",
    "num_experts_per_tok": "experts each token is routed to",
    "moe_intermediate_size": "width of each expert (Qwen3-MoE)",
    "decoder_sparse_step": "every n-th layer is MoE (Qwen3-MoE)",
    "mlp_only_layers": "layers that keep a dense MLP (Qwen3-MoE)",
    "sliding_window": "tokens a sliding-attention layer looks back",
    "use_sliding_window": "whether Qwen layers slide at all",
    "max_window_layers": "Qwen: layers from this index on slide",
    "layer_types": "per layer full_attention or sliding_attention",
    "sliding_window_pattern": "Gemma 3 (older configs): every n-th layer is global",
    "final_logit_softcapping": "tanh capping of the logits (extra vocab-sized tensors)",
    "attn_logit_softcapping": "tanh capping of attention scores (eager attention)",
    "text_config": "the decoder's config inside a multimodal config (Gemma 3)",
    # rope_parameters.partial_rotary_factor, where set, wins over these two (as in transformers).
    "partial_rotary_factor": "share of each head rotary rotates (phi; the cos/sin width)",
    "rotary_pct": "share of each head rotary rotates (gpt_neox)",
    "hidden_act": "the MLP activation (phi, gpt_neox: gelu_new saves several tensors, gelu one)",
    "resid_pdrop": "dropout on both residual branches (phi): a mask per branch",
    "embd_pdrop": "dropout on the embeddings (phi)",
    "hidden_dropout": "dropout on the embeddings and both residual branches (gpt_neox)",
    "attention_dropout": "dropout on the attention probabilities (phi, gpt_neox: only 0 is modelled)",
    "use_parallel_residual": "gpt_neox: attention and MLP both read the block input",
    "qk_layernorm": "phi: LayerNorms on q and k (not modelled; the published checkpoints have none)",
}

# Defaults of transformers 5's config classes for keys that real config.json files leave
# out (Gemma 3's text_config has neither vocab_size nor, for 4B/12B, head_dim): a missing
# key takes the same value in sizing as in the model the trainer builds.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262208, "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 131072},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192},
    "qwen2": {"sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"head_dim": 128, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3_moe": {"sliding_window": 4096, "max_window_layers": 28},
    "gpt_oss": {"head_dim": 64, "sliding_window": 128},
    "mistral": {"sliding_window": 4096},
    # phi and gpt_neox have no sliding windows and an attention bias of their own.
    "phi": {"max_position_embeddings": 2048},
    "gpt_neox": {"max_position_embeddings": 2048},
}

_MOE_COUNT_KEY = {"mixtral": "num_local_experts", "gpt_oss": "num_local_experts", "qwen3_moe": "num_experts"}


class _Reader:
    """Typed reads of one config mapping; errors name the key (prefixed inside text_config)."""

    def __init__(self, config: Mapping[str, Any], prefix: str = "", defaults: Mapping[str, Any] | None = None):
        self.config = config
        self.prefix = prefix
        self.defaults = defaults or {}

    def field(self, key: str) -> str:
        return self.prefix + key

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def need_int(self, key: str, why: str = "") -> int:
        if not self.has(key) and key in self.defaults:
            return self.defaults[key]
        if not self.has(key):
            raise SizingError(self.field(key), "missing from the config" + (f" ({why})" if why else ""))
        return self.int(key)

    def int(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        if value is None:
            return self.defaults.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SizingError(self.field(key), f"must be a positive integer, got {value!r}")
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SizingError(self.field(key), f"must be true or false, got {value!r}")
        return value

    def number(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SizingError(self.field(key), f"must be a number, got {value!r}")
        return float(value)

    def int_list(self, key: str) -> list[int]:
        value = self.config.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in value):
            raise SizingError(self.field(key), f"must be a list of layer indices, got {value!r}")
        return value


def _family_of(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any], str]:
    """(family, the decoder's config, the error prefix), unwrapping a multimodal config."""
    model_type = config.get("model_type")
    if model_type in WRAPPERS:
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise SizingError("text_config", f"a {model_type} config keeps its decoder in text_config, which is "
                              + ("missing" if text is None else f"not a mapping ({type(text).__name__})"))
        inner = text.get("model_type", WRAPPERS[model_type])
        if inner != WRAPPERS[model_type]:
            raise SizingError("text_config.model_type", f"a {model_type} config's decoder is {WRAPPERS[model_type]!r}, got {inner!r}")
        return WRAPPERS[model_type], text, "text_config."
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise UnknownArchitecture(model_type, tuple(sorted(FAMILIES)))
    return model_type, config, ""


def _layer_types(r: _Reader, family: str, layers: int, sliding: int | None) -> tuple[tuple[str, ...] | None, int | None]:
    """(layer_types, sliding_window) as transformers' config class derives them."""
    explicit = r.config.get("layer_types")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        # Qwen slides only when use_sliding_window says so, and then from max_window_layers on.
        if not r.bool("use_sliding_window", False):
            sliding = None
    if explicit is not None:
        if not isinstance(explicit, list) or any(t not in LAYER_TYPES for t in explicit):
            raise SizingError(r.field("layer_types"), f"must be a list of {' / '.join(LAYER_TYPES)}, got {explicit!r}")
        if len(explicit) != layers:
            raise SizingError(r.field("layer_types"), f"has {len(explicit)} entries for num_hidden_layers {layers}")
        if sliding is None:
            # Without a window every layer attends to all (transformers makes them full).
            return None, None
        return tuple(explicit), sliding
    if sliding is None:
        return None, None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        first = r.int("max_window_layers") if r.config.get("max_window_layers") != 0 else 0
        return tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers)), sliding
    if family == "gemma3_text":
        pattern = r.int("sliding_window_pattern", 6)
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)), sliding
    if family == "gpt_oss":
        return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)), sliding
    return None, sliding  # Mistral, Mixtral, Phi-3, Gemma 2 as before: every layer slides


def architecture_fields(config: Mapping[str, Any], name: str = "") -> dict[str, Any]:
    """The ModelArchitecture keyword arguments of a config.json; raises SizingError naming the key."""
    if not isinstance(config, Mapping):
        raise SizingError("config", f"must be a mapping (a parsed config.json), got {type(config).__name__}")
    family, inner, prefix = _family_of(config)
    traits = FAMILIES[family]
    r = _Reader(inner, prefix, FAMILY_DEFAULTS.get(family))
    heads = r.need_int("num_attention_heads")
    vocab, hidden, inter = r.need_int("vocab_size"), r.need_int("hidden_size"), r.need_int("intermediate_size")
    layers = r.need_int("num_hidden_layers")
    head_dim = r.int("head_dim")
    # An explicit null means no window; an absent key the family's default.
    if "sliding_window" in inner:
        sliding = None if inner["sliding_window"] is None else r.int("sliding_window")
    else:
        sliding = r.defaults.get("sliding_window")
    layer_types, sliding = _layer_types(r, family, layers, sliding)
    fields: dict[str, Any] = dict(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=r.int("num_key_value_heads", heads),
        head_dim=head_dim,
        # A multimodal wrapper may say it at the top level.
        tie_word_embeddings=r.bool("tie_word_embeddings", _Reader(config).bool("tie_word_embeddings", traits.tie_default)),
        max_position_embeddings=r.int("max_position_embeddings", 4096),
        attention_bias=r.bool("attention_bias", traits.attention_bias_default) and family in HONORS_ATTENTION_BIAS,
        mlp_bias=r.bool("mlp_bias", False) and family in HONORS_MLP_BIAS,
        sliding_window=sliding,
        layer_types=layer_types,
        final_logit_softcapping=r.number("final_logit_softcapping"),
        attn_logit_softcapping=r.number("attn_logit_softcapping"),
        rope_theta=_rope_theta(inner),
        rms_norm_eps=_number_or(inner.get("rms_norm_eps"), 1e-5),
        name=name or (config.get("_name_or_path") if isinstance(config.get("_name_or_path"), str) else ""),
    )
    if traits.layer_norm:
        fields.update(_gpt_layout_fields(r, family))
    if traits.moe:
        count_key = _MOE_COUNT_KEY[traits.moe]
        if not r.has(count_key):
            # transformers writes either spelling back (its attribute_map aliases them).
            other = "num_experts" if count_key == "num_local_experts" else "num_local_experts"
            count_key = other if r.has(other) else count_key
        fields["num_experts"] = r.need_int(count_key, "a mixture-of-experts model")
        fields["experts_per_token"] = r.need_int("num_experts_per_tok", "a mixture-of-experts model")
        if fields["experts_per_token"] > fields["num_experts"]:
            raise SizingError(r.field("num_experts_per_tok"),
                              f"{fields['experts_per_token']} exceeds {count_key} ({fields['num_experts']})")
    if traits.moe == "qwen3_moe":
        fields["moe_intermediate_size"] = r.need_int("moe_intermediate_size", "the width of each expert")
        step = r.int("decoder_sparse_step", 1)
        only = set(r.int_list("mlp_only_layers"))
        bad = sorted(i for i in only if i >= layers)
        if bad:
            raise SizingError(r.field("mlp_only_layers"), f"layers {bad} do not exist (num_hidden_layers {layers})")
        # transformers: a layer is sparse unless listed, and only every decoder_sparse_step-th.
        fields["dense_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if prefix and config.get("vision_config") is not None:
        fields["vision"] = _vision_tower(config["vision_config"], hidden)
    return fields


def _rate(r: _Reader, key: str) -> float:
    """A dropout rate: a number in [0, 1) (absent: 0, as transformers' phi and gpt_neox configs default)."""
    value = r.number(key, 0.0)
    if not 0 <= value < 1:
        raise SizingError(r.field(key), f"must be a dropout rate in [0, 1), got {value!r}")
    return value


def _gpt_layout_fields(r: _Reader, family: str) -> dict[str, Any]:
    """phi and gpt_neox: partial rotary, the MLP activation, dropout, gpt_neox's parallel residual.

    The rotary share is read as transformers 5 reads it: rope_parameters' partial_rotary_factor
    first, then the top-level key (phi partial_rotary_factor, gpt_neox rotary_pct), then the
    config class's default (0.5, 0.25).
    """
    rope = r.config.get("rope_parameters")
    key = "partial_rotary_factor" if family == "phi" else "rotary_pct"
    if isinstance(rope, Mapping) and rope.get("partial_rotary_factor") is not None:
        factor = _Reader(rope, r.field("rope_parameters.")).number("partial_rotary_factor")
        where = "rope_parameters.partial_rotary_factor"
    else:
        factor, where = r.number(key), key
    if factor is not None and not 0 < factor <= 1:
        raise SizingError(r.field(where), f"must be a share of the head in (0, 1], got {factor!r}")
    act = r.config.get("hidden_act", "gelu_new" if family == "phi" else "gelu")
    if act not in PLAIN_MLP_ACTIVATIONS:
        raise SizingError(r.field("hidden_act"), f"{act!r} is not modelled for {family}; known: {', '.join(PLAIN_MLP_ACTIVATIONS)}")
    if _rate(r, "attention_dropout"):
        raise SizingError(r.field("attention_dropout"), "dropout on the attention probabilities is not modelled "
                          "(the published phi and Pythia checkpoints have 0)")
    fields: dict[str, Any] = dict(partial_rotary_factor=factor, hidden_act=act,
                                  rms_norm_eps=_number_or(r.config.get("layer_norm_eps"), 1e-5))
    if family == "phi":
        if r.bool("qk_layernorm", False):
            raise SizingError(r.field("qk_layernorm"), "phi's q/k LayerNorms are not modelled (the published phi-1.5 "
                              "and phi-2 have none)")
        fields.update(residual_dropout=_rate(r, "resid_pdrop"), embedding_dropout=_rate(r, "embd_pdrop"))
    else:
        rate = _rate(r, "hidden_dropout")
        fields.update(residual_dropout=rate, embedding_dropout=rate,
                      parallel_residual=r.bool("use_parallel_residual", True),
                      # transformers' GPTNeoX: heads of hidden_size / num_attention_heads, no grouped kv.
                      num_key_value_heads=r.need_int("num_attention_heads"), head_dim=None,
                      rope_theta=_number_or(r.config.get("rotary_emb_base"), _rope_theta(r.config)))
    return fields


def _vision_tower(vision: Any, text_hidden: int) -> VisionTower:
    """A SigLIP vision_config (Gemma 3); defaults are transformers' SiglipVisionConfig's."""
    if not isinstance(vision, Mapping):
        raise SizingError("vision_config", f"must be a mapping, got {type(vision).__name__}")
    r = _Reader(vision, "vision_config.", {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                           "patch_size": 16, "image_size": 224, "num_channels": 3})
    return VisionTower(
        hidden_size=r.need_int("hidden_size"), intermediate_size=r.need_int("intermediate_size"),
        num_layers=r.need_int("num_hidden_layers"), patch_size=r.need_int("patch_size"),
        image_size=r.need_int("image_size"), text_hidden_size=text_hidden, num_channels=r.need_int("num_channels"),
    )


def _number_or(value: Any, default: float) -> float:
    """A number that does not change memory: a malformed one is the trainer's business, not sizing's."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters")
    nested = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    return _number_or(config.get("rope_theta", nested), 10000.0)
