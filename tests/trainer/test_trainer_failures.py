"""Failure classification, the termination-message writer, checkpoint folders, the launcher's exit code."""

import json


from finetune_trainer.checkpointing import CheckpointMeta, clean_staging, list_checkpoints, newest_checkpoint, prune
from finetune_trainer.contract import EXIT_DATA_ERROR, EXIT_GPU_OOM, FailureReason, FailureReport, Phase
from finetune_trainer.errors import ConfigError, DataError
from finetune_trainer.launch import exit_code_for
from finetune_trainer.phases import Progress
from finetune_trainer.reporting import build_report, classify, write_report


def test_classify():
    import torch

    assert classify(torch.OutOfMemoryError("CUDA out of memory")) is FailureReason.GPU_OUT_OF_MEMORY
    assert classify(RuntimeError("CUDA error: out of memory")) is FailureReason.GPU_OUT_OF_MEMORY
    assert classify(MemoryError()) is FailureReason.HOST_OUT_OF_MEMORY
    assert classify(DataError("x")) is FailureReason.DATA_ERROR
    assert classify(ConfigError("x")) is FailureReason.CONFIG_ERROR
    assert classify(RuntimeError("Connection closed by peer")) is FailureReason.UNKNOWN


def test_build_report_carries_phase_step_and_batch(monkeypatch):
    import torch

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    progress = Progress(phase=Phase.BACKWARD, step=7, micro_batch_size=2, sequence_length=4096)
    report = build_report(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), progress, 2)
    assert (report.reason, report.phase, report.step, report.rank, report.exit_code) == (
        FailureReason.GPU_OUT_OF_MEMORY, Phase.BACKWARD, 7, 3, EXIT_GPU_OOM)
    assert report.micro_batch_size == 2 and report.sequence_length == 4096 and report.attempt == 2


def _report(reason, rank=0):
    return FailureReport(reason=reason, phase=Phase.FORWARD, step=1, exit_code=1, rank=rank)


def test_first_specific_report_wins(tmp_path):
    path = tmp_path / "termination-log"
    assert write_report(_report(FailureReason.UNKNOWN, rank=0), path)
    assert write_report(_report(FailureReason.GPU_OUT_OF_MEMORY, rank=1), path)  # replaces Unknown
    assert not write_report(_report(FailureReason.UNKNOWN, rank=0), path)
    assert not write_report(_report(FailureReason.DATA_ERROR, rank=2), path)
    assert json.loads(path.read_text())["reason"] == "GPUOutOfMemory"
    assert not write_report(_report(FailureReason.UNKNOWN), tmp_path / "no" / "such" / "dir")


def _fake_checkpoint(root, step):
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True)
    meta = CheckpointMeta(step=step, samples_consumed=step * 8, world_size=1, strategy="ddp", method="lora",
                          format="dcp", micro_batch_size=2, gradient_accumulation=4, attempt=1)
    (folder / "meta.json").write_text(meta.to_json())
    return folder


def test_checkpoint_folders(tmp_path):
    for step in (4, 8, 12, 16):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "step-00000020").mkdir()  # no meta.json: incomplete
    (tmp_path / ".staging-step-00000024").mkdir()
    assert newest_checkpoint(tmp_path).meta.step == 16
    removed = prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step-00000004", "step-00000008"]
    assert [c.meta.step for c in list_checkpoints(tmp_path)] == [12, 16]
    clean_staging(tmp_path)
    assert not list(tmp_path.glob(".staging-*"))
    assert newest_checkpoint(tmp_path / "missing") is None


def test_launcher_exit_code_follows_the_report(tmp_path):
    path = tmp_path / "termination-log"
    assert exit_code_for(0, str(path)) == 0
    assert exit_code_for(1, str(path)) == 1  # no report
    path.write_text(FailureReport(reason=FailureReason.DATA_ERROR, phase=Phase.DATA, step=0,
                                  exit_code=EXIT_DATA_ERROR).to_termination_message())
    assert exit_code_for(1, str(path)) == EXIT_DATA_ERROR
    path.write_text("Traceback: not a report")
    assert exit_code_for(-9, str(path)) == 137
