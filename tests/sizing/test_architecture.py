"""Parameter counts against the modules transformers/peft really build (on the meta device)."""

import warnings

import pytest

from finetune_operator.sizing.presets import preset
from finetune_operator.sizing import MODULE_KINDS, PRESETS, ModelArchitecture, SizingError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _kind(name: str) -> str:
    if "vision_tower" in name or "multi_modal_projector" in name:
        return "vision"
    if "embed_tokens" in name or "embed_in." in name:
        return "embedding"
    if name.startswith("lm_head") or name.startswith("embed_out"):
        return "lm_head"
    if ".self_attn." in name or ".attention." in name:
        return "attention"
    if ".mlp.gate." in name or ".mlp.router." in name:
        return "router"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norm"
    raise AssertionError(f"unclassified parameter {name}")


def _meta_model(arch: ModelArchitecture):
    config = transformers.AutoConfig.for_model(**arch.to_hf_config())
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


def _counts(model) -> dict:
    counts = dict.fromkeys(MODULE_KINDS, 0)
    for name, p in model.named_parameters():  # tied weights appear once
        counts[_kind(name)] += p.numel()
    return counts


# Full-depth presets of each family; the deepest ones are cut to a few layers
# (the per-layer count is what matters; depth is a multiplication).
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_counts_match_transformers(preset):
    arch = PRESETS[preset]
    shallow = arch.with_layers(min(arch.num_layers, 3))
    model = _meta_model(shallow)
    assert _counts(model) == shallow.params_by_kind()
    assert sum(p.numel() for p in model.parameters()) == shallow.total_params


PUBLISHED_TOTALS = {  # from the model cards / safetensors metadata
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mistral-7b-v0.3": 7_248_023_552,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
    # Issue 28 (model cards; the Pythia paper's table of total parameters).
    "phi-1_5": 1_418_270_720,
    "phi-2": 2_779_683_840,
    "pythia-1b": 1_011_781_632,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
}


@pytest.mark.parametrize("preset,total", sorted(PUBLISHED_TOTALS.items()))
def test_full_depth_totals(preset, total):
    assert PRESETS[preset].total_params == total


def test_full_depth_8b_on_meta():
    arch = PRESETS["llama-3.1-8b"]
    assert sum(p.numel() for p in _meta_model(arch).parameters()) == arch.total_params


def _small(family_name, **kw):
    kw.setdefault("family", family_name)
    base = dict( vocab_size=512, hidden_size=96, intermediate_size=160, num_layers=2,
                num_attention_heads=6, num_key_value_heads=2)
    base.update(kw)
    return ModelArchitecture(**base)


SMALL = {
    "llama": _small("llama"),
    "llama-bias": _small("llama", attention_bias=True, mlp_bias=True, head_dim=32),
    "mistral": _small("mistral"),
    "mixtral": _small("mixtral", num_experts=3, experts_per_token=2),
    "qwen2": _small("qwen2", tie_word_embeddings=True),
    "gemma2": _small("gemma2", head_dim=24, tie_word_embeddings=True),
    "phi3": _small("phi3", num_key_value_heads=6),
    # The families of 2026 (issue 16).
    "qwen3": _small("qwen3", head_dim=32),
    "qwen3_moe": _small("qwen3_moe", head_dim=32, num_experts=4, experts_per_token=2, moe_intermediate_size=48),
    "qwen3_moe-dense-layer": _small("qwen3_moe", head_dim=32, num_experts=4, experts_per_token=2,
                                    moe_intermediate_size=48, dense_layers=(1,)),
    "gemma3_text": _small("gemma3_text", head_dim=24, tie_word_embeddings=True, sliding_window=64,
                          layer_types=("sliding_attention", "full_attention")),
    "gpt_oss": _small("gpt_oss", head_dim=16, num_experts=4, experts_per_token=2, attention_bias=True,
                      sliding_window=32, layer_types=("sliding_attention", "full_attention")),
    "olmo2": _small("olmo2"),
    "granite": _small("granite", tie_word_embeddings=True),
    # Issue 28: LayerNorm with bias, non-gated biased MLP; phi's head has a bias even when tied.
    "phi": _small("phi", num_key_value_heads=6),
    "phi-gqa-tied": _small("phi", tie_word_embeddings=True, partial_rotary_factor=0.4, hidden_act="gelu"),
    "gpt_neox": _small("gpt_neox", num_key_value_heads=6, attention_bias=True),
    "gpt_neox-unbiased-sequential": _small("gpt_neox", num_key_value_heads=6, parallel_residual=False),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_counts_and_hf_round_trip(name):
    arch = SMALL[name]
    assert _counts(_meta_model(arch)) == arch.params_by_kind()
    config = transformers.AutoConfig.for_model(**arch.to_hf_config()).to_dict()
    assert ModelArchitecture.from_hf_config(config).params_by_kind() == arch.params_by_kind()


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("rank", [4, 16])
def test_lora_all_linear_matches_peft(name, rank):
    peft = pytest.importorskip("peft")
    arch = SMALL[name]
    model = peft.get_peft_model(_meta_model(arch), peft.LoraConfig(r=rank, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == arch.lora_trainable_params(rank, "all-linear")


def test_lora_named_targets_match_peft():
    peft = pytest.importorskip("peft")
    arch = SMALL["qwen2"]
    targets = ("q_proj", "v_proj")
    model = peft.get_peft_model(_meta_model(arch), peft.LoraConfig(r=8, target_modules=list(targets)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == arch.lora_trainable_params(8, targets)


def test_unknown_preset_lists_known():
    with pytest.raises(SizingError, match="llama-3.1-8b") as err:
        preset("llama-9")
    assert err.value.field == "preset"


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_attention_heads=5), "num_attention_heads"),
        (dict(num_key_value_heads=4), "num_key_value_heads"),
        (dict(num_layers=0), "num_layers"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(family="gpt2"), "family"),
    ],
)
def test_inconsistent_architecture_names_field(kw, field):
    with pytest.raises(SizingError) as err:
        _small("llama", **kw)
    assert err.value.field == field


def test_unknown_lora_target_names_field():
    with pytest.raises(SizingError, match="lora_targets"):
        SMALL["phi3"].lora_trainable_params(8, ("q_proj",))


def test_hf_config_missing_key():
    with pytest.raises(SizingError, match="hidden_size"):
        ModelArchitecture.from_hf_config({"model_type": "llama", "vocab_size": 10, "num_attention_heads": 2})
