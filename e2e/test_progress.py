"""Training progress in status on the lab (issue 15 part 4): the operator, running as the chart's
ServiceAccount (so the chart's pods/log rule is exercised), reads the trainer's progress lines from the
rank-0 pod's log through the real API server, which asks kwok for it; kwok serves the log from a
CRI-format file named in a kwok `Logs` object. The lines are
the trainer's own format (contract.ProgressReport.to_log_line). `kubectl get ftj` shows PROGRESS."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from finetune_trainer.contract import ProgressReport

from e2e import operator_harness as h
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e

KWOK_GROUP, KWOK_VERSION, KWOK_LOGS = "kwok.x-k8s.io", "v1alpha1", "logs"


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    # Reads each job's log every 2 s here (20 s by default). When an operator of an earlier module
    # still holds the Lease, that one serves this module's job at its own interval: the waits allow it.
    h.install_chart(lab)
    with h.running_operator(lab, tmp_path_factory.mktemp("operator-progress"), ("--progress-interval", "2")) as process:
        yield process


def _cri(line: str) -> str:
    """One line as a container runtime writes it (what kwok's log reader expects)."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return f"{stamp} stdout F {line}\n"


def _report(step: int, started: float, eval_loss: float | None = None) -> str:
    now = time.time()
    return ProgressReport(time=now, attempt=1, step=step, max_steps=40, start_step=0, elapsed_seconds=now - started,
                          loss=round(2.0 - step / 40, 4), tokens_per_second=1234.5, eval_loss=eval_loss,
                          eval_step=step if eval_loss is not None else None).to_log_line()


def _progress(lab, namespace: str, name: str) -> dict:
    return (h.get_job(lab, namespace, name).get("status") or {}).get("progress") or {}


def test_progress_moves_in_status_and_kubectl_get(lab, operator, namespace, tmp_path: Path):
    start = time.monotonic()
    job = h.job_from_example("llama-8b-lora.yaml", "progress", namespace,
                             rule={"true-peak-factor": "1.0", "run-duration": "300s"})
    h.apply_job(lab, job)
    h.wait_phase(lab, namespace, "progress", ("Running",), timeout=90)
    master = wait_for(lambda: next((p for p in h.pods(lab, namespace, "progress")
                                    if p["metadata"]["labels"].get("training.kubeflow.org/replica-type") == "master"
                                    and p["status"].get("phase") == "Running"), None), 60, "the master pod Running")
    pod = master["metadata"]["name"]
    # The trainer's log: a line of noise, a progress line, a line cut short.
    log = tmp_path / "pytorch.log"
    trainer_started = time.time() - 20
    log.write_text(_cri('{"event": "start", "rank": 0}') + _cri(_report(10, trainer_started))
                   + _cri('{"event": "progress", "step": 1'))
    logs = {"apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}", "kind": "Logs",
            "metadata": {"name": pod, "namespace": namespace},
            "spec": {"logs": [{"containers": ["pytorch"], "logsFile": str(log)}]}}
    lab.kubectl("apply", "-f", "-", input=json.dumps(logs))
    # The API server serves it (pods/log through kwok), as the operator will read it.
    served = wait_for(lambda: "progress" in lab.kubectl("logs", pod, "-n", namespace, "-c", "pytorch",
                                                       check=False).stdout, 30, "pods/log served by kwok")
    assert served

    first = wait_for(lambda: _progress(lab, namespace, "progress").get("step") == 10
                     and _progress(lab, namespace, "progress"), 45, "status.progress at step 10")
    assert first["summary"] == "10/40 (25%)" and first["attempt"] == 1 and first["totalSteps"] == 40
    assert first["tokensPerSecond"] == 1234.5 and first["loss"] == 1.75
    assert first["eta"], first  # the line says the attempt ran 10 steps in ~20 s: a rate already
    table = lab.kubectl("get", "ftj", "progress", "-n", namespace).stdout.splitlines()
    assert "PROGRESS" in table[0].split() and "10/40 (25%)" in table[1], table

    # The trainer goes on: the next read sees it.
    with log.open("a") as handle:
        handle.write(_cri(_report(20, trainer_started, eval_loss=1.625)))
    second = wait_for(lambda: _progress(lab, namespace, "progress").get("step") == 20
                      and _progress(lab, namespace, "progress"), 45, "status.progress at step 20")
    assert second["summary"] == "20/40 (50%)" and second["loss"] == 1.5 and second["eta"]
    table = lab.kubectl("get", "ftj", "progress", "-n", namespace).stdout.splitlines()
    assert "20/40 (50%)" in table[1], table
    wide = lab.kubectl("get", "ftj", "progress", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert "LOSS" in wide[0] and "ETA" in wide[0] and "1.5" in wide[1] and second["eta"] in wide[1], wide
    # The held-out loss (spec.evaluation) the trainer carries on its lines: EVAL LOSS in -o wide.
    assert second["evalLoss"] == 1.625 and second["evalStep"] == 20 and "EVAL LOSS" in wide[0] and "1.625" in wide[1], wide
    described = lab.kubectl("describe", "ftj", "progress", "-n", namespace).stdout
    assert "Progress:" in described and "20/40 (50%)" in described, described
    # Only progress changed: the job's other status fields are the reconciler's, untouched.
    status = h.get_job(lab, namespace, "progress")["status"]
    assert status["phase"] == "Running" and status["currentAttempt"] == 1
    print(f"scenario progress: {h.elapsed(start)}")
