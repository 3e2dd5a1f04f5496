"""A checkpoint on the tenant's volume carrying a pickle payload: refused as a DataError
naming the file, and the payload never runs (untrusted.py)."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest

from finetune_trainer import checkpointing, untrusted
from finetune_trainer.checkpointing import CheckpointMeta
from finetune_trainer.contract import EXIT_DATA_ERROR
from finetune_trainer.errors import DataError

from .conftest import read_report, run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow


class Payload:
    """Unpickling this calls os.mkdir(marker): the file a payload would create."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _meta(step: int, fmt: str = "dcp") -> CheckpointMeta:
    return CheckpointMeta(step=step, samples_consumed=step * 8, world_size=1, strategy="ddp", method="full",
                          format=fmt, micro_batch_size=4, gradient_accumulation=2, attempt=1)


@pytest.fixture(scope="module")
def genuine(assets, tmp_path_factory):
    """A real DCP checkpoint of the tiny model (step 4), written as the trainer does."""
    import torch
    from transformers import AutoModelForCausalLM, get_constant_schedule

    root = tmp_path_factory.mktemp("genuine")
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpointing.save_checkpoint(root=root, meta=_meta(4), model=model, optimizer=optimizer,
                                  scheduler=get_constant_schedule(optimizer), deepspeed_engine=None, lora=False,
                                  keep_last=1)
    return root


def _copy(genuine, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(genuine, root)
    return root, checkpointing.newest_checkpoint(root)


def test_a_genuine_checkpoint_passes_and_loads_as_data(genuine, tmp_path):
    _, checkpoint = _copy(genuine, tmp_path)
    checkpointing.check_files(checkpoint)
    assert untrusted.load_tensors(checkpoint.path / "scheduler.pt")["base_lrs"] == [1e-3]
    metadata = untrusted.load_dcp_metadata(checkpoint.path / "dcp" / ".metadata")
    assert any(key.startswith("model.") for key in metadata.state_dict_metadata)


def test_a_scheduler_file_with_a_payload_is_a_data_error_and_never_runs(genuine, tmp_path):
    import torch

    _, checkpoint = _copy(genuine, tmp_path)
    marker = tmp_path / "pwned"
    target = checkpoint.path / "scheduler.pt"
    torch.save({"base_lrs": [1e-3], "_last_lr": [1e-3], "extra": Payload(marker)}, target)
    for load in (lambda: checkpointing.check_files(checkpoint),
                 lambda: checkpointing.load_scheduler(checkpoint, scheduler=None, optimizer=None)):
        with pytest.raises(DataError) as raised:
            load()
        assert str(target) in str(raised.value) and "mkdir" in str(raised.value)
    assert not marker.exists()


def test_a_dcp_metadata_file_with_a_payload_is_a_data_error_and_never_runs(assets, genuine, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    _, checkpoint = _copy(genuine, tmp_path)
    marker = tmp_path / "pwned"
    target = checkpoint.path / "dcp" / ".metadata"
    target.write_bytes(pickle.dumps(Payload(marker)))
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    for load in (lambda: checkpointing.check_files(checkpoint),
                 lambda: checkpointing.load_weights(checkpoint, model, lora=False),
                 lambda: checkpointing._dcp_full_state(checkpoint)):
        with pytest.raises(DataError) as raised:
            load()
        assert str(target) in str(raised.value) and "posix.mkdir" in str(raised.value)
    assert not marker.exists()


def test_a_deepspeed_file_with_a_payload_is_refused_before_deepspeed_opens_it(genuine, tmp_path):
    import torch

    state = tmp_path / "deepspeed" / "state"
    state.mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save({"module": {"w": torch.zeros(2)}}, state / "mp_rank_00_model_states.pt")
    untrusted.check_deepspeed_files(tmp_path / "deepspeed")
    target = state / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": Payload(marker)}, target)
    with pytest.raises(DataError) as raised:
        untrusted.check_deepspeed_files(tmp_path / "deepspeed")
    assert str(target) in str(raised.value)
    assert not marker.exists()


def test_the_trainer_fails_the_attempt_with_a_data_error_report_naming_the_file(assets, genuine, tmp_path):
    import torch

    root, checkpoint = _copy(genuine, tmp_path)
    marker = tmp_path / "pwned"
    target = checkpoint.path / "scheduler.pt"
    torch.save({"base_lrs": [1e-3], "extra": Payload(marker)}, target)
    config = trainer_config(assets, tmp_path, maxSteps=6, attempt=2,
                            checkpoint={"directory": str(root), "everySteps": 4, "keepLast": 2})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == EXIT_DATA_ERROR, run.output[-3000:]
    report = read_report(tmp_path / "termination-log")
    assert report["reason"] == "DataError"
    assert str(target) in report["message"]
    assert not marker.exists()
    assert not run.of("progress")  # nothing trained
