"""Scenarios on real processes (issue 15): the operator, the training operator and the trainer meet.

The lab's process runner (e2e/lab/podrunner.py) runs every pod of the `cpu-run-local` pool as
the real trainer on this machine's CPUs (gloo, one process per pod) with the pod's own command,
environment, volumes and memory limit; the operator plans there because this module's chart
values allow region lab-local. Each scenario asserts on the trainer's own output (its log lines:
steps, losses, resume step, failure report; the checkpoints and the adapter in the claim), not
only on phases. Times per scenario are printed (pytest -s) and listed in e2e/README.md.
"""

from __future__ import annotations

import json
import time

import pytest

from e2e import operator_harness as h
from e2e import real_processes as rp
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    h.install_chart(lab, *rp.chart_args())
    process = h.OperatorProcess(lab, tmp_path_factory.mktemp("operator-real"))
    process.start()
    yield process
    process.stop()
    print(f"operator log: {process.log_path}")


@pytest.fixture
def assets(namespace):
    vocab = rp.write_assets(namespace)
    yield vocab
    rp.remove_claims(namespace)


def _apply(lab, job: dict) -> None:
    h.apply_job(lab, job)


def _diagnose(lab, namespace: str, name: str) -> str:
    """What to read when a scenario fails: the job's status, its pods, the runner's and trainers' logs."""
    parts = [lab.kubectl("get", "ftj", name, "-n", namespace, "-o", "yaml", check=False).stdout[-4000:],
             lab.kubectl("get", "pods,pytorchjobs", "-n", namespace, "-o", "wide", check=False).stdout]
    runner = lab.log_dir / "pod-runner.log"
    if runner.exists():
        parts.append("pod-runner.log:\n" + runner.read_text()[-3000:])
    for d in rp.pod_dirs(lab, namespace, name):
        for f in sorted((d / "logs").glob("*.log")):
            parts.append(f"{d.name} {f.stem}:\n" + "\n".join(rp.log_lines(d, f.stem)[-25:]))
    return "\n".join(parts)


def _wait_done(lab, namespace: str, name: str, timeout: float = 150) -> dict:
    try:
        return h.wait_phase(lab, namespace, name, ("Succeeded", "Failed"), timeout=timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{_diagnose(lab, namespace, name)}") from None


def test_two_pod_lora_job_succeeds_with_the_adapter_in_the_claim(lab, operator, namespace, assets):
    start = time.monotonic()
    job = rp.tiny_job("two-pod", namespace, assets, gpus=2, max_steps=16, every_steps=8)
    _apply(lab, job)
    done = _wait_done(lab, namespace, "two-pod")
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert [a["outcome"] for a in status["attempts"]] == ["Succeeded"]
    plan = status["attempts"][0]["plan"]
    assert plan["gpus"] == 2 and plan["nodePool"] == rp.POOL
    # The trainer ran with a world of two (torchrun rendezvous across the two pods) ...
    start_events = rp.attempt_events(lab, namespace, "two-pod", 1, "start")
    assert start_events and start_events[0]["worldSize"] == 2, start_events
    worker_start = [e for d in rp.pod_dirs(lab, namespace, "two-pod-a1-worker-0_")
                    for e in rp.events(rp.log_lines(d), "start")]
    assert worker_start and worker_start[0]["rank"] == 1
    # ... trained every step and says so ...
    summary = rp.attempt_events(lab, namespace, "two-pod", 1, "summary")
    assert summary and summary[-1]["status"] == "completed" and summary[-1]["step"] == 16, summary
    progress = rp.losses(rp.attempt_events(lab, namespace, "two-pod", 1, "progress"))
    assert sorted(progress)[-1] == 16 and len(progress) >= 8, progress
    # ... wrote the checkpoint at step 8 and the LoRA adapter into the output claim.
    assert rp.checkpoint_steps(namespace, "two-pod") == [8]
    final = rp.claim_dir(namespace, "checkpoints") / "two-pod" / "final"
    assert (final / "adapter_config.json").is_file() and list(final.glob("adapter_model.*")), list(final.iterdir())
    # pods/log through the API server (kwok serves the runner's log files).
    logs = lab.kubectl("logs", "two-pod-a1-master-0", "-n", namespace, check=False)
    if logs.returncode == 0:  # the training operator may have cleaned the pod up already
        assert '"event": "summary"' in logs.stdout
    print(f"scenario real two-pod LoRA: {h.elapsed(start)}")
