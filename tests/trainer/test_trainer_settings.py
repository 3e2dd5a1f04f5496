"""Settings the trainer derives from its config: the attention kernel, the warmup."""

from __future__ import annotations

import json

from finetune_trainer.contract import TrainerConfig
from finetune_trainer.model_setup import attention_for


def _config(tmp_path, model_type: str, attention: str) -> TrainerConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return TrainerConfig(job_name="j", model={"path": str(tmp_path)}, dataset={"path": "/data"},
                         max_steps=1, output_directory="/out", attention=attention)


def test_gemma2_gets_eager_instead_of_sdpa(tmp_path):
    assert attention_for(_config(tmp_path, "gemma2", "sdpa")) == "eager"


def test_gpt_oss_gets_eager_instead_of_sdpa(tmp_path):
    """transformers refuses sdpa for gpt-oss (attention sinks); sizing estimates it as eager too."""
    from finetune_operator.sizing import FAMILIES

    assert attention_for(_config(tmp_path, "gpt_oss", "sdpa")) == "eager"
    assert FAMILIES["gpt_oss"].eager_only


def test_other_models_keep_what_was_asked(tmp_path):
    assert attention_for(_config(tmp_path, "llama", "sdpa")) == "sdpa"
    assert attention_for(_config(tmp_path, "llama", "eager")) == "eager"
    assert attention_for(_config(tmp_path, "gemma2", "flash")) == "flash_attention_2"


def test_an_epoch_based_job_warms_up_by_ratio(tmp_path):
    from finetune_trainer.run import training_arguments

    by_epochs = TrainerConfig(job_name="j", model={"path": str(tmp_path)}, dataset={"path": "/data"}, epochs=1,
                              output_directory=str(tmp_path / "out"), warmup_ratio=0.05, precision="fp32")
    assert training_arguments(by_epochs, max_steps=100, cuda=False).warmup_steps == 0.05
    by_steps = by_epochs.model_copy(update={"warmup_steps": 3})
    assert training_arguments(by_steps, max_steps=100, cuda=False).warmup_steps == 3


def test_evaluation_runs_at_its_own_micro_batch_or_at_trainings(tmp_path):
    from finetune_trainer.run import training_arguments

    base = TrainerConfig(job_name="j", model={"path": str(tmp_path)}, dataset={"path": "/data"}, max_steps=10,
                         output_directory=str(tmp_path / "out"), precision="fp32", micro_batch_size=2,
                         evaluation={"heldOutFraction": 0.1})
    assert training_arguments(base, max_steps=10, cuda=False).per_device_eval_batch_size == 2
    own = base.model_copy(update={"evaluation": base.evaluation.model_copy(update={"micro_batch_size": 16})})
    assert training_arguments(own, max_steps=10, cuda=False).per_device_eval_batch_size == 16
