"""The export after training (finetune_trainer.export): a merged or full folder that transformers
loads as is and that computes what the trained model computed.

Tiny models from a config with random weights (no downloads); the adapters are peft's own, their
B matrices perturbed so the merge has something to add. The reference is the peft model itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from finetune_trainer import export as export_module  # noqa: E402
from finetune_trainer.contract import TrainerConfig  # noqa: E402
from finetune_trainer.errors import ConfigError, ExportError  # noqa: E402
from finetune_trainer.export import export_folder  # noqa: E402
from finetune_trainer.safetensors_io import FormatError, SafetensorsFile  # noqa: E402

from .trainer_assets import build_tokenizer  # noqa: E402

INPUT = [[2, 5, 9, 14, 3, 7, 21, 11, 4, 8]]


def llama(path: Path, *, tied: bool = False, seed: int = 0, dtype=None, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=40, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    model = LlamaForCausalLM(config)
    model.generation_config.max_new_tokens = 7  # something to see copied
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def gpt2(path: Path, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    model.save_pretrained(path)
    build_tokenizer(path)
    return path


def adapt(base: Path, out: Path, seed: int = 1, **lora):
    """A peft adapter on `base` with random (nonzero) B, saved in `out` as the Trainer saves it; the
    peft model, in eval mode, is the reference."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.setdefault("r", 4)
    lora.setdefault("lora_alpha", 8)
    lora.setdefault("target_modules", "all-linear")
    lora.setdefault("lora_dropout", 0.0)
    peft_model = get_peft_model(model, LoraConfig(**lora))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(out)
    return peft_model.eval()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(INPUT)).logits.float()


