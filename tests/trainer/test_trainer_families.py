"""The trainer trains the families the analytic memory model added in issue 28: phi (phi-1.5,
phi-2) and gpt_neox (Pythia), tiny random-weight models built from a config, through full
fine-tuning and LoRA on peft's all-linear (the FineTuneJob default), in a fresh process as a pod.

The LoRA run also checks that the adapters sit on the modules sizing counts for the family
(FamilyTraits.lora_targets): the estimate's trainable parameters are the ones peft made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune_operator.sizing import ModelArchitecture

from .conftest import run_trainer, trainer_config, write_config
from .trainer_assets import build_tokenizer

pytestmark = pytest.mark.slow

FAMILIES = {
    # phi-2's layout: gelu_new, partial rotary 0.4, residual dropout 0.1 (as its config trains).
    "phi": dict(model_type="phi", partial_rotary_factor=0.4, hidden_act="gelu_new", resid_pdrop=0.1,
                embd_pdrop=0.0, attention_dropout=0.0, qk_layernorm=False, num_key_value_heads=4),
    # Pythia's: fused query_key_value, a quarter of each head rotary, parallel residual.
    "gpt_neox": dict(model_type="gpt_neox", rotary_pct=0.25, hidden_act="gelu", use_parallel_residual=True,
                     attention_bias=True, hidden_dropout=0.0, attention_dropout=0.0),
}


def _model(root: Path, family: str) -> tuple[Path, dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / f"tiny-{family}"
    tok = build_tokenizer(path)
    config = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=False,
                  layer_norm_eps=1e-5, pad_token_id=0, bos_token_id=2, eos_token_id=3, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(path)
    return path, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_trainer_trains_phi_and_gpt_neox(family, method, assets, tmp_path):
    model_dir, saved_config = _model(tmp_path, family)
    arch = ModelArchitecture.from_hf_config(saved_config)  # the saved config.json sizes as this family
    assert arch.family == family
    lora = {"rank": 8, "alpha": 16, "dropout": 0.05, "targetModules": "all-linear"}
    config = trainer_config(assets, tmp_path, model={"path": str(model_dir)}, method=method, maxSteps=6,
                            learningRate=1e-2 if method == "lora" else 3e-3, checkpoint=None,
                            **({"lora": lora} if method == "lora" else {}))
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    losses = run.losses()
    assert sorted(losses) == list(range(1, 7))
    assert losses[6] < losses[1] - 0.2, losses
    out = tmp_path / "out"
    if method == "full":
        assert (out / "model.safetensors").is_file()
        return
    adapter = json.loads((out / "adapter_config.json").read_text())
    adapted = {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]}  # peft saves the full names
    assert sorted(adapted) == sorted(arch.traits.lora_targets)
    from safetensors import safe_open

    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        saved = sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    assert saved == arch.lora_trainable_params(8, "all-linear")


@pytest.mark.parametrize("family,method", [("phi", "lora"), ("gpt_neox", "full")])
def test_fsdp_on_two_ranks_with_checkpointing(family, method, assets, tmp_path):
    """transformers' FSDP2 at load time (the trainer's FSDP route) shards these families' blocks
    too, with gradient checkpointing on, as the planner may choose for them."""
    model_dir, _ = _model(tmp_path, family)
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"}
    config = trainer_config(assets, tmp_path, model={"path": str(model_dir)}, method=method, maxSteps=4,
                            strategy="fsdp", microBatchSize=2, gradientAccumulation=2, gradientCheckpointing=True,
                            learningRate=1e-2 if method == "lora" else 3e-3, checkpoint=None,
                            **({"lora": lora} if method == "lora" else {}))
    run = run_trainer(write_config(tmp_path, config), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    assert run.of("start")[0]["worldSize"] == 2
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], losses
