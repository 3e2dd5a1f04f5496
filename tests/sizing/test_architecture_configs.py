"""Whole, real config.json files (tests/sizing/configs/, copied from the public model repos):
sizing reads the keys that decide memory, keeps the rest, and names what is wrong or missing.

Each file is checked three ways: against the preset of the same model, against the model
transformers builds from the very same file on the meta device (so defaults the file relies
on are read as transformers reads them), and through the FineTuneJob API and its CRD schema.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import jsonschema
import pytest

from finetune_operator import api, crd
from finetune_operator.sizing import PRESETS, ModelArchitecture, SizingError, UnknownArchitecture
from finetune_operator.sizing.from_job import architecture_of
from finetune_operator.sizing.hf_config import MEMORY_KEYS

CONFIGS = Path(__file__).parent / "configs"

# file -> (model_type family it is sized as, the preset of the same model, published total parameters)
REAL = {
    "llama-3.1-8b.json": ("llama", "llama-3.1-8b", 8_030_261_248),
    "mistral-7b-v0.3.json": ("mistral", "mistral-7b-v0.3", 7_248_023_552),
    "qwen2.5-7b.json": ("qwen2", "qwen2.5-7b", 7_615_616_512),
    "qwen3-8b.json": ("qwen3", "qwen3-8b", 8_190_735_360),
    "qwen3-30b-a3b.json": ("qwen3_moe", "qwen3-30b-a3b", 30_532_122_624),
    "gemma-3-1b-pt.json": ("gemma3_text", "gemma-3-1b", 999_885_952),
    # The multimodal checkpoint: the decoder of the preset plus the SigLIP tower and projector.
    "gemma-3-12b-pt.json": ("gemma3_text", "gemma-3-12b-text", 12_187_325_040),
    "gpt-oss-20b.json": ("gpt_oss", "gpt-oss-20b", 20_914_757_184),
    "olmo-2-1124-7b.json": ("olmo2", "olmo-2-7b", 7_298_617_344),
    "granite-3.1-8b-base.json": ("granite", "granite-3.1-8b", 8_170_848_256),
    # Issue 28: phi-2 (resid_pdrop 0.1, partial_rotary_factor 0.4) and Pythia-1B (rotary_pct,
    # no num_key_value_heads, attention_bias left to GPTNeoXConfig's default).
    "phi-2.json": ("phi", "phi-2", 2_779_683_840),
    "pythia-1b.json": ("gpt_neox", "pythia-1b", 1_011_781_632),
}


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_phi_and_pythia_read_what_transformers_reads():
    """The rotary share from rope_parameters over the top-level key (as transformers 5), the
    config class's defaults where a key is absent, and gpt_neox's one hidden_dropout."""
    phi = _config("phi-2.json")
    assert ModelArchitecture.from_hf_config(phi).rotary_dim == 32  # 0.4 of 80
    phi["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert ModelArchitecture.from_hf_config(phi).rotary_dim == 40
    for key in ("partial_rotary_factor", "rope_parameters", "hidden_act", "resid_pdrop"):
        phi.pop(key, None)
    bare = ModelArchitecture.from_hf_config(phi)  # PhiConfig's defaults: 0.5, gelu_new, no dropout
    assert (bare.rotary_dim, bare.hidden_act, bare.residual_dropout) == (40, "gelu_new", 0.0)
    pythia = _config("pythia-1b.json")
    pythia.update(hidden_dropout=0.1, use_parallel_residual=False)
    arch = ModelArchitecture.from_hf_config(pythia)
    assert (arch.residual_dropout, arch.embedding_dropout, arch.parallel_residual, arch.rotary_dim) == (0.1, 0.1, False, 64)
    pythia.pop("rotary_pct")
    assert ModelArchitecture.from_hf_config(pythia).rotary_dim == 64  # GPTNeoXConfig's default, 0.25


def test_at_least_seven_real_configs():
    assert len(REAL) >= 7 and sorted(REAL) == sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_matches_its_preset(name):
    family, preset, published = REAL[name]
    arch = ModelArchitecture.from_hf_config(_config(name))
    want = PRESETS[preset]
    assert arch.family == family
    assert arch.total_params == published
    decoder = {k: v for k, v in arch.params_by_kind().items() if k != "vision"}
    assert decoder == {k: v for k, v in want.params_by_kind().items() if k != "vision"}
    for field in ("hidden_size", "num_layers", "dim_per_head", "num_key_value_heads", "vocab_size",
                  "tie_word_embeddings", "num_sliding_layers", "num_experts", "experts_per_token",
                  "rotary_dim", "hidden_act", "residual_dropout", "embedding_dropout", "parallel_residual"):
        assert getattr(arch, field) == getattr(want, field), field


def _shrunk(config: dict, layers: int = 2) -> dict:
    """The same config cut to a few layers (the per-layer structure is what is compared)."""
    config = copy.deepcopy(config)
    inner = config.get("text_config", config)
    inner["num_hidden_layers"] = layers
    if isinstance(inner.get("layer_types"), list):
        inner["layer_types"] = inner["layer_types"][:layers]
    if "vision_config" in config:
        config["vision_config"]["num_hidden_layers"] = 1
    return config


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_counts_equal_transformers_on_meta(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = _shrunk(_config(name))
    config.pop("quantization_config", None)  # gpt-oss: sized dequantised (bf16), as it trains
    hf = transformers.AutoConfig.for_model(**config)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == ModelArchitecture.from_hf_config(config).total_params


def test_gemma3_multimodal_lora_all_linear_matches_peft():
    """peft's all-linear adapts the vision tower's linears too; sizing counts them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = _shrunk(_config("gemma-3-12b-pt.json"))
    hf = transformers.AutoConfig.for_model(**config)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(hf)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == ModelArchitecture.from_hf_config(config).lora_trainable_params(8, "all-linear")


