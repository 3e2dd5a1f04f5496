"""torch AdamW's step temporaries (issue 28): the fused path the trainer runs allocates nothing beyond
its in-place update; the foreach path (torch's choice on CUDA when none is asked for, which published
recipes ran) holds the square roots of a whole parameter group's second moments at once. Measured by
the dispatch tracker the truth uses, on fake tensors of both weight dtypes, and the estimate's term
(optimizers.ADAMW_GROUP_MOMENT_COPIES, states.optimizer_step_temporaries) against it and against a
traced training step. The CPU kernels' figures are bench/optimizer_state.py's; a GPU's, bench/gpu_levers.py's."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from finetune_operator.sizing import ModelArchitecture, SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.presets import preset
from finetune_trainer import optimizers

torch = pytest.importorskip("torch")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH))

SHAPES = ((256, 256), (256, 512), (128, 64), (512, 1024))  # a group of unequal tensors


def _step_peak(dtype, path: dict) -> tuple[int, int, int]:
    """(peak bytes the third step allocates, values of the group, values of its largest tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune_trainer.peak_tracker import PeakTracker

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in SHAPES]
        for p in params:
            p.grad = torch.empty_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **path)
        optimizer.step()
        optimizer.step()
        with PeakTracker() as tracker:
            optimizer.step()
    return tracker.peak, sum(p.numel() for p in params), max(p.numel() for p in params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_allocates_nothing_and_foreach_one_moment_of_the_group(dtype):
    dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    fused, values, _ = _step_peak(dtype, {"fused": True})
    foreach, _, largest = _step_peak(dtype, {"foreach": True})
    assert fused == optimizers.ADAMW_GROUP_MOMENT_COPIES["fused"] * size * values == 0
    # The whole group at once, not the largest tensor: four tensors, each rounded to 512-byte blocks.
    assert foreach == optimizers.ADAMW_GROUP_MOMENT_COPIES["foreach"] * size * values > size * largest


def test_the_trainer_asks_for_fused_adamw():
    from finetune_trainer.contract import TrainerConfig
    from finetune_trainer.run import training_arguments

    cfg = TrainerConfig.model_validate({"jobName": "j", "model": {"path": "/m"}, "dataset": {"path": "/d"},
                                        "outputDirectory": "/tmp/o", "maxSteps": 1, "method": "lora"})
    args = training_arguments(cfg, 1, cuda=False)
    assert optimizers.TRAINER_ADAMW == "fused" and args.optim == "adamw_torch_fused"


L8 = preset("llama-3.1-8b")


def test_foreach_holds_one_fp32_value_per_trained_value_on_this_gpu():
    for method, strategy, world, trained in (("full", "ddp", 1, L8.total_params),
                                             ("full", "fsdp", 8, L8.total_params / 8),
                                             ("lora", "ddp", 1, L8.lora_trainable_params(16))):
        fused = TrainingSetup(architecture=L8, method=method, strategy=strategy, world_size=world,
                              gradient_checkpointing=True)
        foreach = replace(fused, adamw_implementation="foreach")
        added = estimate_memory(foreach).phase_peaks["optimizer"] - estimate_memory(fused).phase_peaks["optimizer"]
        assert added == pytest.approx(4 * trained, rel=1e-6), (method, strategy)
    # With the step in backward each parameter steps alone: the largest one's (the embedding).
    from finetune_operator.sizing.regime import regime_of
    from finetune_operator.sizing.states import optimizer_step_temporaries, static_state

    oib = TrainingSetup(architecture=L8, method="full", optimizer_in_backward=True, adamw_implementation="foreach",
                        gradient_checkpointing=True)
    regime = regime_of(oib)
    assert optimizer_step_temporaries(oib, regime, static_state(oib, regime)) == 4 * L8.vocab_size * L8.hidden_size


@pytest.mark.parametrize("change", [dict(optimizer="adamw-8bit"), dict(method="full", master_weights="bf16"),
                                    dict(strategy="zero2", world_size=2), dict(adamw_implementation="for-loop")])
def test_foreach_is_sized_only_where_torchs_adamw_steps(change):
    setup = {"architecture": L8, "adamw_implementation": "foreach", **change}
    with pytest.raises(SizingError) as error:
        TrainingSetup(**setup)
    assert error.value.field == "adamw_implementation"


@pytest.mark.slow
def test_foreach_against_a_traced_step():
    """The fused and the foreach step of one tiny model traced whole: the optimizer phase differs by
    the group's fp32 values, as the estimate says (within the allocator's rounding)."""
    from sizing_truth import measure, measure_levers

    arch = ModelArchitecture(family="llama", vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    fused = TrainingSetup(architecture=arch, method="full", micro_batch_size=2, sequence_length=512)
    foreach = replace(fused, adamw_implementation="foreach")
    traced = measure_levers(foreach).phase_peaks["optimizer"] - measure(fused).phase_peaks["optimizer"]
    estimated = estimate_memory(foreach).phase_peaks["optimizer"] - estimate_memory(fused).phase_peaks["optimizer"]
    assert traced == pytest.approx(estimated, rel=0.01)
