"""lora.modulesToSave and LoRA on the output head (issue 28): the trainer trains fp32 copies of the
named modules beside the adapters (peft's modules_to_save), saves them with the adapter, restores
them on resume, and the merged export writes what the adapted model computes; an adapter on the head
(targetModules naming lm_head) merges into the head, untying it from tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import run_trainer, trainer_config, write_config
from .trainer_assets import build_model, build_tokenizer

EMBED = "base_model.model.model.embed_tokens.weight"
HEAD = "base_model.model.lm_head.weight"


def _tied_model(root: Path) -> Path:
    """The tiny Llama with tied embeddings (as Llama 3.2 1B and Qwen2.5 small models are)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = root / "tiny-tied"
    tok = build_tokenizer(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=2, eos_token_id=3, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _logits(directory: Path, adapter: Path | None = None):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.tensor([[2, 8, 9, 10, 11, 12, 3]])
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
        return model.eval()(tokens).logits


@pytest.mark.slow
def test_saved_embedding_and_head_train_in_fp32_resume_and_merge(assets, tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear",
            "modulesToSave": ["embed_tokens", "lm_head"]}
    config = trainer_config(assets, tmp_path, method="lora", lora=lora, learningRate=1e-2, maxSteps=6,
                            precision="fp32", export="merged")
    first = run_trainer(write_config(tmp_path, config))
    assert first.returncode == 0, first.output[-3000:]
    # torch's fused AdamW steps them, on the CPU too (no step temporaries: optimizers.TRAINER_ADAMW).
    [built] = first.of("optimizer")
    assert (built["implementation"], built["adamwPath"]) == ("torch.optim.adamw.AdamW", "fused"), built
    out = tmp_path / "out"
    with safe_open(out / "adapter_model.safetensors", "pt") as saved:
        assert {EMBED, HEAD} <= set(saved.keys())
        assert saved.get_tensor(EMBED).dtype == torch.float32
        trained_head = saved.get_tensor(HEAD)
    base = load_file(assets["model"] / "model.safetensors")
    assert not torch.equal(trained_head, base["lm_head.weight"])  # the copy trained
    # The merged folder computes what the base with the adapter (and its saved modules) computes.
    merged, adapted = _logits(out / "merged"), _logits(assets["model"], out)
    assert (merged - adapted).abs().max().item() <= 5e-6 * max(1.0, adapted.abs().max().item())

    losses = first.losses()
    assert losses[6] < losses[1] - 0.3, losses

    # The next attempt resumes the copies and their AdamW state from the checkpoint of step 4: its
    # step 5 is the first attempt's step 5.
    again = dict(config, maxSteps=8, attempt=2)
    second = run_trainer(write_config(tmp_path, again))
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["optimizerRestored"]) == (4, True)
    assert second.losses()[5] == pytest.approx(losses[5], abs=1e-4)
    with safe_open(out / "adapter_model.safetensors", "pt") as saved:
        assert not torch.equal(saved.get_tensor(HEAD), trained_head)  # trained on from the resumed copy


@pytest.mark.slow
def test_a_tied_head_saved_or_adapted_is_untied_in_the_merged_export(tmp_path):
    import torch
    from safetensors.torch import load_file

    model = _tied_model(tmp_path)
    data = tmp_path / "chat.jsonl"
    from .trainer_assets import chat_lines, write_jsonl

    write_jsonl(data, chat_lines(32))
    assets = {"model": model, "chat": data}
    for name, lora in {
        "saved": {"targetModules": ["q_proj", "v_proj"], "modulesToSave": ["lm_head"]},
        "adapted": {"targetModules": ["q_proj", "v_proj", "lm_head"]},
    }.items():
        work = tmp_path / name
        config = trainer_config(assets, work, method="lora", precision="fp32", learningRate=1e-2, maxSteps=3,
                                checkpoint=None, export="merged",
                                lora={"rank": 4, "alpha": 8, "dropout": 0.0, **lora})
        run = run_trainer(write_config(work, config))
        assert run.returncode == 0, run.output[-3000:]
        out = work / "out"
        [export] = run.of("export")
        merged_config = json.loads((out / "merged" / "config.json").read_text())
        assert merged_config["tie_word_embeddings"] is False, name
        weights = load_file(out / "merged" / "model-00001-of-00001.safetensors")
        base = load_file(model / "model.safetensors")
        # The embedding keeps the base's values; only the head changed.
        assert torch.equal(weights["model.embed_tokens.weight"], base["model.embed_tokens.weight"].float()), name
        assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"]), name
        merged, adapted = _logits(out / "merged"), _logits(model, out)
        assert (merged - adapted).abs().max().item() <= 5e-6 * max(1.0, adapted.abs().max().item()), name


def test_a_name_that_is_no_module_is_a_config_error_naming_the_field():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_trainer.contract import TrainerConfig
    from finetune_trainer.errors import ConfigError
    from finetune_trainer.model_setup import apply_lora

    def model():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))

    def config(saved):
        return TrainerConfig.model_validate({"jobName": "j", "model": {"path": "/m"}, "dataset": {"path": "/d"},
                                             "outputDirectory": "/o", "maxSteps": 1, "method": "lora",
                                             "lora": {"modulesToSave": saved}})

    apply_lora(config(["model.embed_tokens", "lm_head"]), model())  # a dotted path names a module too
    # peft would skip it without a word, and nothing would train in full.
    with pytest.raises(ConfigError, match=r"lora.modulesToSave: 'embed_out' is not a module of LlamaForCausalLM"):
        apply_lora(config(["embed_out"]), model())


def test_a_checkpoint_without_the_saved_copies_does_not_load():
    from finetune_trainer.checkpointing import _check_loaded

    frozen = SimpleNamespace(missing_keys=["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight"])
    _check_loaded(frozen, lora=True)  # the frozen base is never in a LoRA checkpoint
    for key in ("base_model.model.lm_head.modules_to_save.default.weight",
                "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight"):
        with pytest.raises(RuntimeError, match="checkpoint lacks 1 tensors"):
            _check_loaded(SimpleNamespace(missing_keys=[key]), lora=True)


def test_the_saved_copies_train_in_fp32_while_the_base_stays_bf16():
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune_trainer.model_setup import train_in_fp32

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         tie_word_embeddings=True)).to(torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                       modules_to_save=["embed_tokens", "lm_head"]))
    train_in_fp32(model)
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert set(trained.values()) == {torch.float32} and any("modules_to_save" in n for n in trained)
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    base = model.get_base_model()
    # Tied: the frozen originals stay one tensor; each trained copy is its own.
    assert base.lm_head.original_module.weight is base.model.embed_tokens.original_module.weight
    assert base.lm_head.modules_to_save["default"].weight is not base.model.embed_tokens.modules_to_save["default"].weight
