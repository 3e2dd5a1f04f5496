"""A waiting attempt moves (issue 17 item 2), on the lab.

Berlin's GPU nodes carry Karpenter's `karpenter.sh/disrupted:NoSchedule` taint, which discovery
treats as passing (a node being replaced comes back), so the planner still sees Berlin's free GPUs
and places a two-region job there; the scheduler keeps its pods unschedulable. With the policy's
unschedulableTimeoutSeconds lowered to a few seconds, the attempt moves to Paris, the pool with
room inside the allowed regions: attempt 1 ends Unschedulable (status and a Warning Event say why
and where to), attempt 2 runs on Paris's nodes. A job whose child a queue owns (spec.queueName, as
Kueue's jobs) is only reported: its attempt stays, with the reason in its Running condition.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml

from e2e import operator_harness as h
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e

BOUND_S = 10  # the policy allows 10 s at least
TAINT = "karpenter.sh/disrupted"


POLICY_CM = f"{h.RELEASE}-finetune-operator-policy"


def _set_policy(lab, text: str) -> None:
    lab.kubectl("patch", "configmap", POLICY_CM, "-n", h.RELEASE_NAMESPACE, "--type", "merge",
                "-p", json.dumps({"data": {"policy.yaml": text}}))


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    h.install_chart(lab)
    # The chart's policy with the bound lowered (the ConfigMap the chart renders; a patch, not a helm
    # upgrade, so that putting it back costs nothing), read by the operator at its start.
    original = json.loads(lab.kubectl("get", "configmap", POLICY_CM, "-n", h.RELEASE_NAMESPACE, "-o", "json").stdout
                          )["data"]["policy.yaml"]
    policy = yaml.safe_load(original)
    policy["unschedulableTimeoutSeconds"] = BOUND_S
    _set_policy(lab, yaml.safe_dump(policy))
    with h.running_operator(lab, tmp_path_factory.mktemp("operator-replan")) as process:
        yield process
    _set_policy(lab, original)  # the chart's own policy again, for the modules after this one
    print(f"operator log: {process.log_path}")


@pytest.fixture
def berlin_disrupted(lab):
    nodes = [n["metadata"]["name"] for n in json.loads(lab.kubectl(
        "get", "nodes", "-l", "topology.kubernetes.io/region=eu-de-berlin,nvidia.com/gpu.product", "-o", "json").stdout)["items"]]
    assert nodes, "the lab has no Berlin GPU nodes"
    for node in nodes:
        lab.kubectl("taint", "nodes", node, f"{TAINT}=true:NoSchedule", "--overwrite")
    yield nodes
    for node in nodes:
        lab.kubectl("taint", "nodes", node, f"{TAINT}-", check=False)


def _job(namespace: str, name: str, **spec) -> dict:
    job = h.job_from_example("llama-8b-lora.yaml", name, namespace, rule={"true-peak-factor": "1.0", "run-duration": "3s"},
                             placement={"regions": ["eu-de-berlin", "eu-fr-paris"]}, **spec)
    job["spec"]["resources"]["gpuTypes"] = ["H100-80GB", "A100-40GB"]
    job["spec"]["recovery"] = {"maxAttempts": 3, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    return job


def test_a_waiting_attempt_moves_to_a_pool_with_room_and_a_queued_one_is_only_reported(
        lab, operator, namespace, berlin_disrupted):
    start = time.monotonic()
    moved, queued = _job(namespace, "moved"), _job(namespace, "queued", queueName="team-queue")
    h.volumes(lab, namespace, h.claims_of(moved))
    lab.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [moved, queued]}))

    # The queued job's child is created suspended; admit it as Kueue would (un-suspend it).
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "queued"), 30, "the queued job's PyTorchJob", interval=0.3)
    lab.kubectl("patch", "pytorchjob", "queued-a1", "-n", namespace, "--type", "merge",
                "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}))

    # Both are planned on Berlin (its GPUs look free) and their pods find no node there.
    seen_waiting: dict[str, float] = {}
    for name in ("moved", "queued"):
        job = wait_for(lambda: (j := h.get_job(lab, namespace, name)) and (h.condition(j, "Running") or {}).get(
            "reason") == "Unschedulable" and j, 30, f"{name}: Running=False Unschedulable", interval=0.3)
        assert job["status"]["plan"]["nodePool"] == "h100-berlin", job["status"]["plan"]
        seen_waiting[name] = time.monotonic()

    # Past the bound the first moves to Paris, the pool with room inside the allowed regions.
    job = wait_for(lambda: (j := h.get_job(lab, namespace, "moved")) and j["status"].get("currentAttempt") == 2 and j,
                   BOUND_S + 20, "the attempt to move", interval=0.3)
    status = job["status"]
    assert status["plan"]["nodePool"] == "a100-paris" and status["plan"]["region"] == "eu-fr-paris"
    first = status["attempts"][0]
    assert first["outcome"] == "Unschedulable" and "h100-berlin" in first["message"], first
    # Events are posted after the status and the new attempt's objects.
    warnings = wait_for(lambda: [e for e in h.events(lab, namespace, "moved") if e["reason"] == "Unschedulable"],
                        10, "the Unschedulable event", interval=0.3)
    assert warnings[-1]["type"] == "Warning" and "moving to a100-paris" in warnings[-1]["message"], warnings
    names = [p["metadata"]["name"] for p in h.pytorch_jobs(lab, namespace, "moved")]
    assert "moved-a2" in names
    pods = wait_for(lambda: [p for p in h.pods(lab, namespace, "moved")
                             if p["metadata"]["labels"].get("finetune.dev/attempt") == "2" and p["spec"].get("nodeName")],
                    20, "attempt 2's pods bound to a node", interval=0.3)
    nodes = {n["metadata"]["name"]: n for n in json.loads(lab.kubectl("get", "nodes", "-o", "json").stdout)["items"]}
    assert all(nodes[p["spec"]["nodeName"]]["metadata"]["labels"]["topology.kubernetes.io/region"] == "eu-fr-paris"
               for p in pods)

    # The queued job's placement belongs to its queue: reported, never moved, also past the bound.
    time.sleep(max(0.0, seen_waiting["queued"] + BOUND_S + 2 - time.monotonic()))
    job = h.get_job(lab, namespace, "queued")
    running = h.condition(job, "Running")
    assert job["status"]["currentAttempt"] == 1 and running["reason"] == "Unschedulable", job["status"]
    assert [p["metadata"]["name"] for p in h.pytorch_jobs(lab, namespace, "queued")] == ["queued-a1"]
    print(f"re-plan scenario: {time.monotonic() - start:.1f} s")
