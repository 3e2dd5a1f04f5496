"""Classification of failed attempts from realistic pod statuses."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_operator.recovery import FailureKind, Remedy, classify_attempt, classify_pod, parse_cuda_oom
from finetune_trainer import contract

GiB = 2**30

# What torch 2.x prints (the log tail FallbackToLogsOnError puts in the termination message).
TORCH_OOM_TAIL = """\
  File "/usr/local/lib/python3.11/site-packages/torch/nn/modules/linear.py", line 125, in forward
    return F.linear(input, self.weight, self.bias)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.53 GiB is free. Including non-PyTorch memory, this process has 77.65 GiB memory in use. Of the allocated memory 75.62 GiB is allocated by PyTorch, and 1.10 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)
[rank0]:[W1130 10:11:12.000000000 ProcessGroupNCCL.cpp:1250] Warning: WARNING: process group has NOT been destroyed before we destruct ProcessGroupNCCL.
E1130 10:11:14.000000 1 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) local_rank: 0 (pid: 57) of binary: /usr/bin/python
"""

# What torch 1.x / 2.0 printed.
OLD_TORCH_OOM_TAIL = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
    "14.56 GiB already allocated; 3.06 MiB free; 14.75 GiB reserved in total by PyTorch)"
)


def pod(name: str, terminated: dict[str, Any] | None = None, *, phase: str = "Failed", **status: Any) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "pytorch", "ready": False, "restartCount": 0, "image": "trainer:1"}
    if terminated is not None:
        container["state"] = {"terminated": {"startedAt": "2026-11-30T10:00:00Z", "finishedAt": "2026-11-30T10:11:14Z", **terminated}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a", "labels": {"training.kubeflow.org/replica-type": "master"}},
        "status": {"phase": phase, "containerStatuses": [container], **status},
    }


def report(**fields: Any) -> str:
    base = dict(reason="GPUOutOfMemory", phase="backward", step=0, exit_code=75, message="CUDA out of memory",
                peak_allocated_bytes=int(79.1 * GiB), device_total_bytes=80 * GiB, micro_batch_size=4, rank=0)
    base.update(fields)
    return contract.FailureReport(**base).to_termination_message()


def test_trainer_report_gpu_oom():
    verdict = classify_pod(pod("j-a1-master-0", {"exitCode": 75, "reason": "Error", "message": report()}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.source == "report"
    assert verdict.phase == "backward" and verdict.step == 0 and verdict.micro_batch_size == 4
    assert verdict.peak_allocated_bytes == int(79.1 * GiB) and verdict.capacity_bytes == 80 * GiB
    assert verdict.remedy is Remedy.ADJUST
    assert verdict.describe() == "GPU OOM in backward at step 0, 79.1 of 80.0 GiB"


def test_trainer_report_data_error_is_not_retried():
    message = report(reason="DataError", phase="data", exit_code=65, message="line 17: not JSON", peak_allocated_bytes=None)
    verdict = classify_pod(pod("p", {"exitCode": 65, "reason": "Error", "message": message}))
    assert verdict.kind is FailureKind.DATA_ERROR and verdict.remedy is Remedy.GIVE_UP
    assert "line 17" in verdict.message


def test_trainer_report_config_error():
    message = report(reason="ConfigError", phase="setup", exit_code=78, message="qlora needs CUDA", peak_allocated_bytes=None)
    assert classify_pod(pod("p", {"exitCode": 78, "message": message})).kind is FailureKind.CONFIG_ERROR


def test_cuda_oom_in_log_tail_of_a_foreign_image():
    verdict = classify_pod(pod("p", {"exitCode": 1, "reason": "Error", "message": TORCH_OOM_TAIL}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.source == "log"
    assert verdict.capacity_bytes == int(79.19 * GiB)
    assert verdict.peak_allocated_bytes == int(75.62 * GiB)
    assert verdict.tried_to_allocate_bytes == 2 * GiB
    assert verdict.message.startswith("torch.OutOfMemoryError")


def test_old_torch_oom_message():
    figures = parse_cuda_oom(OLD_TORCH_OOM_TAIL)
    assert figures == {
        "tried_to_allocate_bytes": 20 * 2**20,
        "capacity_bytes": int(15.78 * GiB),
        "peak_allocated_bytes": int(14.56 * GiB),
    }


def test_cuda_runtime_oom_without_figures():
    verdict = classify_pod(pod("p", {"exitCode": 1, "message": "RuntimeError: CUDA error: out of memory\nCUDA kernel errors..."}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY
    assert verdict.capacity_bytes is None


def test_no_oom_in_an_ordinary_traceback():
    assert parse_cuda_oom("ValueError: bad shape\n") is None


def test_kernel_oom_kill_is_host_memory():
    verdict = classify_pod(pod("p", {"exitCode": 137, "reason": "OOMKilled"}))
    assert verdict.kind is FailureKind.HOST_OUT_OF_MEMORY and verdict.source == "kubelet"
    assert verdict.remedy is Remedy.ADJUST


def test_oom_killed_wins_over_a_log_that_mentions_cuda_oom_earlier():
    # The kernel killed it: whatever the log said before, host memory is what ended it.
    verdict = classify_pod(pod("p", {"exitCode": 137, "reason": "OOMKilled", "message": "loading...\n"}))
    assert verdict.kind is FailureKind.HOST_OUT_OF_MEMORY


def test_python_memory_error_is_host_memory():
    tail = "Traceback (most recent call last):\n  File \"x.py\", line 3\nMemoryError\n"
    assert classify_pod(pod("p", {"exitCode": 1, "message": tail})).kind is FailureKind.HOST_OUT_OF_MEMORY


def test_eviction_retries_the_same_plan():
    evicted = pod("p", None, reason="Evicted", message="The node was low on resource: ephemeral-storage.")
    verdict = classify_pod(evicted)
    assert verdict.kind is FailureKind.EVICTED and verdict.remedy is Remedy.RETRY_SAME


def test_preemption_by_scheduler():
    preempted = pod("p", {"exitCode": 143, "reason": "Error"}, conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
         "message": "team-b/higher-prio: preempting to accommodate a higher priority pod"},
    ])
    verdict = classify_pod(preempted)
    assert verdict.kind is FailureKind.EVICTED and verdict.remedy is Remedy.RETRY_SAME
    assert "PreemptionByScheduler" in verdict.message


def test_node_lost_by_taint_manager():
    lost = pod("p", None, phase="Failed", conditions=[
        {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager", "message": "Taint manager: deleting due to NoExecute taint"},
    ])
    assert classify_pod(lost).kind is FailureKind.NODE_LOST


def test_unknown_exit_code_keeps_the_last_log_line():
    verdict = classify_pod(pod("p", {"exitCode": 2, "reason": "Error", "message": "starting\nKeyError: 'input_ids'\n"}))
    assert verdict.kind is FailureKind.UNKNOWN and verdict.remedy is Remedy.GIVE_UP
    assert "KeyError: 'input_ids'" in verdict.message and "exit code 2" in verdict.message


def test_exit_code_alone_follows_the_contract():
    assert classify_pod(pod("p", {"exitCode": contract.EXIT_GPU_OOM})).kind is FailureKind.GPU_OUT_OF_MEMORY


def test_succeeded_pod_is_not_a_failure():
    assert classify_pod(pod("p", {"exitCode": 0, "reason": "Completed"}, phase="Succeeded")) is None


def test_attempt_picks_the_rank_that_ran_out_of_memory():
    pods = [
        pod("j-a1-master-0", {"exitCode": 1, "message": "torch.distributed.DistBackendError: NCCL communicator was aborted"}),
        pod("j-a1-worker-0", {"exitCode": 75, "message": report(rank=9)}),
        pod("j-a1-worker-1", {"exitCode": 1, "message": "RuntimeError: NCCL error"}),
    ]
    verdict = classify_attempt(pods)
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.pod == "j-a1-worker-0"


def test_attempt_without_pods_uses_the_job_condition():
    job = {"status": {"conditions": [
        {"type": "Created", "status": "True"},
        {"type": "Failed", "status": "True", "reason": "PyTorchJobFailed", "message": "PyTorchJob j-a1 is failed because 1 Master replica(s) failed."},
    ]}}
    verdict = classify_attempt([], job)
    assert verdict.kind is FailureKind.UNKNOWN and "1 Master replica(s) failed" in verdict.message


@pytest.mark.parametrize("garbage", ["{not json", '{"reason": "Nope"}', "", "null"])
def test_a_termination_message_that_is_not_a_report(garbage):
    verdict = classify_pod(pod("p", {"exitCode": 1, "message": garbage}))
    assert verdict.kind is FailureKind.UNKNOWN
