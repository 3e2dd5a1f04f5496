"""The trainer's side of Liger's kernels (training.ligerKernel): the Trainer turns them on from
TrainingArguments (the lever's `trainer_arguments`, through the registry), and a node without a
GPU, or an image without the package, refuses them before anything loads, naming the field."""

from __future__ import annotations

import pytest

from finetune_trainer.contract import EXIT_CONFIG_ERROR, TrainerConfig
from finetune_trainer.errors import ConfigError
from finetune_trainer.memory_levers import trainer_arguments
from finetune_trainer.memory_levers.liger_kernel import KERNELS

from .conftest import read_report, trainer_config, write_config


def config(**overrides) -> TrainerConfig:
    base = {"jobName": "t", "model": {"path": "/m"}, "dataset": {"path": "/d"}, "method": "lora", "maxSteps": 3,
            "outputDirectory": "/tmp/out"}
    return TrainerConfig.model_validate({**base, **overrides})


def test_the_trainer_asks_the_trainer_library_for_every_kernel_the_memory_term_counts():
    from finetune_trainer.run import training_arguments

    assert trainer_arguments(config()) == {}
    args = training_arguments(config(ligerKernel=True), max_steps=3, cuda=False)
    assert args.use_liger_kernel is True
    assert args.liger_kernel_config == KERNELS == {"rope": True, "rms_norm": True, "swiglu": True,
                                                   "fused_linear_cross_entropy": True, "cross_entropy": False}
    assert training_arguments(config(), max_steps=3, cuda=False).use_liger_kernel is False


def test_the_config_refuses_liger_with_the_chunked_loss_or_zero3():
    with pytest.raises(ValueError, match="chunked_loss: Liger's fused linear cross-entropy"):
        config(ligerKernel=True, lossChunks=8)
    with pytest.raises(ValueError, match="liger_kernel: .*ZeRO-3"):
        config(method="full", ligerKernel=True, strategy="zero3",
               deepspeed={"zero_optimization": {"stage": 3}})


def test_without_a_gpu_or_the_package_it_is_refused_naming_the_field(monkeypatch):
    from finetune_trainer import model_setup

    with pytest.raises(ConfigError, match="^ligerKernel: Liger's Triton kernels need CUDA; no GPU is visible$"):
        model_setup.check_runnable(config(ligerKernel=True), cuda=False)
    monkeypatch.setattr(model_setup.importlib.util, "find_spec",
                        lambda name: None if name == "liger_kernel" else object())
    with pytest.raises(ConfigError, match="^ligerKernel needs the liger_kernel package, which this image lacks$"):
        model_setup.check_runnable(config(ligerKernel=True), cuda=True)


def test_a_cpu_run_that_asks_for_liger_ends_with_a_config_error_report(assets, tmp_path, monkeypatch):
    from finetune_trainer.run import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_path = write_config(tmp_path, trainer_config(assets, tmp_path, method="lora", ligerKernel=True))
    assert main(["--config", str(config_path)]) == EXIT_CONFIG_ERROR
    report = read_report(tmp_path / "termination-log")
    assert report["reason"] == "ConfigError" and report["phase"] == "setup"
    assert report["message"] == "ConfigError: ligerKernel: Liger's Triton kernels need CUDA; no GPU is visible"
