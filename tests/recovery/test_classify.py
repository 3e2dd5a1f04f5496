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


# What our trainer prints (reporting.log_json): one JSON object a line.
OUR_LOG_TAIL = (
    '{"event": "step", "time": 1764497474.0, "rank": 0, "step": 12, "loss": 1.92}\n'
    '{"event": "warning", "time": 1764497475.5, "rank": 0, "message": "cannot write failure report to /dev/termination-log: [Errno 30] Read-only file system"}\n'
)


def test_exit_code_alone_follows_the_contract_when_the_log_shows_our_trainer():
    # Our trainer could not write its report (read-only termination log), but its log lines
    # are in the tail: its exit code is its word.
    verdict = classify_pod(pod("p", {"exitCode": contract.EXIT_GPU_OOM, "message": OUR_LOG_TAIL}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.source == "exit-code"


@pytest.mark.parametrize("code", [contract.EXIT_GPU_OOM, contract.EXIT_HOST_OOM])
@pytest.mark.parametrize("tail", ["", "Retrying later: upstream unavailable\n", '{"level": "error", "msg": "x"}\n'])
def test_a_contract_exit_code_of_a_foreign_image_is_not_a_memory_failure(code, tail):
    # 75 is EX_TEMPFAIL and 71 EX_OSERR for other programs (sysexits.h): without a report or
    # our log lines, reading them as GPU / host OOM would re-plan a job for nothing.
    verdict = classify_pod(pod("p", {"exitCode": code, "reason": "Error", "message": tail}))
    assert verdict.kind is FailureKind.UNKNOWN and verdict.remedy is Remedy.GIVE_UP
    assert f"exit code {code}" in verdict.message and "without its failure report" in verdict.message


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


# ---------------------------------------------------------------------------
# A container's own verdict and the pod's disruption
# ---------------------------------------------------------------------------

PREEMPTED = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
             "message": "team-b/higher-prio: preempting to accommodate a higher priority pod"}


def test_a_containers_own_report_wins_over_the_pods_disruption():
    # The GPU OOM ended the container; the pod was marked for deletion as it went down.
    # Reading it as an eviction would run the plan that ran out of memory again.
    verdict = classify_pod(pod("p", {"exitCode": 75, "message": report()}, conditions=[PREEMPTED]))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.source == "report"


def test_oom_killed_wins_over_the_pods_disruption():
    verdict = classify_pod(pod("p", {"exitCode": 137, "reason": "OOMKilled"}, conditions=[PREEMPTED]))
    assert verdict.kind is FailureKind.HOST_OUT_OF_MEMORY and verdict.remedy is Remedy.ADJUST


def test_a_kubelet_eviction_does_not_shadow_a_cuda_oom_in_the_log():
    evicted = pod("p", {"exitCode": 1, "message": TORCH_OOM_TAIL}, reason="Evicted", message="The node was low on resource: memory.")
    assert classify_pod(evicted).kind is FailureKind.GPU_OUT_OF_MEMORY


def test_an_unknown_exit_of_a_disrupted_pod_is_the_disruption():
    # SIGTERM (143) and an Unknown report are what a preemption looks like from inside.
    unknown = report(reason="Unknown", exit_code=1, message="RuntimeError: NCCL communicator was aborted",
                     peak_allocated_bytes=None)
    for terminated in ({"exitCode": 143, "reason": "Error"}, {"exitCode": 1, "message": unknown}):
        verdict = classify_pod(pod("p", terminated, conditions=[PREEMPTED]))
        assert verdict.kind is FailureKind.EVICTED and verdict.remedy is Remedy.RETRY_SAME


# ---------------------------------------------------------------------------
# torchrun passing a worker's SIGKILL through
# ---------------------------------------------------------------------------

# What torch.distributed.elastic prints when the kernel kills one worker: the agent's line,
# then the ChildFailedError summary (the launcher exits with torchrun's 1, no report).
TORCHRUN_SIGKILL_TAIL = """\
[2026-11-30 10:11:14,001] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 1 (pid: 59) of binary: /usr/bin/python
Traceback (most recent call last):
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/run.py", line 883, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
finetune_trainer FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_10:11:14
  host      : support-bot-a1-worker-0
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 59)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 59
============================================================
"""


def test_a_worker_killed_by_sigkill_under_torchrun_is_host_memory():
    verdict = classify_pod(pod("p", {"exitCode": 1, "reason": "Error", "message": TORCHRUN_SIGKILL_TAIL}))
    assert verdict.kind is FailureKind.HOST_OUT_OF_MEMORY and verdict.source == "log"
    assert verdict.remedy is Remedy.ADJUST
    assert "rank 3" in verdict.message and "SIGKILL" in verdict.message


@pytest.mark.parametrize("tail", [
    # Only the agent's line survived the tail.
    "W1130 10:11:14.000000 1 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -9) local_rank: 0 (pid: 57) of binary: /usr/bin/python\n",
    # Only the end of the summary.
    "  error_file: <N/A>\n  traceback : Signal 9 (SIGKILL) received by PID 57\n=====\n",
])
def test_torchrun_sigkill_from_a_partial_tail(tail):
    assert classify_pod(pod("p", {"exitCode": 1, "message": tail})).kind is FailureKind.HOST_OUT_OF_MEMORY


def test_a_worker_killed_after_a_peer_failed_is_not_the_cause():
    # The first failure was an ordinary error (exitcode 1); the SIGKILL went to a worker
    # that did not stop after SIGTERM. That is not a host OOM.
    tail = TORCHRUN_SIGKILL_TAIL.replace("<NO_OTHER_FAILURES>", "[1]:\n  rank      : 2 (local_rank: 0)\n  exitcode  : -9 (pid: 58)") \
        .replace("  exitcode  : -9 (pid: 59)", "  exitcode  : 1 (pid: 59)") \
        .replace("traceback : Signal 9 (SIGKILL) received by PID 59", "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html") \
        .replace("failed (exitcode: -9)", "failed (exitcode: 1)")
    verdict = classify_pod(pod("p", {"exitCode": 1, "message": tail}))
    assert verdict.kind is FailureKind.UNKNOWN


def test_a_cuda_oom_on_one_worker_is_not_read_as_the_sigkill_of_another():
    tail = TORCH_OOM_TAIL + "  traceback : Signal 9 (SIGKILL) received by PID 58\n"
    assert classify_pod(pod("p", {"exitCode": 1, "message": tail})).kind is FailureKind.GPU_OUT_OF_MEMORY


# ---------------------------------------------------------------------------
# What a verdict quotes is redacted and bounded
# ---------------------------------------------------------------------------

SECRET_TAIL = (
    "Downloading https://data.s3.eu-central-1.amazonaws.com/support/train.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20261130%2Feu-central-1%2Fs3%2Faws4_request"
    "&X-Amz-Signature=9f2c1e0d4b5a6978&X-Amz-Expires=3600\n"
    "HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789\n"
    "requests.exceptions.HTTPError: 403 Client Error for url with headers {'Authorization': 'Bearer s3cr3t-t0ken-value'}\n"
)
SECRETS = ("AKIAIOSFODNN7EXAMPLE", "9f2c1e0d4b5a6978", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "s3cr3t-t0ken-value")


def test_a_log_tail_quoted_in_a_verdict_is_redacted():
    verdict = classify_pod(pod("p", {"exitCode": 2, "reason": "Error", "message": SECRET_TAIL}))
    assert verdict.kind is FailureKind.UNKNOWN
    assert "403 Client Error" in verdict.message and "[REDACTED]" in verdict.message
    for secret in SECRETS:
        assert secret not in verdict.message and secret not in verdict.describe()


def test_a_cuda_oom_line_is_redacted_too():
    tail = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. password=hunter22 GPU 0\n"
    verdict = classify_pod(pod("p", {"exitCode": 1, "message": tail}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and "hunter22" not in verdict.message


def test_our_reports_message_is_redacted_and_bounded():
    text = "OSError: cannot open s3://b/x?X-Amz-Signature=deadbeefcafe: " + "x" * 5000
    message = report(reason="DataError", phase="data", exit_code=65, message=text, peak_allocated_bytes=None)
    verdict = classify_pod(pod("p", {"exitCode": 65, "message": message}))
    assert verdict.kind is FailureKind.DATA_ERROR
    assert "deadbeefcafe" not in verdict.message and len(verdict.message) <= 600


def test_the_job_conditions_message_is_redacted():
    job = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                                      "message": "pull secret token=abc123def456 rejected"}]}}
    assert "abc123def456" not in classify_attempt([], job).message


