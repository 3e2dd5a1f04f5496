"""The operator's scenarios on the lab cluster (issue 7): the whole lifecycle against a real
API server, scheduler, training operator and kwok nodes, with the fake GPU deciding each
training pod's fate. The operator runs as the Helm chart's ServiceAccount."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from finetune_operator import api

from e2e import operator_harness as h
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e

ALLOWED = {"eu-de-berlin", "eu-fr-paris"}


# Module-scoped: stopped when this module ends, so a later module's operator (with its own flags,
# e.g. test_progress.py's 2 s log reads) takes the Lease instead of this one serving its jobs.
@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    h.install_chart(lab)
    with h.running_operator(lab, tmp_path_factory.mktemp("operator")) as process:
        yield process


def _fast(job: dict, attempts: int = 4) -> dict:
    job["spec"]["recovery"] = {"maxAttempts": attempts, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    return job


def _nodes_by_name(lab) -> dict[str, dict]:
    return {n["metadata"]["name"]: n for n in json.loads(lab.kubectl("get", "nodes", "-o", "json").stdout)["items"]}


def test_apply_plan_run_succeed(lab, operator, namespace):
    start = time.monotonic()
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "happy", namespace, rule={"true-peak-factor": "1.0", "run-duration": "2s"}))
    h.apply_job(lab, job)
    planned = h.wait_phase(lab, namespace, "happy", ("Launching", "Running", "Succeeded"))
    assert h.condition(planned, "Planned")["status"] == "True"
    plan = planned["status"]["plan"]
    assert plan["region"] == "eu-de-berlin" and plan["reason"]
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/happy", "-n", namespace, "--timeout=120s", timeout=130)
    done = h.get_job(lab, namespace, "happy")
    assert done["status"]["phase"] == "Succeeded" and done["status"]["completionTime"]
    assert [a["outcome"] for a in done["status"]["attempts"]] == ["Succeeded"]
    # Every training pod landed on a node of an allowed region, chosen by the real scheduler.
    nodes = _nodes_by_name(lab)
    placed = [p["spec"]["nodeName"] for p in h.pods(lab, namespace, "happy") if p["spec"].get("nodeName")]
    assert placed, "no training pod was scheduled"
    assert {nodes[n]["metadata"]["labels"]["topology.kubernetes.io/region"] for n in placed} <= {"eu-de-berlin"}
    reasons = [e["reason"] for e in h.events(lab, namespace, "happy")]
    assert "Planned" in reasons and "Succeeded" in reasons
    printed = lab.kubectl("get", "ftj", "-n", namespace).stdout
    assert "Succeeded" in printed and "h100-berlin" in printed
    print(f"scenario happy path: {h.elapsed(start)}")


def test_gpu_oom_recovers_with_a_new_attempt(lab, operator, namespace):
    start = time.monotonic()
    # The true peak is 1.7 x our estimate: the first plan (no checkpointing) dies of a GPU OOM,
    # the recovered one fits.
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "oom-once", namespace,
                                   rule={"true-peak-factor": "1.7", "run-duration": "1s"}))
    h.apply_job(lab, job)
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/oom-once", "-n", namespace, "--timeout=180s", timeout=190)
    status = h.get_job(lab, namespace, "oom-once")["status"]
    outcomes = [a["outcome"] for a in status["attempts"]]
    assert outcomes[0] == "GPUOutOfMemory" and outcomes[-1] == "Succeeded", outcomes
    first, second = status["attempts"][0], status["attempts"][1]
    assert "GPU OOM in backward at step 0" in first["message"]
    assert "next:" in first["message"]
    assert first["plan"] != second["plan"]
    assert second["plan"]["calibration"] > 1.0
    for attempt in status["attempts"]:
        plan = attempt["plan"]
        assert plan["microBatchSize"] * plan["gradientAccumulation"] * plan["gpus"] == 64
        assert plan["region"] in ALLOWED
    recovering = h.condition(h.get_job(lab, namespace, "oom-once"), "Recovering")
    assert recovering is not None and "attempt 2" in recovering["message"]
    # The failed attempt's PyTorchJob is gone; exactly the successful one is left.
    names = [p["metadata"]["name"] for p in h.pytorch_jobs(lab, namespace, "oom-once")]
    assert names == [f"oom-once-a{len(outcomes)}"]
    # So is its NetworkPolicy; the last attempt's, accepted by the real API server, selects that
    # attempt's pods only and is owned by the job.
    policies = json.loads(lab.kubectl("get", "networkpolicies", "-n", namespace, "-o", "json").stdout)["items"]
    assert [p["metadata"]["name"] for p in policies] == names, policies
    [netpol] = policies
    assert netpol["metadata"]["ownerReferences"][0]["kind"] == "FineTuneJob"
    assert netpol["spec"]["podSelector"]["matchLabels"]["finetune.dev/attempt"] == str(len(outcomes))
    assert netpol["spec"]["policyTypes"] == ["Ingress", "Egress"]
    print(f"scenario GPU OOM recovery: {h.elapsed(start)}")


def test_repeated_ooms_fail_at_max_attempts(lab, operator, namespace):
    start = time.monotonic()
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "always-oom", namespace,
                                   rule={"outcome": "gpu-oom", "run-duration": "1s"}), attempts=2)
    h.apply_job(lab, job)
    failed = h.wait_phase(lab, namespace, "always-oom", ("Failed",), timeout=180)
    attempts = failed["status"]["attempts"]
    assert [a["outcome"] for a in attempts] == ["GPUOutOfMemory", "GPUOutOfMemory"]
    assert "all 2 attempts are used" in h.condition(failed, "Failed")["message"]
    print(f"scenario repeated OOM -> Failed: {h.elapsed(start)}")


def test_operator_killed_midway_makes_no_duplicates(lab, operator, namespace):
    start = time.monotonic()
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "restart", namespace,
                                   rule={"true-peak-factor": "1.0", "run-duration": "8s"}))
    h.apply_job(lab, job)
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "restart"), 60, "the first PyTorchJob")
    operator.kill()
    operator.start()
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/restart", "-n", namespace, "--timeout=120s", timeout=130)
    status = h.get_job(lab, namespace, "restart")["status"]
    assert [a["attempt"] for a in status["attempts"]] == [1]
    assert [p["metadata"]["name"] for p in h.pytorch_jobs(lab, namespace, "restart")] == ["restart-a1"]
    print(f"scenario operator killed mid-way: {h.elapsed(start)}")


def test_invalid_job_gets_an_invalid_condition(lab, operator, namespace):
    start = time.monotonic()
    lab.kubectl("create", "configmap", "not-json", "-n", namespace, "--from-literal=config.json={not json")
    job = h.job_from_example("llama-8b-lora.yaml", "no-config", namespace)
    job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "not-json"}}
    h.apply_job(lab, job)
    failed = h.wait_phase(lab, namespace, "no-config", ("Failed",), timeout=60)
    validated = h.condition(failed, "Validated")
    assert validated["status"] == "False" and validated["reason"] == "Invalid"
    assert "spec.model.architecture.configMapRef" in validated["message"]
    assert h.pytorch_jobs(lab, namespace, "no-config") == []
    print(f"scenario invalid job: {h.elapsed(start)}")


def test_a_configmap_that_arrives_later_is_waited_for(lab, operator, namespace):
    """GitOps tools apply in any order: the job waits for its architecture ConfigMap, then runs."""
    start = time.monotonic()
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "late-config", namespace, rule={"run-duration": "1s"}))
    job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "late-config"}}
    h.apply_job(lab, job)

    def waiting():
        current = h.get_job(lab, namespace, "late-config")
        validated = h.condition(current, "Validated") if current else None
        return current if validated and validated["reason"] == "WaitingForConfigMap" else None

    current = wait_for(waiting, 60, "Validated=Unknown WaitingForConfigMap")
    assert current["status"]["phase"] == "Pending" and "late-config" in h.condition(current, "Validated")["message"]
    assert h.pytorch_jobs(lab, namespace, "late-config") == []
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
    lab.kubectl("create", "configmap", "late-config", "-n", namespace, f"--from-literal=config.json={json.dumps(config)}")
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/late-config", "-n", namespace, "--timeout=120s", timeout=130)
    print(f"scenario ConfigMap arriving later: {h.elapsed(start)}")


def test_region_without_a_suitable_pool_stays_unplanned(lab, operator, namespace):
    start = time.monotonic()
    # Virginia has H100s, but the cluster policy does not allow it: nothing may land there.
    job = h.job_from_example("llama-8b-lora.yaml", "virginia", namespace, placement={"regions": ["us-east-virginia"]})
    h.apply_job(lab, job)

    def unplanned():
        current = h.get_job(lab, namespace, "virginia")
        planned = h.condition(current, "Planned")
        return current if planned and planned["status"] == "False" else None

    current = wait_for(unplanned, 60, "Planned=False on the virginia job")
    message = h.condition(current, "Planned")["message"]
    assert "us-east-virginia" in message
    assert current["status"]["phase"] == "Pending"
    assert h.pytorch_jobs(lab, namespace, "virginia") == []
    print(f"scenario region without a pool: {h.elapsed(start)}")


def test_configmap_architecture_is_read(lab, operator, namespace):
    start = time.monotonic()
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "tie_word_embeddings": True, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}
    lab.kubectl("create", "configmap", "llama-1b-config", "-n", namespace, f"--from-literal=config.json={json.dumps(config)}")
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "from-configmap", namespace, rule={"run-duration": "1s"}))
    job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "llama-1b-config"}}
    h.apply_job(lab, job)
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/from-configmap", "-n", namespace, "--timeout=120s", timeout=130)
    plan = h.get_job(lab, namespace, "from-configmap")["status"]["plan"]
    # bf16 weights of a 1.2B model (about 2.3 GiB), not those of the 8B preset (15 GiB).
    assert 2.0 < api.PlanStatus.model_validate(plan).breakdown["weights"] < 3.0, plan["breakdown"]
    print(f"scenario configMapRef architecture: {h.elapsed(start)}")


def test_suspend_and_resume(lab, operator, namespace):
    start = time.monotonic()
    job = _fast(h.job_from_example("llama-8b-lora.yaml", "pausable", namespace, rule={"run-duration": "4s"}))
    h.apply_job(lab, job)
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "pausable"), 60, "the PyTorchJob")
    lab.kubectl("patch", "ftj", "pausable", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    h.wait_phase(lab, namespace, "pausable", ("Suspended",), timeout=60)
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "pausable")[0]["spec"]["runPolicy"].get("suspend") is True,
             30, "runPolicy.suspend on the PyTorchJob")
    wait_for(lambda: not [p for p in h.pods(lab, namespace, "pausable") if not p["metadata"].get("deletionTimestamp")],
             60, "the suspended attempt's pods to go")
    lab.kubectl("patch", "ftj", "pausable", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/pausable", "-n", namespace, "--timeout=120s", timeout=130)
    reasons = [e["reason"] for e in h.events(lab, namespace, "pausable")]
    assert "Suspended" in reasons and "Resumed" in reasons
    assert len(h.get_job(lab, namespace, "pausable")["status"]["attempts"]) == 1
    print(f"scenario suspend and resume: {h.elapsed(start)}")


def test_spec_is_immutable_after_creation_except_suspend_recovery_resources(lab, operator, namespace):
    job = h.job_from_example("llama-8b-lora.yaml", "frozen", namespace, placement={"regions": ["eu-fr-paris"]})
    h.apply_job(lab, job)
    moved = lab.kubectl("patch", "ftj", "frozen", "-n", namespace, "--type=merge",
                        "-p", '{"spec":{"placement":{"regions":["eu-de-berlin"]}}}', check=False)
    assert moved.returncode != 0 and "placement is immutable" in moved.stderr
    lab.kubectl("patch", "ftj", "frozen", "-n", namespace, "--type=merge", "-p", '{"spec":{"recovery":{"maxAttempts":2}}}')


def _example_jobs() -> list[str]:
    return sorted(p.name for p in (h.REPO_ROOT / "examples").glob("*.yaml")
                  if any((d or {}).get("kind") == "FineTuneJob" for d in yaml.safe_load_all(p.read_text())))


@pytest.mark.parametrize("example", _example_jobs())
def test_every_example_is_planned_on_the_lab(lab, operator, namespace, example):
    """Each job a user copies from examples/ gets a plan on the lab's pools: its PyTorchJob is
    created, every replica pinned by required node affinity inside the regions both the job and
    the cluster policy allow."""
    doc = yaml.safe_load((h.REPO_ROOT / "examples" / example).read_text())
    name = doc["metadata"]["name"]
    h.apply_job(lab, h.job_from_example(example, name, namespace, rule={"run-duration": "2s"}))
    try:
        (child,) = wait_for(lambda: h.pytorch_jobs(lab, namespace, name), 90, f"the PyTorchJob of {example}")
    except TimeoutError:
        pytest.fail(f"{example} got no PyTorchJob on the lab: {h.get_job(lab, namespace, name).get('status')}")
    planned = h.condition(h.get_job(lab, namespace, name), "Planned")
    assert planned is not None and planned["status"] == "True", planned
    allowed = ALLOWED & set(doc["spec"]["placement"]["regions"])
    for replica, spec in child["spec"]["pytorchReplicaSpecs"].items():
        terms = spec["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        for term in terms:
            (region,) = [e for e in term["matchExpressions"] if e["key"] == "topology.kubernetes.io/region"]
            assert region["operator"] == "In" and set(region["values"]) <= allowed, (example, replica, region)


def test_metrics_are_served(lab, operator, namespace):
    text = operator.metrics()
    for name in ("finetune_jobs", "finetune_attempts_total", "finetune_reconcile_seconds"):
        assert name in text, name
