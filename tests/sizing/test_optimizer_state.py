"""The optimizer-state term against the optimizers' own states: real models built from a config
(random weights, transformers on the CPU), one real step of each optimizer that runs here, and the
bytes of every tensor it keeps, against `optimizer_state.state_bytes` for the same architecture.

torchao compiles its per-parameter step (minutes per shape on two cores); the states it keeps do
not depend on that, so the step runs eagerly here. bitsandbytes needs CUDA: its rule
(the same blocks, embeddings in 32 bits) is checked by bench/gpu_levers.py on a GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

from finetune_trainer import optimizers  # noqa: E402

from finetune_operator.sizing import ModelArchitecture  # noqa: E402
from finetune_operator.sizing.optimizer_state import state_bytes, trained_tensors  # noqa: E402

# Sizes chosen so that each rule of the quantisation is exercised: 128-wide norms stay full
# precision (under 4096 values); a 301-token vocabulary's embedding (38528 values) is a whole
# number of 4-bit blocks (128) but not of 8-bit ones (256); the linears are quantised.
CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=301, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True),
}


def _load_bench():
    spec = importlib.util.spec_from_file_location("optimizer_state_bench",
                                                  Path(__file__).resolve().parents[2] / "bench" / "optimizer_state.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tensor_bytes = _load_bench().tensor_bytes


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    # torchao calls torch.compile on its step at each step: run the same function eagerly.
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)


def _measured(model, cls) -> int:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cls(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    # The moments; the step counters (one fp32 scalar per tensor) are not the model's term.
    return sum(_tensor_bytes(v) for state in optimizer.state.values() for k, v in state.items() if k != "step")


def _build(family: str, method: str):
    config = transformers.AutoConfig.for_model(**CONFIGS[family])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    arch = ModelArchitecture.from_hf_config(config.to_dict())
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    return model, arch


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("name", ["torchao-adamw-8bit", "torchao-adamw-4bit", "adamw"])
def test_state_bytes_equal_what_the_optimizer_keeps(family, method, name):
    model, arch = _build(family, method)
    kind = optimizers.kind(name)
    cls = torch.optim.AdamW if kind.library == "torch" else _torchao_class(kind)
    groups = trained_tensors(arch, method, 8, "all-linear")
    assert state_bytes(kind, groups, 4.0) == _measured(model, cls)


def _torchao_class(kind):
    import importlib

    module, name = kind.optimizer_class.split(":")
    return getattr(importlib.import_module(module), name)


def test_bf16_weights_keep_small_tensors_moments_in_bf16():
    model, arch = _build("llama", "full")
    model.to(torch.bfloat16)
    kind = optimizers.kind("torchao-adamw-8bit")
    assert state_bytes(kind, trained_tensors(arch, "full"), 2.0) == _measured(model, _torchao_class(kind))


def test_bitsandbytes_keeps_embeddings_in_32_bits_and_torchao_does_not():
    embedding = [g for g in trained_tensors(ModelArchitecture.from_hf_config(CONFIGS["qwen2"]), "full") if g.embedding]
    [group] = embedding
    bnb = optimizers.kind("adamw-8bit")
    ao = optimizers.kind("torchao-adamw-8bit")
    assert state_bytes(bnb, tuple(embedding), 4.0) == 2 * 4 * group.numel
    assert state_bytes(ao, tuple(embedding), 4.0) == 2 * (group.numel + 4 * group.numel / 256 + 4 * 256)