def load(folder: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def index_of(folder: Path) -> dict:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_merged_llama_computes_what_base_plus_adapter_computes(tmp_path):
    base = llama(tmp_path / "base")
    reference = adapt(base, tmp_path / "out")
    result = export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    merged = tmp_path / "out" / "merged"
    assert result.directory == str(merged) and result.kind == "merged"
    got, want = logits(load(merged)), logits(reference)
    assert (got - want).abs().max().item() <= 5e-7 * max(1.0, want.abs().max().item())
    # The base alone differs by far more: the adapter is in there.
    assert (logits(load(base)) - want).abs().max().item() > 1e-2
    # What a serving stack reads besides the weights.
    assert json.loads((merged / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((merged / "generation_config.json").read_text())["max_new_tokens"] == 7
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    assert tokenizer("red apple")["input_ids"] == transformers.AutoTokenizer.from_pretrained(base)("red apple")["input_ids"]
    assert sorted(p.name for p in merged.iterdir() if p.suffix == ".safetensors") == ["model-00001-of-00001.safetensors"]


def test_merged_in_bf16_is_the_fp32_merge_rounded(tmp_path):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    exact = SafetensorsFile(tmp_path / "out" / "merged" / "model-00001-of-00001.safetensors").read_all()
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.bfloat16)
    merged = tmp_path / "out" / "merged"
    rounded = SafetensorsFile(merged / "model-00001-of-00001.safetensors").read_all()
    assert set(rounded) == set(exact)
    for name, tensor in rounded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, exact[name].to(torch.bfloat16)), name
    config = json.loads((merged / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["use_cache"] is True
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # the replaced folder is gone


def test_rslora_modules_to_save_and_an_embedding_adapter_on_tied_weights(tmp_path):
    """rsLoRA scales by alpha/sqrt(r); the head in modules_to_save replaces its tensor; an adapter on the
    tied input embeddings changes only the input side: the two are written untied."""
    base = llama(tmp_path / "base", tied=True)
    reference = adapt(base, tmp_path / "out", use_rslora=True, r=8, lora_alpha=4,
                      target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"], modules_to_save=["lm_head"])
    result = export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    merged = tmp_path / "out" / "merged"
    assert result.untied == ("lm_head.weight",)
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is False
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(index_of(merged)["weight_map"])
    got, want = logits(load(merged)), logits(reference)
    assert (got - want).abs().max().item() <= 5e-7 * max(1.0, want.abs().max().item())


def test_rslora_scaling_is_not_plain_lora_scaling(tmp_path, monkeypatch):
    """Break-test of the scaling: the same adapter merged as if it were plain LoRA misses the reference."""
    base = llama(tmp_path / "base")
    reference = adapt(base, tmp_path / "out", use_rslora=True, r=16, lora_alpha=4)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    config["use_rslora"] = False
    (tmp_path / "out" / "adapter_config.json").write_text(json.dumps(config))
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    assert (logits(load(tmp_path / "out" / "merged")) - logits(reference)).abs().max().item() > 1e-3


def test_tied_weights_stay_tied_when_the_adapter_leaves_them_alone(tmp_path):
    base = llama(tmp_path / "base", tied=True)
    reference = adapt(base, tmp_path / "out", target_modules=["q_proj", "o_proj", "up_proj"])
    result = export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    merged = tmp_path / "out" / "merged"
    assert result.untied == ()
    assert "lm_head.weight" not in index_of(merged)["weight_map"]
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is True
    model = load(merged)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (logits(model) - logits(reference)).abs().max().item() <= 5e-7 * max(1.0, logits(reference).abs().max().item())


def test_fan_in_fan_out_layers_of_gpt2(tmp_path):
    """GPT-2's Conv1D stores W as (in, out): peft adds (B @ A)^T (fan_in_fan_out)."""
    base = gpt2(tmp_path / "base")
    reference = adapt(base, tmp_path / "out", target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    want = logits(reference)
    assert (logits(load(tmp_path / "out" / "merged")) - want).abs().max().item() <= 5e-7 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("limit", [20_000, 3_000])
def test_shards_of_at_most_the_limit_with_a_correct_index(tmp_path, limit):
    """20 kB: a few tensors per shard; 3 kB: the 4 kB matrices each alone in a shard of their own."""
    base = llama(tmp_path / "base")
    reference = adapt(base, tmp_path / "out")
    result = export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32,
                           max_shard_bytes=limit)
    merged = tmp_path / "out" / "merged"
    index = index_of(merged)
    shards = sorted(p.name for p in merged.glob("*.safetensors"))
    assert len(shards) == result.shards > 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    from safetensors import safe_open

    total = oversized = 0
    seen = {}
    for shard in shards:
        with safe_open(merged / shard, framework="pt") as handle:  # the safetensors package reads them
            assert handle.metadata() == {"format": "pt"}
            names = list(handle.keys())
            sizes = [handle.get_tensor(n).numel() * 4 for n in names]
            for name in names:
                seen[name] = handle.get_tensor(name)
        assert sum(sizes) <= limit or len(names) == 1
        oversized += len(names) == 1 and sum(sizes) > limit
        total += sum(sizes)
        assert all(index["weight_map"][n] == shard for n in names)
    assert index["metadata"]["total_size"] == total == result.total_bytes
    assert (oversized > 0) == (limit < 4096)
    assert set(seen) == set(index["weight_map"]) == set(SafetensorsFile(base / "model.safetensors").names())
    want = logits(reference)
    assert (logits(load(merged)) - want).abs().max().item() <= 5e-7 * max(1.0, want.abs().max().item())


def test_a_failure_midway_leaves_no_folder_and_the_adapter_as_it_was(tmp_path, monkeypatch):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    out = tmp_path / "out"
    before = digest(out)
    real = export_module._Producer.tensor
    calls = {"n": 0}

    def failing(self, info):
        calls["n"] += 1
        if calls["n"] == 6:
            raise OSError(28, "No space left on device")
        return real(self, info)

    monkeypatch.setattr(export_module._Producer, "tensor", failing)
    with pytest.raises(ExportError, match="No space left on device") as failure:
        export_folder(kind="merged", output=out, base=base, tokenizer=base, dtype=torch.float32, max_shard_bytes=20_000)
    assert isinstance(failure.value, ConfigError)
    assert calls["n"] == 6
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == []  # neither merged nor a staging folder
    assert digest(out) == before


def test_a_failed_export_keeps_the_earlier_attempts_folder(tmp_path, monkeypatch):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    out = tmp_path / "out"
    export_folder(kind="merged", output=out, base=base, tokenizer=base, dtype=torch.float32)
    earlier = digest(out / "merged")

    def broken(self, info):
        raise ValueError("broken on purpose")

    monkeypatch.setattr(export_module._Producer, "tensor", broken)
    with pytest.raises(ExportError):
        export_folder(kind="merged", output=out, base=base, tokenizer=base, dtype=torch.float32)
    assert digest(out / "merged") == earlier
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["merged"]


def test_a_stale_staging_folder_of_a_killed_export_is_removed(tmp_path):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    stale = tmp_path / "out" / ".merged.staging-12345"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["merged"]


@pytest.mark.parametrize(("key", "value"), [("use_dora", True), ("target_parameters", ["experts.gate_up_proj"]),
                                             ("init_lora_weights", "pissa"), ("bias", "all")])
def test_adapters_this_merge_cannot_reproduce_are_refused_by_key(tmp_path, key, value):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    config_path = tmp_path / "out" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), key: value}))
    before = digest(tmp_path / "out")
    with pytest.raises(ExportError, match=f"adapter_config.json {key}="):
        export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    assert digest(tmp_path / "out") == before and not (tmp_path / "out" / "merged").exists()


def test_an_adapter_for_another_base_is_refused_naming_the_tensor(tmp_path):
    small, other = llama(tmp_path / "base"), tmp_path / "other"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    build_tokenizer(other)
    adapt(other, tmp_path / "out")
    with pytest.raises(ExportError, match=r"do not fit the base's 'model\.layers\.0\.\w+\.\w+\.weight'"):
        export_folder(kind="merged", output=tmp_path / "out", base=small, tokenizer=small, dtype=torch.float32)


def test_a_base_without_safetensors_is_refused(tmp_path):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    (base / "model.safetensors").rename(base / "pytorch_model.bin")
    with pytest.raises(ExportError, match="holds no safetensors weights .only pytorch_model.bin"):
        export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)


