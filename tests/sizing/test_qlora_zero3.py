"""QLoRA under DeepSpeed ZeRO-3 (issue 28): bitsandbytes' packed 4-bit codes stored in the compute dtype
(`bnb_4bit_quant_storage`), which ZeRO-3 partitions and gathers like any bf16 parameter, a quarter of
the values in elements; the quantisation state, no parameter, whole on every GPU; the rest of the model
in the compute dtype. What the CPU can check: the sizing terms here, the trainer's settings for it, and
ZeRO-3's partitioning of the quantised storage against DeepSpeed's own code with emulated 4-bit layers
(bench/zero_truth.py --qlora, the slow test below). bitsandbytes' kernels need CUDA: the trainer refuses
QLoRA without a GPU, and bench/gpu_levers.py's qlora-zero3 case runs it on the first lent one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_operator.sizing import SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.presets import preset
from finetune_operator.sizing.regime import regime_of
from finetune_operator.sizing.states import nf4_quant_state_bytes, static_state
from finetune_operator.sizing.zero3 import decoder_trace, nf4_storage_elements
from finetune_trainer.contract import TrainerConfig, deepspeed_config

L8 = preset("llama-3.1-8b")
L70 = preset("llama-3.1-70b")


def test_the_4bit_storage_is_a_quarter_of_the_values_in_bf16_elements():
    assert nf4_storage_elements(4096 * 4096) == 4096 * 4096 // 4
    assert nf4_storage_elements(7) == 2  # four bytes of codes (the last one half used), two bf16 elements
    arch = L8.with_layers(1)
    qlora = decoder_trace(arch, "qlora", 16, "all-linear", False, False)
    lora = decoder_trace(arch, "lora", 16, "all-linear", False, False)
    linears = {lin.in_features * lin.out_features for lin in arch.block_linears()}
    frozen_q = sorted(p.numel for p in qlora.params if not p.trainable)
    frozen_l = sorted(p.numel for p in lora.params if not p.trainable)
    assert [q for q, l in zip(frozen_q, frozen_l) if q != l] == sorted(n // 4 for n in linears for _ in
                                                                       range(sum(1 for lin in arch.block_linears()
                                                                                 if lin.in_features * lin.out_features == n)))
    assert [p for p in qlora.params if p.trainable] == [p for p in lora.params if p.trainable]


def test_zero3_partitions_the_base_and_every_gpu_holds_the_whole_quantisation_state():
    def weights(world):
        setup = TrainingSetup(architecture=L70, method="qlora", strategy="zero3", world_size=world,
                              gradient_checkpointing=True)
        return static_state(setup, regime_of(setup)).weights

    state = nf4_quant_state_bytes(L70)
    two, eight = weights(2) - state, weights(8) - state
    # The partitioned part (4-bit codes, bf16 embeddings, head, norms) shrinks with the ranks; the
    # persistent small parameters (norms) stay whole on each.
    assert two / eight == pytest.approx(4, rel=0.01)
    # Per rank: the codes (half a byte a value), the bf16 rest and the bf16 adapters, an eighth each.
    partitioned = 0.5 * L70.linear_params + 2 * (L70.total_params - L70.linear_params) + 2 * L70.lora_trainable_params(16)
    assert eight == pytest.approx(partitioned / 8, rel=0.01)
    assert state > 0.9 * (1 << 30)  # about 1 GiB at 70B, not sharded


def test_the_rest_stays_in_the_compute_dtype_under_zero3():
    ddp = TrainingSetup(architecture=L8, method="qlora", strategy="ddp")
    zero3 = replace(ddp, strategy="zero3", world_size=2)
    assert regime_of(ddp).residual == 4 and regime_of(zero3).residual == 2
    # DDP casts the frozen fp32 head per call; ZeRO-3 holds it in bf16.
    assert estimate_memory(zero3).breakdown["weight_copies"] < estimate_memory(ddp).breakdown["weight_copies"]


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero1_and_zero2_stay_refused_naming_the_strategy(strategy):
    with pytest.raises(SizingError, match="qlora runs with ddp, fsdp .* or zero3") as error:
        TrainingSetup(architecture=L8, method="qlora", strategy=strategy, world_size=2)
    assert error.value.field == "strategy"


def _config(strategy: str) -> TrainerConfig:
    stage = {"zero2": 2, "zero3": 3}.get(strategy)
    return TrainerConfig.model_validate({
        "jobName": "j", "model": {"path": "/m"}, "dataset": {"path": "/d"}, "outputDirectory": "/o", "maxSteps": 1,
        "method": "qlora", "strategy": strategy, **({"deepspeed": deepspeed_config(stage)} if stage else {})})


def test_the_trainer_stores_the_codes_in_bf16_and_skips_the_fp32_cast_under_zero3():
    torch = pytest.importorskip("torch")
    from finetune_trainer.model_setup import FSDP_NONE, prepares_kbit, qlora_quantization

    zero3, ddp = _config("zero3"), _config("ddp")
    assert qlora_quantization(zero3, FSDP_NONE)["bnb_4bit_quant_storage"] is torch.bfloat16
    assert qlora_quantization(ddp, FSDP_NONE)["bnb_4bit_quant_storage"] is torch.uint8
    assert not prepares_kbit(zero3) and prepares_kbit(ddp)
    with pytest.raises(ValueError, match="zero1 and zero2 are not run with bitsandbytes"):
        _config("zero2")


def test_without_a_gpu_the_trainer_refuses_qlora_before_loading_anything():
    from finetune_trainer.errors import ConfigError
    from finetune_trainer.model_setup import check_runnable

    with pytest.raises(ConfigError, match="method qlora needs CUDA"):
        check_runnable(_config("zero3"), cuda=False)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero3_partitions_the_4bit_storage_as_deepspeed_does_on_the_cpu(world):
    """bench/zero_truth.py --qlora at a small size: two gloo ranks run DeepSpeed's ZeRO-3 over emulated
    4-bit layers (the packed codes in a frozen bf16 parameter, dequantised per call, peft's LoRA pair
    beside) with the trainer's config (budgets / 256); every allocation counted, per phase."""
    pytest.importorskip("deepspeed")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "zero_truth.py"
    spec = importlib.util.spec_from_file_location("zero_truth", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # 1024 wide: each layer's codes (262144 elements) are above the persistence threshold (1e5, not
    # scaled), so they are partitioned and gathered; the rank-16 adapters (16384 each) persist. On 4
    # ranks they outweigh the step's transient: its peak is what it starts with (sharding.py).
    measured = bench.run(3, world, 1024, 6, 256, 29680 + 10 * world, model="qlora")
    predicted = bench.estimate(3, world, 1024, 6, 256, qlora=True)
    for phase in bench.PHASES:
        assert predicted[phase] == pytest.approx(measured[phase], rel=0.01), phase
