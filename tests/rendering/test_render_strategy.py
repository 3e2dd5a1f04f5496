"""The DeepSpeed configs the renderer writes, checked by DeepSpeed's own parser (on the CPU)."""

from __future__ import annotations

import itertools

import deepspeed.runtime.config as ds_config  # the dev extra installs deepspeed; no silent skip
import pytest
from finetune_trainer.contract import TrainerConfig

from finetune_operator.rendering.errors import RenderError
from finetune_operator.rendering.strategy import BatchSettings, build_deepspeed_config, build_fsdp_settings

OFFLOADS = {"zero1": ["none", "optimizer"], "zero2": ["none", "optimizer"], "zero3": ["none", "optimizer", "optimizer+params"]}
CASES = [
    (strategy, offload, precision)
    for strategy, offloads in OFFLOADS.items()
    for offload, precision in itertools.product(offloads, ["bf16", "fp16", "fp32"])
]


class DataParallelGroup:
    """The `mpu` DeepSpeed asks for the data-parallel world size, so a config for N GPUs parses on one CPU."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture
def parse(monkeypatch):
    # DeepSpeedConfig asks torch.distributed for the rank first and, without a process
    # group, falls back to world size 1 and ignores the mpu; rank 0 is all it needs.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *args, **kwargs: 0)

    def run(config: dict, world_size: int):
        return ds_config.DeepSpeedConfig(config, mpu=DataParallelGroup(world_size))

    return run


def batch(precision: str = "bf16", world: int = 4, optimizer: str = "adamw") -> BatchSettings:
    return BatchSettings(
        micro_batch_size=2,
        gradient_accumulation=8,
        data_parallel_size=world,
        precision=precision,
        optimizer=optimizer,
        learning_rate=2e-4,
        weight_decay=0.01,
        max_grad_norm=1.0,
    )


@pytest.mark.parametrize("strategy,offload,precision", CASES)
def test_deepspeed_parses_every_stage_offload_and_precision(parse, strategy, offload, precision):
    config = build_deepspeed_config(strategy, offload, batch(precision))
    parsed = parse(config, 4)
    assert parsed.zero_enabled
    assert parsed.zero_optimization_stage == int(strategy[-1])
    assert parsed.train_batch_size == 2 * 8 * 4
    assert parsed.train_micro_batch_size_per_gpu == 2
    assert parsed.gradient_accumulation_steps == 8
    assert parsed.gradient_clipping == 1.0
    assert parsed.bfloat16_config.enabled == (precision == "bf16")
    assert parsed.float16_config.enabled == (precision == "fp16")
    zero = parsed.zero_config
    assert (zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu") == (offload != "none")
    assert (zero.offload_param is not None and zero.offload_param.device == "cpu") == (offload == "optimizer+params")
    if offload != "none":
        # DeepSpeed steps offloaded states with its own CPU AdamW; it must be named in the config.
        assert parsed.optimizer_name == "adamw"
        assert parsed.optimizer_params["lr"] == 2e-4
        assert parsed.optimizer_params["weight_decay"] == 0.01
    else:
        assert parsed.optimizer_name is None
    # The trainer's contract accepts it too.
    TrainerConfig.model_validate(
        {
            "jobName": "j",
            "model": {"path": "/m"},
            "dataset": {"path": "/d"},
            "method": "full",
            "maxSteps": 1,
            "outputDirectory": "/o",
            "strategy": strategy,
            "offload": offload,
            "deepspeed": config,
            "precision": precision,
        }
    )


def test_deepspeed_parser_catches_a_wrong_world_size(parse):
    # The check above can fail: the same config for 3 GPUs breaks DeepSpeed's batch arithmetic.
    config = build_deepspeed_config("zero2", "none", batch(world=4))
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        parse(config, 3)


def test_deepspeed_parser_rejects_unknown_zero_keys(parse):
    config = build_deepspeed_config("zero3", "none", batch())
    config["zero_optimization"]["stage3_not_a_setting"] = 1
    with pytest.raises(Exception, match="stage3_not_a_setting"):
        parse(config, 4)


def test_parameter_offload_needs_zero3():
    with pytest.raises(RenderError, match="ZeRO-3") as error:
        build_deepspeed_config("zero2", "optimizer+params", batch())
    assert error.value.path == "plan.offload"


def test_offload_refuses_a_gpu_only_optimizer():
    with pytest.raises(RenderError, match="offload needs adamw") as error:
        build_deepspeed_config("zero3", "optimizer", batch(optimizer="adamw-8bit"))
    assert error.value.path == "plan.optimizer"


def test_not_a_deepspeed_strategy():
    with pytest.raises(RenderError, match="not a DeepSpeed ZeRO strategy"):
        build_deepspeed_config("fsdp", "none", batch())


def test_fsdp_settings():
    assert build_fsdp_settings("none") == build_fsdp_settings("optimizer+params")
    with pytest.raises(RenderError, match="together"):
        build_fsdp_settings("optimizer")