def test_a_corrupt_shard_is_an_export_error(tmp_path):
    base = llama(tmp_path / "base")
    adapt(base, tmp_path / "out")
    data = (base / "model.safetensors").read_bytes()
    (base / "model.safetensors").write_bytes(data[: len(data) - 100])  # cut short
    with pytest.raises(ExportError, match="do not match its size or the file"):
        export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32)
    with pytest.raises(FormatError):
        SafetensorsFile(base / "model.safetensors")


def test_full_export_casts_the_trained_weights_and_reshards_them(tmp_path):
    base = llama(tmp_path / "base")
    out = llama(tmp_path / "out", seed=7)  # stands in for the Trainer's save of a full fine-tune (fp32)
    result = export_folder(kind="full", output=out, base=base, tokenizer=base, dtype=torch.bfloat16,
                           max_shard_bytes=10_000)
    full = out / "full"
    assert result.shards == len(list(full.glob("*.safetensors"))) > 1
    trained = SafetensorsFile(out / "model.safetensors").read_all()
    model = load(full, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name
    assert json.loads((full / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_safetensors_written_here_and_by_the_package_read_the_same(tmp_path):
    from safetensors.torch import load_file, save_file

    from finetune_trainer.safetensors_io import TensorInfo, write_file

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6).reshape(2, 3),
               "d": torch.zeros(0, 4), "e": torch.tensor([True, False])}
    save_file(tensors, tmp_path / "package.safetensors")
    ours = SafetensorsFile(tmp_path / "package.safetensors").read_all()
    infos = [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    write_file(tmp_path / "ours.safetensors", infos, iter(tensors.values()), {"format": "pt"})
    theirs = load_file(tmp_path / "ours.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(ours[name], tensor) and torch.equal(theirs[name], tensor), name
    with pytest.raises(ValueError, match="planned"):
        write_file(tmp_path / "bad.safetensors", infos[:1], iter([torch.randn(5, 3)]))


def test_qlora_merges_into_the_dequantised_base_it_trained_against(tmp_path):
    """A real QLoRA model (transformers + bitsandbytes NF4, on the CPU) against the merge: every weight
    transformers quantised is, in the merged folder, bitsandbytes' own dequantisation of that layer plus
    peft's delta; the rest is the base's. (Logits are not compared tightly: bitsandbytes' CPU matmul
    rounds its scales to bf16, 3e-3 off x @ dequantised(W) on this model, in the reference itself.)"""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes.functional as bnb_functional
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = llama(tmp_path / "base", hidden=128)  # bitsandbytes' CPU kernels want rows of whole 64-blocks
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.uint8)
    quantised = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, quantization_config=quantization,
                                                     device_map="cpu")
    reference = get_peft_model(quantised, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                     lora_dropout=0.0))
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape) * 0.1)
    reference.save_pretrained(tmp_path / "out")
    export_folder(kind="merged", output=tmp_path / "out", base=base, tokenizer=base, dtype=torch.float32, qlora=True)
    merged = load(tmp_path / "out" / "merged").state_dict()
    stored = SafetensorsFile(base / "model.safetensors").read_all()
    four_bit = 0
    for name, module in reference.base_model.model.named_modules():
        layer = getattr(module, "base_layer", module)
        if type(layer).__name__ != "Linear4bit" or name.endswith(".base_layer"):
            continue
        four_bit += 1
        want = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        if hasattr(module, "get_delta_weight"):
            want = want + module.get_delta_weight("default")
        assert torch.allclose(merged[f"{name}.weight"], want, rtol=0, atol=1e-6), name
        assert not torch.allclose(merged[f"{name}.weight"], stored[f"{name}.weight"], atol=1e-3), name
    assert four_bit == 14  # 7 linear layers in each of the 2 blocks; not the head
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(merged[name], stored[name]), name
    # Not a tight comparison (see above), but the merged model is the QLoRA model, not the 16-bit base's.
    want_logits = logits(reference.eval())
    assert (logits(load(tmp_path / "out" / "merged")) - want_logits).abs().max().item() < 0.02


def _config(**overrides):
    return TrainerConfig(job_name="j", model={"path": "m"}, dataset={"path": "d"}, max_steps=1, output_directory="o",
                         **overrides)


def test_the_export_defaults_by_method_and_refuses_what_does_not_fit():
    assert _config(method="lora").export_kind == "adapter"
    assert _config(method="qlora").export_kind == "adapter"
    assert _config(method="full").export_kind == "full"
    assert _config(method="lora", export="merged").export_kind == "merged"
    # An omitted export stays out of the JSON: a trainer that predates the field reads the config too.
    assert "export" not in json.loads(_config(method="full").to_json())
    with pytest.raises(ValueError, match="export: merged merges a LoRA adapter into the base: it needs method lora"):
        _config(method="full", export="merged")
    with pytest.raises(ValueError, match="export: full exports full fine-tuning's weights: it needs method full"):
        _config(method="qlora", export="full")
    with pytest.raises(ValueError, match="export"):
        _config(method="lora", export="gguf")
