"""Scenarios on real processes (issue 15): the operator, the training operator and the trainer meet.

The lab's process runner (e2e/lab/podrunner.py) runs every pod of the `cpu-run-local` pool as
the real trainer on this machine's CPUs (gloo, one process per pod) with the pod's own command,
environment, volumes and memory limit; the operator plans there because this module's chart
values allow region lab-local. Each scenario asserts on the trainer's own output (its log lines:
steps, losses, resume step, failure report; the checkpoints and the adapter in the claim), not
only on phases.

The five jobs run at the same time (one lab, one operator; `runs` drives them and the two
interventions: a worker pod deleted mid-run, a suspend and resume), so the module costs about as
long as its slowest job. Each scenario's time from apply to its terminal phase is printed
(pytest -s) and listed in e2e/README.md.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from finetune_operator import api

from e2e import operator_harness as h
from e2e import real_processes as rp
from e2e.lab.fate import JOB_LABEL

pytestmark = pytest.mark.e2e

# GPU OOM: the lab GPU's OOM at this step of attempt 1 (rule outcome-by-attempt gpu-oom,auto).
OOM_STEP = 10
# Host OOM: the cgroup gets this share of the pod's memory limit (the plan's 5 GiB per rank is far
# more than the tiny trainer needs; 0.15 of it is less than one trainer process's resident memory,
# and each 1.5x raise by the operator gives the next attempt more).
HOST_MEMORY_SCALE = "0.15"
# Suspend: once the attempt after the GPU OOM wrote this checkpoint.
SUSPEND_AFTER = 16
# The gpu-oom job's checkpoint interval (everySteps).
CHECKPOINT_EVERY = 4
# The gpu-oom job's evaluation interval (spec.evaluation.everySteps) on its held-out eighth.
EVAL_EVERY = 8


@dataclass
class Run:
    name: str
    job: dict[str, Any]
    applied: float = 0.0
    finished: float | None = None
    status: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.applied


def _diagnose(lab, namespace: str, name: str) -> str:
    """What to read when a scenario fails: the job's status, its pods, the runner's and trainers' logs."""
    parts = [lab.kubectl("get", "ftj", name, "-n", namespace, "-o", "yaml", check=False).stdout[-3000:],
             lab.kubectl("get", "pods,pytorchjobs", "-n", namespace, "-o", "wide", check=False).stdout]
    runner = lab.log_dir / "pod-runner.log"
    if runner.exists():
        parts.append("pod-runner.log:\n" + runner.read_text()[-2000:])
    for d in rp.pod_dirs(lab, namespace, name):
        for f in sorted((d / "logs").glob("*.log")):
            parts.append(f"{d.name} {f.stem}:\n" + "\n".join(rp.log_lines(d, f.stem)[-15:]))
    return "\n".join(parts)


