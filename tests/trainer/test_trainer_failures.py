"""Failure classification, the termination-message writer, checkpoint folders, the launcher's exit code."""

import json


from finetune_trainer.checkpointing import CheckpointMeta, clean_staging, list_checkpoints, newest_checkpoint, prune
from finetune_trainer.contract import (
    EXIT_DATA_ERROR,
    EXIT_GPU_OOM,
    EXIT_HOST_OOM,
    EXIT_UNKNOWN,
    FailureReason,
    FailureReport,
    Phase,
)
from finetune_trainer.errors import ConfigError, DataError
from finetune_trainer.launch import (
    OomCounter,
    WorkerExit,
    exit_code_for,
    memory_cgroup_dir,
    read_oom_kills,
    verdict,
)
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
    assert exit_code_for(-15, str(path)) == 143  # torchrun itself terminated: the shell's 128+n
    # torchrun itself SIGKILLed, nothing tells it was memory: Unknown, said in a report.
    assert exit_code_for(-9, str(path)) == EXIT_UNKNOWN


# ------------------------------------------------- the launcher: a worker killed by SIGKILL

V2_EVENTS = "low 0\nhigh 0\nmax 17\noom 2\noom_kill {n}\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n"


def test_memory_cgroup_is_found_on_v2_and_v1(tmp_path):
    proc = tmp_path / "cgroup"
    # v2 in a cgroup namespace: /proc says "/", the container's cgroup is the mount root.
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu memory pids\n")
    (v2 / "memory.events").write_text(V2_EVENTS.format(n=3))
    proc.write_text("0::/\n")
    assert memory_cgroup_dir(str(proc), str(v2)) == v2
    assert read_oom_kills(v2) == OomCounter(str(v2 / "memory.events"), 3)
    # v2 without a namespace: the path /proc names, under the mount.
    (v2 / "kubepods" / "pod1").mkdir(parents=True)
    (v2 / "kubepods" / "pod1" / "memory.events").write_text(V2_EVENTS.format(n=0))
    proc.write_text("0::/kubepods/pod1\n")
    assert memory_cgroup_dir(str(proc), str(v2)) == v2 / "kubepods" / "pod1"
    # v1: the memory controller's hierarchy; a host path not visible in the container
    # falls back to the mount root (the container's own cgroup, bind-mounted).
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.oom_control").write_text(V1_OOM_CONTROL.format(n=1))
    proc.write_text("12:cpu,cpuacct:/kubepods/x\n4:memory:/kubepods/pod9/abc\n0::/\n")
    assert memory_cgroup_dir(str(proc), str(v1)) == v1 / "memory"
    assert read_oom_kills(v1 / "memory") == OomCounter(str(v1 / "memory" / "memory.oom_control"), 1)
    assert memory_cgroup_dir(str(proc), str(tmp_path / "nothing")) is None
    assert read_oom_kills(None) is None and read_oom_kills(tmp_path / "nothing") is None


def _peer_unknown() -> FailureReport:
    return FailureReport(reason=FailureReason.UNKNOWN, phase=Phase.FORWARD, step=3, exit_code=EXIT_UNKNOWN,
                         rank=0, world_size=2, message="RuntimeError: Connection closed by peer")


def test_a_sigkilled_worker_with_an_oom_kill_counted_is_host_oom():
    killed = [WorkerExit(rank=1, local_rank=1, pid=4242, exit_code=-9, signal="SIGKILL")]
    code, report = verdict(1, _peer_unknown(), killed, OomCounter("/c/memory.events", 4),
                           OomCounter("/c/memory.events", 5))
    assert code == EXIT_HOST_OOM and report.exit_code == EXIT_HOST_OOM
    assert report.reason is FailureReason.HOST_OUT_OF_MEMORY
    assert (report.rank, report.phase, report.step, report.world_size) == (1, Phase.FORWARD, 3, 2)
    assert "rank 1" in report.message and "pid 4242" in report.message and "SIGKILL" in report.message
    assert "oom_kill 4 -> 5" in report.message and "/c/memory.events" in report.message


def test_a_sigkilled_worker_without_evidence_is_unknown_and_says_so():
    killed = [WorkerExit(rank=1, local_rank=1, pid=4242, exit_code=-9, signal="SIGKILL")]
    counter = OomCounter("/c/memory.oom_control", 7)
    code, report = verdict(1, _peer_unknown(), killed, counter, counter)
    assert code == EXIT_UNKNOWN and report.reason is FailureReason.UNKNOWN and report.rank == 1
    assert "SIGKILL" in report.message and "no OOM kill" in report.message
    assert "Connection closed by peer" in report.message  # the peer's consequence is kept as context
    # No counter to read: still Unknown, and the message says why.
    code, report = verdict(1, None, killed, None, None)
    assert code == EXIT_UNKNOWN and "could not be read" in report.message
    assert (report.phase, report.step) == (Phase.SETUP, 0)


def test_a_workers_specific_report_wins_over_a_sigkill():
    gpu_oom = FailureReport(reason=FailureReason.GPU_OUT_OF_MEMORY, phase=Phase.BACKWARD, step=2,
                            exit_code=EXIT_GPU_OOM)
    killed = [WorkerExit(rank=1, local_rank=1, pid=1, exit_code=-9, signal="SIGKILL")]
    assert verdict(1, gpu_oom, killed, OomCounter("x", 0), OomCounter("x", 1)) == (EXIT_GPU_OOM, None)
    # A worker that failed otherwise (exit 1, its own Unknown report): nothing to add.
    crashed = [WorkerExit(rank=0, local_rank=0, pid=2, exit_code=1)]
    assert verdict(1, _peer_unknown(), crashed, OomCounter("x", 0), OomCounter("x", 1)) == (EXIT_UNKNOWN, None)
    assert verdict(0, None, killed, OomCounter("x", 0), OomCounter("x", 1)) == (0, None)