def test_a_private_key_printed_across_lines_is_not_quoted_in_part():
    tail = ("loaded key\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
            "QyNTUxOQAAACBvZXJ0aGVyZW1vdmVkZm9yYmVyZXZpdHk\n")  # the tail ends inside the block
    verdict = classify_pod(pod("p", {"exitCode": 2, "message": tail}))
    assert "QyNTUxOQ" not in verdict.message and "b3BlbnNz" not in verdict.message


def test_oom_killed_wins_over_an_unknown_report_of_a_surviving_rank():
    # Rank 1 wrote "NCCL communicator was aborted" (Unknown) after rank 0 vanished; then the
    # kernel killed the container for memory. The kill is the cause.
    unknown = report(reason="Unknown", exit_code=1, message="RuntimeError: NCCL communicator was aborted",
                     peak_allocated_bytes=None, rank=1)
    verdict = classify_pod(pod("p", {"exitCode": 137, "reason": "OOMKilled", "message": unknown}))
    assert verdict.kind is FailureKind.HOST_OUT_OF_MEMORY
    # A specific report still wins over the kill (a GPU OOM, then the teardown).
    verdict = classify_pod(pod("p", {"exitCode": 137, "reason": "OOMKilled", "message": report()}))
    assert verdict.kind is FailureKind.GPU_OUT_OF_MEMORY