class Reader:
    """The polling loop's reads, through one API client: a kubectl per read costs about 60 ms of CPU,
    and the loop reads several times a second while the trainers need both cores."""

    def __init__(self, lab, namespace: str) -> None:
        from kubernetes import client

        api_client = lab.api_client()
        self.custom, self.core, self.namespace = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client), namespace

    def status(self, job: str) -> dict[str, Any]:
        body = self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, job)
        return body.get("status") or {}

    def current_attempt(self, job: str) -> int:
        return int(self.status(job).get("currentAttempt") or 0)

    def has_pods(self, job: str) -> bool:
        return bool(self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={job}").items)


def _progress_step(lab, namespace: str, job: str, attempt: int) -> int:
    steps = [int(e["step"]) for e in rp.attempt_events(lab, namespace, job, attempt, "progress")]
    return max(steps, default=0)


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    h.install_chart(lab, *rp.chart_args())
    # Progress every 2 s (20 by default): the tiny runs take about a minute, and the gpu-oom
    # scenario watches its eval loss move in status as `kubectl get ftj -w` would.
    with h.running_operator(lab, tmp_path_factory.mktemp("operator-real"), ("--progress-interval", "2")) as process:
        yield process
    h.install_chart(lab)  # the chart's own policy again (without lab-local), for the modules after this one


@pytest.fixture(scope="module")
def runs(lab, operator, request):
    """Apply the three jobs at once, intervene (a worker pod deleted, a suspend and resume), wait
    for all to end; yield (namespace, {name: Run}).

    two-pod:  2 pods; the worker pod is deleted once checkpoint 4 exists; attempt 2 (2 pods) resumes.
    gpu-oom:  sized as an 8B (so the lab GPU's rule, predicted x rp.OOM_FACTOR > 80 GiB, makes attempt 1 run
              out of GPU memory at step OOM_STEP in the real trainer); attempt 2 (another plan)
              resumes; it is suspended once it wrote checkpoint SUSPEND_AFTER and resumed: the
              last attempt continues from the newest checkpoint.
    host-oom: its cgroup gets HOST_MEMORY_SCALE of the pod's memory limit: the kernel kills it until
              the operator has raised the pod memory enough.
    """
    from kubernetes import client

    from e2e.lab.waiting import wait_for

    namespace = f"real-processes-{int(time.time()) % 100000}"
    core = client.CoreV1Api(lab.api_client())
    core.create_namespace({"metadata": {"name": namespace, "labels": {"finetune.dev/e2e": "true"}}})
    wait_for(lambda: core.read_namespaced_service_account("default", namespace), 30, "the default ServiceAccount")
    vocab = rp.write_assets(namespace)
    jobs = {
        "two-pod": rp.tiny_job("two-pod", namespace, vocab, gpus=2, max_steps=24, every_steps=4),
        "gpu-oom": rp.tiny_job("gpu-oom", namespace, vocab, max_steps=40, every_steps=CHECKPOINT_EVERY, global_batch=8,
                               sized_as="llama-3.1-8b", sequence_length=4096,
                               rule={"true-peak-factor": rp.OOM_FACTOR, "oom-step": str(OOM_STEP)},
                               evaluation={"heldOutFraction": 0.125, "everySteps": EVAL_EVERY}, export="merged"),
        "host-oom": rp.tiny_job("host-oom", namespace, vocab, max_steps=8, every_steps=4,
                                rule={"host-memory-scale": HOST_MEMORY_SCALE}),
    }
    result = {name: Run(name, job) for name, job in jobs.items()}
    h.volumes(lab, namespace, ["models", "data", "checkpoints"])
    reader = Reader(lab, namespace)
    for run in result.values():
        run.applied = time.monotonic()
        lab.kubectl("apply", "-f", "-", input=json.dumps(run.job))
    deadline = time.monotonic() + 600
    try:
        while any(r.finished is None for r in result.values()):
            if time.monotonic() > deadline:
                late = [r.name for r in result.values() if r.finished is None]
                raise AssertionError(f"jobs {late} did not end in time\n" + "\n".join(_diagnose(lab, namespace, n) for n in late))
            _intervene(lab, namespace, reader, result)
            for run in result.values():
                if run.finished is None:
                    status = reader.status(run.name)
                    seen = (status.get("progress") or {}).get("evalStep"), (status.get("progress") or {}).get("evalLoss")
                    evals = run.notes.setdefault("evals", [])
                    if seen[1] is not None and (not evals or evals[-1] != seen):
                        evals.append(seen)  # what `kubectl get ftj -w` showed in EVAL LOSS
                    if status.get("phase") in ("Succeeded", "Failed"):
                        run.finished, run.status = time.monotonic(), status
                        print(f"scenario real {run.name}: {run.seconds:.1f}s "
                              f"({len(status.get('attempts') or [])} attempts, {status['phase']})")
            time.sleep(0.5)
        for run in result.values():
            run.notes["diagnosis"] = lambda n=run.name: _diagnose(lab, namespace, n)
        yield namespace, result
    finally:
        try:
            core.delete_namespace(namespace)
        except Exception:  # noqa: BLE001 - best effort
            pass
        rp.remove_claims(namespace)


def _intervene(lab, namespace: str, reader: Reader, runs: dict[str, Run]) -> None:
    # A worker pod deleted mid-run (a drain, a person), once attempt 1 wrote its first checkpoint.
    two = runs["two-pod"]
    if "deleted" not in two.notes and 4 in rp.checkpoint_steps(namespace, "two-pod") \
            and _progress_step(lab, namespace, "two-pod", 1) >= 5:
        two.notes["deleted"] = _progress_step(lab, namespace, "two-pod", 1)
        lab.kubectl("delete", "pod", "two-pod-a1-worker-0", "-n", namespace, "--wait=false")
    # Suspended once the attempt after the GPU OOM wrote a checkpoint of its own; resumed when the
    # operator has stopped that attempt.
    oom = runs["gpu-oom"]
    if "suspended" not in oom.notes and reader.current_attempt("gpu-oom") >= 2 \
            and SUSPEND_AFTER in rp.checkpoint_steps(namespace, "gpu-oom"):
        oom.notes["suspended"] = reader.current_attempt("gpu-oom")
        lab.kubectl("patch", "ftj", "gpu-oom", "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    elif "suspended" in oom.notes and "resumed" not in oom.notes:
        status = reader.status("gpu-oom")
        # The operator suspends the attempt's PyTorchJob (its pods are deleted, it is kept).
        if status.get("phase") == "Suspended" and not reader.has_pods("gpu-oom"):
            oom.notes["checkpoints at suspension"] = rp.checkpoint_steps(namespace, "gpu-oom")
            oom.notes["resumed"] = True
            lab.kubectl("patch", "ftj", "gpu-oom", "-n", namespace, "--type=merge", "-p", '{"spec": {"suspend": false}}')


def _succeeded(run: Run) -> dict[str, Any]:
    assert run.status.get("phase") == "Succeeded", run.notes["diagnosis"]()
    return run.status


def _summary(lab, namespace: str, job: str, attempt: int) -> dict[str, Any]:
    summary = rp.attempt_events(lab, namespace, job, attempt, "summary")
    assert summary and summary[-1]["status"] == "completed", summary
    return summary[-1]


def test_two_pod_lora_job_succeeds_with_the_adapter_in_the_claim(lab, runs):
    namespace, all_runs = runs
    status = _succeeded(all_runs["two-pod"])
    last = len(status["attempts"])
    plan = status["attempts"][-1]["plan"]
    assert plan["gpus"] == 2 and plan["nodes"] == 2 and plan["nodePool"] == rp.POOL
    # The trainer ran with a world of two (torchrun's rendezvous across the two pods) ...
    start = rp.attempt_events(lab, namespace, "two-pod", last, "start")
    assert start and start[0]["worldSize"] == 2, start
    worker = [e for d in rp.pod_dirs(lab, namespace, f"two-pod-a{last}-worker-0_") for e in rp.events(rp.log_lines(d), "start")]
    assert worker and worker[0]["rank"] == 1 and worker[0]["worldSize"] == 2
    # ... trained to the last step and says so ...
    assert _summary(lab, namespace, "two-pod", last)["step"] == 24
    losses = rp.losses(rp.attempt_events(lab, namespace, "two-pod", last, "progress"))
    assert max(losses) == 24, losses
    # ... and wrote the LoRA adapter into the output claim.
    final = rp.claim_dir(namespace, "checkpoints") / "two-pod" / "final"
    assert (final / "adapter_config.json").is_file() and list(final.glob("adapter_model.*")), list(final.iterdir())
    # pods/log through the API server (kwok serves the runner's log files), while the pod exists.
    logs = lab.kubectl("logs", f"two-pod-a{last}-master-0", "-n", namespace, check=False)
    if logs.returncode == 0:
        assert '"event": "summary"' in logs.stdout


def test_a_worker_pod_deleted_mid_run_and_the_job_still_finishes(lab, runs):
    namespace, all_runs = runs
    run = all_runs["two-pod"]
    status = _succeeded(run)
    assert "deleted" in run.notes, "the worker pod was never deleted (the job ended first)"
    outcomes = [a["outcome"] for a in status["attempts"]]
    assert outcomes[0] == "Evicted" and outcomes[-1] == "Succeeded", outcomes
    # The deleted pod's trainer got SIGTERM from the runner and stopped; the next attempt resumed
    # from a checkpoint attempt 1 wrote, in two pods again, and finished.
    saved = [e["step"] for e in rp.attempt_events(lab, namespace, "two-pod", 1, "checkpoint")]
    start = rp.attempt_events(lab, namespace, "two-pod", len(outcomes), "start")[0]
    assert saved and start["startStep"] == max(saved) and start["worldSize"] == 2, (saved, start)
    losses = rp.losses(rp.attempt_events(lab, namespace, "two-pod", len(outcomes), "progress"))
    assert min(losses) == max(saved) + 1, losses


def test_gpu_oom_in_the_real_trainer_then_a_changed_plan_resumes_from_its_checkpoint(lab, runs):
    namespace, all_runs = runs
    status = _succeeded(all_runs["gpu-oom"])
    first, second = status["attempts"][0], status["attempts"][1]
    assert first["outcome"] == "GPUOutOfMemory" and status["attempts"][-1]["outcome"] == "Succeeded"
    # The operator saw the real trainer's report: exit 75 at the step the OOM hit.
    failed = first["failedPods"][0]
    assert failed["exitCode"] == 75 and failed["step"] == OOM_STEP and failed["source"] == "report", failed
    failure = rp.attempt_events(lab, namespace, "gpu-oom", 1, "failure")
    assert failure and failure[0]["reason"] == "GPUOutOfMemory" and failure[0]["step"] == OOM_STEP, failure
    assert "finetune lab GPU" in failure[0]["message"] and failure[0]["exitCode"] == 75, failure
    # Attempt 2 runs another plan, resumes from attempt 1's last checkpoint, and its loss continues.
    assert first["plan"] != second["plan"], (first["plan"], second["plan"])
    last_checkpoint = (OOM_STEP - 1) // 4 * 4
    start2 = rp.attempt_events(lab, namespace, "gpu-oom", 2, "start")[0]
    assert start2["startStep"] == last_checkpoint and start2["resumeFrom"].endswith(f"step-{last_checkpoint:08d}")
    loss1 = rp.losses(rp.attempt_events(lab, namespace, "gpu-oom", 1, "progress"))
    loss2 = rp.losses(rp.attempt_events(lab, namespace, "gpu-oom", 2, "progress"))
    assert max(loss1) == OOM_STEP - 1 and min(loss2) == last_checkpoint + 1, (loss1, loss2)
    redone = last_checkpoint + 1
    # The same step on the same data from the same weights and optimizer state: the same loss.
    # Runs are seeded, so it matches to the last digits here; another micro-batch may change
    # those elsewhere. Adapters started afresh at the resume gave 2% more on that step (3.66
    # against 3.58).
    assert abs(loss2[redone] - loss1[redone]) <= 0.01 * loss1[redone], (loss1, loss2)
    # And the run goes on learning: its last loss is well below where attempt 1 started.
    assert loss2[max(loss2)] < 0.9 * loss1[1], (loss1, loss2)
    # The provenance record lists both attempts with the nodes they ran on, and what the trainer
    # hashed (its file beside the output) is what status says.
    assert first["nodes"] and status["attempts"][-1]["nodes"], status["attempts"]
    assert first["runningSince"] and first["endTime"], first
    summary = status["provenance"]
    assert summary["attempts"] == len(status["attempts"]) and summary["gpuHours"] > 0, summary
    trainer_record = json.loads((rp.claim_dir(namespace, "checkpoints") / "gpu-oom" / "final" / "provenance"
                                 / f"attempt-{len(status['attempts'])}.json").read_text())
    assert trainer_record["summary"]["datasetSha256"] == summary["datasetSha256"], (trainer_record, summary)
    assert trainer_record["summary"]["records"] == summary["records"] > 0
    # Evaluation on the held-out eighth: the eval loss moved in status while it trained, every
    # attempt held out the same sequences, and the final figure is the record's.
    evals = all_runs["gpu-oom"].notes["evals"]
    assert len(evals) >= 2 and len({loss for _, loss in evals}) >= 2, evals
    assert all(step % EVAL_EVERY == 0 or step == 40 for step, _ in evals), evals
    starts = [rp.attempt_events(lab, namespace, "gpu-oom", n, "start")[0] for n in (1, 2)]
    assert starts[0]["heldOut"] == 8 and starts[0]["heldOutSha256"] == starts[1]["heldOutSha256"], starts
    assert status["progress"]["evalStep"] == 40 and status["progress"]["evalLoss"] == summary["evalLoss"], status
    assert summary["heldOut"] == 8 and trainer_record["summary"]["evalLoss"] == summary["evalLoss"]
    # export: merged. The merged folder beside the adapter loads with transformers as is and gives the
    # logits of the base model with the adapter (peft), on the same input.
    final = rp.claim_dir(namespace, "checkpoints") / "gpu-oom" / "final"
    merged = final / "merged"
    assert {"config.json", "model.safetensors.index.json", "generation_config.json"} <= {p.name for p in merged.iterdir()}
    assert any(p.name.startswith("tokenizer") for p in merged.iterdir()), sorted(p.name for p in merged.iterdir())
    assert summary["export"] == "pvc://checkpoints/gpu-oom/final/merged" and summary["exportBytes"] > 0, summary
    rp.merged_logits_match(rp.claim_dir(namespace, "models") / "tiny-llama", final, merged)


def test_suspend_and_resume_continue_from_the_real_checkpoint(lab, runs):
    namespace, all_runs = runs
    run = all_runs["gpu-oom"]
    status = _succeeded(run)
    assert run.notes.get("resumed"), f"never suspended and resumed (the attempt ended first?): {run.notes}"
    assert status["attempts"][-1]["outcome"] == "Succeeded", [a["outcome"] for a in status["attempts"]]
    saved = run.notes["checkpoints at suspension"]
    assert SUSPEND_AFTER in saved, saved
    master_runs = rp.master_runs(lab, namespace, "gpu-oom")
    (suspended_attempt, suspended), (_, resumed) = master_runs[-2], master_runs[-1]
    # The suspended run wrote its checkpoints and was stopped before the end (no summary) ...
    assert suspended_attempt == run.notes["suspended"]
    # The stop can land between a checkpoint's rename into place and its log line (the trainer
    # publishes, prunes to the newest keepLast (default 2), then logs): every logged checkpoint not
    # older than the oldest on disk is on disk, and the disk may hold one more, never more than one
    # save interval further.
    logged = [e["step"] for e in rp.events_of(suspended, "checkpoint")]
    assert max(logged) >= SUSPEND_AFTER, (logged, saved)
    assert {s for s in logged if s >= min(saved)} <= set(saved), (logged, saved)
    assert max(saved) - max(logged) in (0, CHECKPOINT_EVERY), (logged, saved)
    assert not rp.events_of(suspended, "summary")
    # ... the run after the resume starts from the newest of them and trains to the end.
    start = rp.events_of(resumed, "start")[0]
    assert start["startStep"] == max(saved), (saved, start)
    resume = rp.events_of(resumed, "resume")
    assert resume and resume[0]["step"] == max(saved)
    losses = rp.losses(rp.events_of(resumed, "progress"))
    assert min(losses) == max(saved) + 1 and max(losses) == 40, losses
    summary = rp.events_of(resumed, "summary")
    assert summary and summary[-1]["status"] == "completed" and summary[-1]["step"] == 40, summary
    assert (rp.claim_dir(namespace, "checkpoints") / "gpu-oom" / "final" / "adapter_config.json").is_file()


def test_a_real_cgroup_oom_kill_then_the_pod_memory_is_raised(lab, runs):
    namespace, all_runs = runs
    status = _succeeded(all_runs["host-oom"])
    attempts = status["attempts"]
    outcomes = [a["outcome"] for a in attempts]
    assert outcomes[0] == "HostOutOfMemory" and outcomes[-1] == "Succeeded", outcomes
    assert set(outcomes[:-1]) == {"HostOutOfMemory"}, outcomes
    # The kernel killed a trainer process in the pod's cgroup: the launcher's verdict (exit 71) and
    # the container's reason OOMKilled, as a kubelet reports it.
    failed = attempts[0]["failedPods"][0]
    assert failed["kind"] == "HostOutOfMemory" and failed["exitCode"] == 71, failed
    runner_log = (lab.log_dir / "pod-runner.log").read_text()
    assert "host-oom-a1-master-0 Failed: pytorch exit 71 OOMKilled" in runner_log
    failure = rp.attempt_events(lab, namespace, "host-oom", 1, "failure")
    assert failure and failure[-1]["reason"] == "HostOutOfMemory" and "oom_kill" in failure[-1]["message"], failure
    # Each retry had more pod memory, and the last one trained to the end.
    memory = [float(a["plan"]["hostMemory"].removesuffix("Gi")) for a in attempts]
    assert memory == sorted(memory) and len(set(memory)) == len(memory), memory
    assert _summary(lab, namespace, "host-oom", len(attempts))["step"] == 8