# ---- through the API: a whole config.json is an inline architecture ----------------------


def _schema() -> dict:
    """The CRD schema for jsonschema's Draft 4, which spells Kubernetes' `nullable: true` as a null type."""
    schema = copy.deepcopy(crd.openapi_schema())

    def walk(node):
        if isinstance(node, dict):
            if node.get("nullable") and isinstance(node.get("type"), str):
                node["type"] = [node["type"], "null"]
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(schema)
    return schema


def _job_with_inline(lora_job: dict, config: dict) -> dict:
    lora_job["spec"]["model"]["architecture"] = {"inline": config}
    return lora_job


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_accepted_inline_and_kept_whole(name, lora_job):
    config = _config(name)
    doc = _job_with_inline(lora_job, copy.deepcopy(config))
    assert not list(jsonschema.Draft4Validator(_schema()).iter_errors(doc))
    job = api.parse_job(doc)
    assert job.spec.model.architecture.inline.config_json() == config  # every key, nulls included
    arch = architecture_of(job.spec)
    assert arch.total_params == REAL[name][2]


def test_a_configmap_config_is_sized_the_same(lora_job):
    config = _config("qwen3-30b-a3b.json")
    lora_job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "qwen3", "key": "config.json"}}
    job = api.parse_job(lora_job)
    assert architecture_of(job.spec, config) == ModelArchitecture.from_hf_config(config, name=job.spec.model.name)


