"""Where an attempt starts and stops: steps and samples across changed batch shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_trainer.checkpointing import Checkpoint, CheckpointMeta
from finetune_trainer.contract import TrainerConfig
from finetune_trainer.run import plan_run, usable_checkpoint


def config(**over) -> TrainerConfig:
    doc = {"jobName": "j", "model": {"path": "/m"}, "dataset": {"path": "/d"}, "outputDirectory": "/o",
           "microBatchSize": 4, "gradientAccumulation": 2, "epochs": 2}
    doc.update(over)
    return TrainerConfig.model_validate(doc)


def checkpoint(step: int, samples: int, **over) -> Checkpoint:
    fields = dict(step=step, samples_consumed=samples, world_size=2, strategy="ddp", method="lora",
                  format="dcp", micro_batch_size=4, gradient_accumulation=2, attempt=1)
    fields.update(over)
    return Checkpoint(Path("/ckpt/x"), CheckpointMeta(**fields))


def test_epochs_become_steps_of_the_global_batch():
    plan = plan_run(config(), num_examples=100, world=2, checkpoint=None)
    assert plan.global_batch == 16 and plan.max_steps == 13  # ceil(200 / 16)
    assert plan.start_step == 0 and plan.resume_from is None


def test_resume_with_a_smaller_global_batch_finishes_the_same_samples():
    # 10 steps of 16 consumed 160 of 200 samples; now 1 GPU, micro-batch 2, accumulation 2.
    plan = plan_run(config(microBatchSize=2, gradientAccumulation=2), num_examples=100, world=1,
                    checkpoint=checkpoint(10, 160))
    assert plan.global_batch == 4
    assert (plan.start_step, plan.start_samples, plan.max_steps) == (10, 160, 20)
    assert plan.restore_optimizer


def test_max_steps_stay_steps():
    plan = plan_run(config(epochs=None, maxSteps=50), num_examples=100, world=4, checkpoint=checkpoint(20, 320))
    assert (plan.start_step, plan.max_steps) == (20, 50)


@pytest.mark.parametrize(
    "strategy, world, restores",
    [("fsdp", 8, True), ("ddp", 1, True), ("zero3", 2, False)],
)
def test_which_resumes_carry_the_optimizer(strategy, world, restores):
    deepspeed = {"zero_optimization": {"stage": 3}} if strategy == "zero3" else None
    cfg = config(strategy=strategy, deepspeed=deepspeed)
    assert plan_run(cfg, 100, world, checkpoint(4, 64)).restore_optimizer is restores


def test_checkpoint_of_another_method_is_not_used(tmp_path):
    root = tmp_path / "ckpt"
    folder = root / "step-00000004"
    folder.mkdir(parents=True)
    meta = checkpoint(4, 64).meta
    (folder / "meta.json").write_text(meta.to_json())
    ckpt = {"directory": str(root)}
    assert usable_checkpoint(config(method="qlora", checkpoint=ckpt)).meta.step == 4  # adapters fit
    assert usable_checkpoint(config(method="full", checkpoint=ckpt)) is None


def test_deepspeed_batch_numbers_must_match_the_attempt():
    from finetune_trainer.contract import deepspeed_config
    from finetune_trainer.errors import ConfigError
    from finetune_trainer.model_setup import check_deepspeed_batch

    ds = deepspeed_config(2)
    check_deepspeed_batch(config(strategy="zero2", deepspeed=ds), 4)  # "auto" everywhere
    ds.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, train_batch_size=32)
    check_deepspeed_batch(config(strategy="zero2", deepspeed=ds), 4)
    with pytest.raises(ConfigError, match="deepspeed.train_batch_size is 32 but this attempt runs 16"):
        check_deepspeed_batch(config(strategy="zero2", deepspeed=ds), 2)


@pytest.mark.parametrize(
    "recorded, running, restores",
    [
        ("adamw", "adamw", True),
        (None, "adamw", True),  # written before optimizers were recorded: taken as adamw
        ("adamw", "adamw-8bit", False),  # AdamW's fp32 moments must not feed an 8-bit optimizer
        ("adamw-8bit", "adamw", False),
        (None, "paged-adamw-8bit", False),
        ("adamw-8bit", "paged-adamw-8bit", False),
        ("paged-adamw-8bit", "paged-adamw-8bit", True),
    ],
)
def test_optimizer_state_of_another_optimizer_is_not_restored(recorded, running, restores):
    plan = plan_run(config(optimizer=running), 100, 2, checkpoint(4, 64, optimizer=recorded))
    assert plan.restore_optimizer is restores
    if restores:
        assert plan.optimizer_not_restored is None
    else:
        assert plan.optimizer_not_restored == (
            f"the checkpoint holds {recorded or 'adamw'} optimizer state and this attempt runs {running}")
    # Weights, step and data position carry over either way.
    assert (plan.start_step, plan.start_samples, plan.resume_from.meta.step) == (4, 64, 4)


def test_meta_json_without_optimizer_or_with_unknown_keys_still_reads(tmp_path):
    import json

    from finetune_trainer.checkpointing import newest_checkpoint

    meta = json.loads(checkpoint(4, 64).meta.to_json())
    assert meta["optimizer"] is None
    del meta["optimizer"]  # as written before optimizers were recorded
    folder = tmp_path / "step-00000004"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(meta))
    old = newest_checkpoint(tmp_path)
    assert old.meta.step == 4 and old.meta.optimizer is None and old.meta.optimizer_or_legacy == "adamw"
    # A newer trainer's extra field must not hide the checkpoint (the job would start over).
    meta.update(optimizer="adamw-8bit", somethingNew={"x": 1})
    folder = tmp_path / "step-00000008"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(dict(meta, step=8)))
    newer = newest_checkpoint(tmp_path)
    assert newer.meta.step == 8 and newer.meta.optimizer == "adamw-8bit"