@pytest.mark.parametrize(
    "name,mutate,field",
    [
        ("qwen3-8b.json", lambda c: c.pop("hidden_size"), "hidden_size"),
        ("qwen3-30b-a3b.json", lambda c: c.pop("moe_intermediate_size"), "moe_intermediate_size"),
        ("qwen3-30b-a3b.json", lambda c: c.pop("num_experts"), "num_experts"),
        ("gpt-oss-20b.json", lambda c: c.pop("num_experts_per_tok"), "num_experts_per_tok"),
        ("gemma-3-12b-pt.json", lambda c: c["text_config"].pop("num_hidden_layers"), "text_config.num_hidden_layers"),
        ("gemma-3-12b-pt.json", lambda c: c.pop("text_config"), "text_config"),
        ("gpt-oss-20b.json", lambda c: c["layer_types"].pop(), "layer_types"),
        ("qwen3-30b-a3b.json", lambda c: c.update(mlp_only_layers=[60]), "mlp_only_layers"),
        ("gemma-3-1b-pt.json", lambda c: c.update(sliding_window_pattern=0), "sliding_window_pattern"),
        ("gemma-3-12b-pt.json", lambda c: c["vision_config"].update(patch_size="14"), "vision_config.patch_size"),
        ("phi-2.json", lambda c: c.update(hidden_act="relu"), "hidden_act"),
        ("phi-2.json", lambda c: c.update(qk_layernorm=True), "qk_layernorm"),
        ("phi-2.json", lambda c: c.update(attention_dropout=0.1), "attention_dropout"),
        ("phi-2.json", lambda c: c.update(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.5}),
         "rope_parameters.partial_rotary_factor"),
        ("pythia-1b.json", lambda c: c.pop("intermediate_size"), "intermediate_size"),
    ],
)
def test_a_key_that_matters_is_named(name, mutate, field, lora_job):
    config = _config(name)
    mutate(config)
    with pytest.raises(SizingError) as caught:
        ModelArchitecture.from_hf_config(config)
    assert caught.value.field == field
    # ... and the API refuses the job, naming it.
    with pytest.raises(api.JobValidationError) as refused:
        api.parse_job(_job_with_inline(lora_job, config))
    assert any(field in p.path or p.message.startswith(field) for p in refused.value.problems), refused.value.problems


@pytest.mark.parametrize(
    "key,value",
    [("hidden_size", "4096"), ("tie_word_embeddings", "no"), ("num_key_value_heads", 0), ("sliding_window", -1),
     ("head_dim", 12.5), ("layer_types", "sliding_attention"), ("rotary_pct", 0), ("resid_pdrop", 1.0),
     ("hidden_dropout", "0.1"), ("use_parallel_residual", "yes"), ("partial_rotary_factor", 2)],
)
def test_a_key_that_matters_is_typed_by_the_schema_and_the_api(key, value, lora_job):
    config = _config("gpt-oss-20b.json")
    config[key] = value
    doc = _job_with_inline(lora_job, config)
    assert list(jsonschema.Draft4Validator(_schema()).iter_errors(doc)), key
    with pytest.raises(api.JobValidationError) as refused:
        api.parse_job(doc)
    assert any(p.path == f"spec.model.architecture.inline.{key}" for p in refused.value.problems), refused.value.problems


def test_the_api_types_the_keys_sizing_documents():
    """The inline architecture types and bounds the keys sizing's MEMORY_KEYS names, no more and no
    fewer. Both lists are written out: the API's keys need types, bounds and CRD descriptions, and
    sizing cannot read them from the API, which imports sizing."""
    assert set(api.InlineArchitecture.model_fields) == set(MEMORY_KEYS)


def test_an_unknown_family_is_accepted_and_named_by_sizing(lora_job):
    """DeepSeek-V3 is no family of the analytic model: the API keeps the job (the pre-flight
    profile sizes it), and sizing says which family it is and which it knows."""
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
              "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
              "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "q_lora_rank": 1536,
              "kv_lora_rank": 512, "vocab_size": 129280, "first_k_dense_replace": 3}
    job = api.parse_job(_job_with_inline(lora_job, copy.deepcopy(config)))
    assert job.spec.model.architecture.inline.config_json() == config
    with pytest.raises(UnknownArchitecture) as caught:
        architecture_of(job.spec)
    assert caught.value.model_type == "deepseek_v3"
    assert "qwen3_moe" in caught.value.known and caught.value.field == "model_type"
    assert "unknown family 'deepseek_v3'" in str(caught.value)


def test_no_model_type_is_unknown_too():
    with pytest.raises(UnknownArchitecture) as caught:
        ModelArchitecture.from_hf_config({"hidden_size": 8})
    assert caught.value.model_type is None


def test_presets_command_lists_every_preset(capsys):
    """spec.model.architecture.preset's documentation points at `finetune-operator presets`."""
    from finetune_operator import cli

    assert cli.main(["presets"]) == 0
    listed = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert listed == {name: arch.family for name, arch in PRESETS.items()}
