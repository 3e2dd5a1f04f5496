"""Smoke scenarios for the lab's optional components: Kubeflow Trainer v2 + JobSet, and Kueue.

One lab of this module's own, started with `up(components=("trainer-v2", "kueue"), pytorchjob=False)`:
a cluster with only TrainJob (no PyTorchJob CRD, no training operator), where

- the chart's ClusterTrainingRuntime (`trainJobRuntime.enabled=true`) and a TrainJob rendered by
  `render_trainjob` (admitted by Trainer's own webhooks) become a JobSet and pods that the real
  scheduler places on the kwok GPU nodes of the plan's region and GPU product; the fake GPU ends them
  and the TrainJob is Complete;
- with a ResourceFlavor per region, a ClusterQueue of 8 GPUs and a LocalQueue, two queued 8-GPU
  TrainJobs (created suspended, as rendered): Kueue admits the first (un-suspends it) and holds the
  second suspended until the first has finished, then admits it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from e2e.lab.waiting import wait_crd_established, wait_for

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests" / "rendering"))

pytestmark = pytest.mark.e2e

REGION_LABEL = "topology.kubernetes.io/region"
H100 = "NVIDIA-H100-80GB-HBM3"


def _required() -> bool:
    return os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def v2lab():
    from e2e.lab.build import find_installation, find_v2
    from e2e.lab.cluster import up

    if find_installation() is None or find_v2() is None:
        msg = "the lab's JobSet, Trainer v2 and Kueue are not built: run `e2e/lab/build.sh`"
        if _required():
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    t0 = time.monotonic()
    lab = up(die_with_parent=True, components=("trainer-v2", "kueue"), pytorchjob=False)
    print(f"\nlab with trainer-v2,kueue and no PyTorchJob up in {time.monotonic() - t0:.1f}s")
    try:
        yield lab
    finally:
        lab.down(keep_workdir=bool(os.environ.get("FINETUNE_LAB_KEEP")))


@pytest.fixture(scope="module")
def runtime(v2lab):
    """The chart's ClusterTrainingRuntime, rendered by the lab's helm and applied (Trainer's webhook validates it)."""
    from finetune_operator.rendering.trainjob import DEFAULT_RUNTIME

    out = subprocess.run(
        [v2lab.binary("helm"), "template", "finetune-operator", str(REPO / "charts" / "finetune-operator"),
         "--namespace", "finetune-system", "--set", "trainJobRuntime.enabled=true",
         "--show-only", "templates/trainjob-runtime.yaml"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    v2lab.kubectl("apply", "-f", "-", input=out)
    return DEFAULT_RUNTIME


@pytest.fixture
def ns(v2lab, request):
    from kubernetes import client

    name = f"tk-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(v2lab.api_client())
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), 30, f"ServiceAccount {name}/default")
    yield name
    v2lab.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _job(name: str, namespace: str, **spec):
    from finetune_operator import api

    document = {
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "architecture": {"preset": "llama-3.1-8b"},
                      "source": {"pvc": {"claimName": "models", "path": "llama"}}},
            "dataset": {"source": {"pvc": {"claimName": "data", "path": "train.jsonl"}}},
            "method": "lora", "lora": {"rank": 16},
            "training": {"sequenceLength": 2048, "globalBatchSize": 32, "maxSteps": 100},
            "placement": {"regions": ["eu-de-berlin"]},
            **spec,
        },
    }
    return api.parse_job(document)


def _create_attempt(lab, namespace: str, name: str, *, nodes: int, gpus: int, run_duration: str,
                    outcome: str = "succeed", **spec) -> dict:
    """Render attempt 1 of a FineTuneJob as ConfigMap + TrainJob (H100 Berlin) and create both."""
    from render_factories import plan_for, policy, pool

    from e2e.operator_harness import volumes
    from finetune_operator.rendering import render_config_map, render_trainjob

    job = _job(name, namespace, **spec)
    plan = plan_for(job, pool(taints=[]), nodes=nodes, gpus_per_node=gpus)
    lab_policy = policy()
    config_map, _ = render_config_map(job, plan, 1, lab_policy)
    train_job = render_trainjob(job, plan, 1, lab_policy)
    volumes(lab, namespace, ["models", "data"])
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "finetune-lab", "namespace": namespace},
        "data": {"outcome": outcome, "run-duration": run_duration}}))
    lab.kubectl("create", "-f", "-", input=yaml.safe_dump_all([config_map, train_job]))
    return train_job


def _get(lab, kind: str, namespace: str | None, name: str) -> dict:
    where = ("-n", namespace) if namespace else ()
    return yaml.safe_load(lab.kubectl("get", kind, name, *where, "-o", "yaml").stdout)


def _condition(obj: dict, ctype: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def _is_true(lab, kind: str, namespace: str | None, name: str, ctype: str) -> bool:
    cond = _condition(_get(lab, kind, namespace, name), ctype)
    return bool(cond and cond["status"] == "True")


def _pods(lab, namespace: str, jobset: str) -> list[dict]:
    out = lab.kubectl("get", "pods", "-n", namespace, "-l", f"jobset.sigs.k8s.io/jobset-name={jobset}", "-o", "yaml")
    return yaml.safe_load(out.stdout)["items"]


def _nodes(lab) -> dict[str, dict]:
    items = yaml.safe_load(lab.kubectl("get", "nodes", "-o", "yaml").stdout)["items"]
    return {n["metadata"]["name"]: n["metadata"]["labels"] for n in items}


def test_lab_has_trainjob_and_no_pytorchjob(v2lab):
    resources = v2lab.kubectl("api-resources", "-o", "name").stdout.split()
    assert "trainjobs.trainer.kubeflow.org" in resources
    assert "clustertrainingruntimes.trainer.kubeflow.org" in resources
    assert "jobsets.jobset.x-k8s.io" in resources
    assert "workloads.kueue.x-k8s.io" in resources
    assert "pytorchjobs.kubeflow.org" not in resources


def test_trainjob_becomes_a_jobset_and_pods_on_the_plans_gpu_nodes(v2lab, runtime, ns):
    t0 = time.monotonic()
    train_job = _create_attempt(v2lab, ns, "smoke", nodes=2, gpus=8, run_duration="3s")
    name = train_job["metadata"]["name"]
    jobset = wait_for(lambda: _get(v2lab, "jobset", ns, name), 60, f"JobSet {ns}/{name}")
    owner = jobset["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("TrainJob", name)

    def placed() -> list[dict]:
        pods = _pods(v2lab, ns, name)
        return pods if len(pods) == 2 and all(p["spec"].get("nodeName") for p in pods) else []

    pods = wait_for(placed, 90, f"2 pods of JobSet {name} scheduled")
    nodes = _nodes(v2lab)
    for p in pods:
        labels = nodes[p["spec"]["nodeName"]]
        assert labels[REGION_LABEL] == "eu-de-berlin" and labels["nvidia.com/gpu.product"] == H100, p["spec"]["nodeName"]
        assert p["metadata"]["labels"]["finetune.dev/job"] == "smoke"
        assert p["metadata"]["labels"]["finetune.dev/attempt"] == "1"
        assert "finetune.dev/predicted-peak-bytes" in p["metadata"]["annotations"]
        (container,) = p["spec"]["containers"]
        assert container["name"] == "node"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["command"] == train_job["spec"]["trainer"]["command"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"name": "config", "mountPath": "/etc/finetune", "readOnly": True} in container["volumeMounts"]
        assert p["spec"]["restartPolicy"] == "Never"
    wait_for(lambda: _is_true(v2lab, "trainjob", ns, name, "Complete"), 90, f"TrainJob {name} Complete")
    print(f"\nTrainJob -> JobSet -> 2 pods on H100 Berlin -> Complete in {time.monotonic() - t0:.1f}s")


def test_kueue_admits_one_8_gpu_trainjob_at_a_time(v2lab, runtime, ns):
    flavors = []
    for region in ("eu-de-berlin", "eu-fr-paris"):
        flavors.append({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
                        "metadata": {"name": f"{ns}-{region}"}, "spec": {"nodeLabels": {REGION_LABEL: region}}})
    # 8 GPUs in all (Berlin's flavor; Paris's has none), CPU and memory plentiful.
    quotas = {"eu-de-berlin": "8", "eu-fr-paris": "0"}
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": ns},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": f"{ns}-{region}", "resources": [
                {"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "100Ti"},
                {"name": "nvidia.com/gpu", "nominalQuota": quotas[region]}]} for region in quotas],
        }]},
    }
    local_queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                   "metadata": {"name": "gpus", "namespace": ns}, "spec": {"clusterQueue": ns}}
    v2lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([*flavors, cluster_queue, local_queue]))
    wait_for(lambda: _is_true(v2lab, "clusterqueue", None, ns, "Active"), 30, f"ClusterQueue {ns} Active")

    t0 = time.monotonic()
    first = _create_attempt(v2lab, ns, "first", nodes=1, gpus=8, run_duration="8s", queueName="gpus")["metadata"]["name"]
    wait_for(lambda: _get(v2lab, "trainjob", ns, first)["spec"]["suspend"] is False, 60, "Kueue admits the first TrainJob")
    admitted_first = time.monotonic() - t0
    second = _create_attempt(v2lab, ns, "second", nodes=1, gpus=8, run_duration="2s", queueName="gpus")["metadata"]["name"]

    # While the first runs, the second stays suspended: its Workload waits for quota.
    def second_workload() -> dict | None:
        items = yaml.safe_load(v2lab.kubectl("get", "workloads", "-n", ns, "-o", "yaml").stdout)["items"]
        return next((w for w in items if w["metadata"]["ownerReferences"][0]["name"] == second), None)

    workload = wait_for(second_workload, 30, "the second TrainJob's Workload")
    pending = wait_for(lambda: _condition(second_workload() or {}, "QuotaReserved"), 30, "the second Workload's QuotaReserved condition")
    assert pending["status"] == "False", pending
    assert workload["spec"]["podSets"][0]["count"] == 1
    while not _is_true(v2lab, "trainjob", ns, first, "Complete"):
        assert _get(v2lab, "trainjob", ns, second)["spec"]["suspend"] is True, "admitted while the first still holds the quota"
        assert time.monotonic() - t0 < 120, "the first TrainJob did not complete"
        time.sleep(0.5)
    first_done = time.monotonic() - t0
    wait_for(lambda: _get(v2lab, "trainjob", ns, second)["spec"]["suspend"] is False, 60,
             "Kueue admits the second TrainJob once the first has finished")
    admitted_second = time.monotonic() - t0
    # Admission put the pods in the flavor's region (our affinity already required it).
    pods = wait_for(lambda: [p for p in _pods(v2lab, ns, second) if p["spec"].get("nodeName")], 60, "second's pod scheduled")
    assert _nodes(v2lab)[pods[0]["spec"]["nodeName"]][REGION_LABEL] == "eu-de-berlin"
    wait_for(lambda: _is_true(v2lab, "trainjob", ns, second, "Complete"), 90, f"TrainJob {second} Complete")
    print(f"\nKueue: first admitted {admitted_first:.1f}s, first Complete {first_done:.1f}s,"
          f" second admitted {admitted_second:.1f}s, second Complete {time.monotonic() - t0:.1f}s")


def test_kueue_suspends_a_queued_trainjob_created_running_and_says_when_its_queue_is_missing(v2lab, runtime, ns):
    """Kueue's own webhook suspends a TrainJob that carries the queue label but was created running (the
    renderer creates it suspended anyway); with no such LocalQueue its Workload says so and it stays
    suspended."""
    from render_factories import plan_for, policy, pool

    from finetune_operator.rendering import render_trainjob

    job = _job("unqueued", ns, queueName="nowhere")
    train_job = render_trainjob(job, plan_for(job, pool(taints=[]), gpus_per_node=8), 1, policy())
    train_job["spec"]["suspend"] = False
    v2lab.kubectl("create", "-f", "-", input=yaml.safe_dump(train_job))
    name = train_job["metadata"]["name"]
    assert _get(v2lab, "trainjob", ns, name)["spec"]["suspend"] is True

    def workload_condition() -> dict | None:
        items = yaml.safe_load(v2lab.kubectl("get", "workloads", "-n", ns, "-o", "yaml").stdout)["items"]
        return next((_condition(w, "QuotaReserved") for w in items if _condition(w, "QuotaReserved")), None)

    cond = wait_for(workload_condition, 30, "the Workload's QuotaReserved condition")
    assert cond["status"] == "False" and "nowhere" in cond["message"], cond
    print(f"\nno such LocalQueue: Workload QuotaReserved=False reason={cond['reason']!r} message={cond['message']!r}")
    time.sleep(2)
    assert _get(v2lab, "trainjob", ns, name)["spec"]["suspend"] is True
    assert _pods(v2lab, ns, name) == []


def test_a_gpu_oom_fails_the_trainjob_and_its_pod_keeps_the_report(v2lab, runtime, ns):
    """What the operator's TrainJob backend will read: the TrainJob's Failed condition, and the
    failure report in the terminated pod of the JobSet (our runtime: no Job or JobSet retries)."""
    from finetune_trainer.contract import EXIT_GPU_OOM, FailureReport

    t0 = time.monotonic()
    name = _create_attempt(v2lab, ns, "oom", nodes=2, gpus=8, run_duration="2s", outcome="gpu-oom")["metadata"]["name"]
    wait_for(lambda: _is_true(v2lab, "trainjob", ns, name, "Failed"), 90, f"TrainJob {name} Failed")
    failed = _condition(_get(v2lab, "trainjob", ns, name), "Failed")
    assert _condition(_get(v2lab, "trainjob", ns, name), "Complete") is None
    terminated = [
        c["state"]["terminated"]
        for p in _pods(v2lab, ns, name)
        for c in (p.get("status") or {}).get("containerStatuses") or []
        if c["name"] == "node" and "terminated" in (c.get("state") or {})
    ]
    assert any(t["exitCode"] == EXIT_GPU_OOM for t in terminated), terminated
    report = FailureReport.model_validate_json(next(t["message"] for t in terminated if t["exitCode"] == EXIT_GPU_OOM))
    assert report.reason == "GPUOutOfMemory"
    print(f"\nGPU OOM: TrainJob Failed reason={failed['reason']!r} message={failed['message']!r}"
          f" after {time.monotonic() - t0:.1f}s; {len(terminated)} terminated pod(s) kept")


def test_kueue_never_admits_a_paris_pinned_trainjob_into_berlins_quota(v2lab, runtime, ns):
    """Sovereign pinning and Kueue flavors compose: a TrainJob whose pods must run in Paris (our required
    region affinity) is not admitted into Berlin's flavor although Berlin has free GPUs; Paris's flavor
    has none, so it waits, suspended."""
    from render_factories import plan_for, policy, pool

    from e2e.operator_harness import volumes
    from finetune_operator.rendering import render_config_map, render_trainjob

    flavors = [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": f"{ns}-{r}"},
                "spec": {"nodeLabels": {REGION_LABEL: r}}} for r in ("eu-de-berlin", "eu-fr-paris")]
    quotas = {"eu-de-berlin": "8", "eu-fr-paris": "0"}
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": ns},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": f"{ns}-{r}", "resources": [
                {"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "100Ti"},
                {"name": "nvidia.com/gpu", "nominalQuota": q}]} for r, q in quotas.items()],
        }]},
    }
    local_queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                   "metadata": {"name": "gpus", "namespace": ns}, "spec": {"clusterQueue": ns}}
    v2lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([*flavors, cluster_queue, local_queue]))
    wait_for(lambda: _is_true(v2lab, "clusterqueue", None, ns, "Active"), 30, f"ClusterQueue {ns} Active")

    job = _job("paris", ns, queueName="gpus", placement={"regions": ["eu-fr-paris"]})
    paris = pool(name="a100-paris", region="eu-fr-paris", zones=["eu-fr-paris-1a"], gpu_type="A100-40GB",
                 gpu_memory_bytes=40960 * 1024**2, cpus=96, selector={"karpenter.sh/nodepool": "a100-paris"}, taints=[])
    plan = plan_for(job, paris, gpus_per_node=8)
    config_map, _ = render_config_map(job, plan, 1, policy())
    train_job = render_trainjob(job, plan, 1, policy())
    volumes(v2lab, ns, ["models", "data"])
    v2lab.kubectl("create", "-f", "-", input=yaml.safe_dump_all([config_map, train_job]))
    name = train_job["metadata"]["name"]

    def reserved() -> dict | None:
        items = yaml.safe_load(v2lab.kubectl("get", "workloads", "-n", ns, "-o", "yaml").stdout)["items"]
        return next((_condition(w, "QuotaReserved") for w in items if _condition(w, "QuotaReserved")), None)

    cond = wait_for(reserved, 30, "the Workload's QuotaReserved condition")
    time.sleep(3)  # several scheduling cycles of Kueue
    cond = reserved()
    assert cond["status"] == "False", cond
    assert _get(v2lab, "trainjob", ns, name)["spec"]["suspend"] is True
    assert _pods(v2lab, ns, name) == []
    print(f"\nParis-pinned, Berlin has quota: Workload QuotaReserved=False reason={cond['reason']!r} message={cond['message']!r}")


# ---------------------------------------------------------------------------------------------------
# The operator on this lab (issue 14): the same FineTuneJobs as on the PyTorchJob lab, with only
# TrainJob served (policy trainingBackend auto picks it), and through Kueue.
# ---------------------------------------------------------------------------------------------------

BERLIN_ONLY = {"regions": ["eu-de-berlin"]}


@pytest.fixture(scope="module")
def v2operator(v2lab, runtime, tmp_path_factory):
    """The chart (kueue.enabled: the operator reads Workloads and LocalQueues; the runtime fixture made the
    ClusterTrainingRuntime) and the operator as its ServiceAccount, on the lab with only TrainJob."""
    from e2e import operator_harness as h

    t0 = time.monotonic()
    h.install_chart(v2lab, "--set", "kueue.enabled=true", "--set", "policy.trainingBackend=auto")
    wait_crd_established(v2lab, "finetunejobs.finetune.dev")
    process = h.OperatorProcess(v2lab, tmp_path_factory.mktemp("v2operator"))
    process.start()
    print(f"\nchart + operator on the TrainJob lab in {time.monotonic() - t0:.1f}s")
    yield process
    process.stop()
    print(f"operator log: {process.log_path}")


def _ftj(name: str, namespace: str, rule: dict[str, str], **spec) -> dict:
    from e2e import operator_harness as h

    job = h.job_from_example("llama-8b-lora.yaml", name, namespace, rule=rule, **spec)
    job["spec"]["recovery"] = {"maxAttempts": 3, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    return job


def _trainjobs(lab, namespace: str, job: str) -> list[dict]:
    out = lab.kubectl("get", "trainjobs", "-n", namespace, "-l", f"finetune.dev/job={job}", "-o", "yaml").stdout
    return yaml.safe_load(out)["items"]


def _regions_of_pods(lab, namespace: str, job: str) -> set[str]:
    from e2e import operator_harness as h

    nodes = _nodes(lab)
    return {nodes[p["spec"]["nodeName"]][REGION_LABEL] for p in h.pods(lab, namespace, job) if p["spec"].get("nodeName")}


def _event_reasons(lab, namespace: str, name: str) -> list[str]:
    from e2e import operator_harness as h

    return [e["reason"] for e in h.events(lab, namespace, name)]


def test_operator_runs_jobs_as_trainjobs_oom_recovery_pinning_and_suspend(v2lab, v2operator, ns):
    """Three FineTuneJobs at once on the lab with only TrainJob: one recovers from a GPU OOM and succeeds
    (Berlin), one pinned to Paris succeeds there, one is suspended while running and resumed."""
    from e2e import operator_harness as h

    t0 = time.monotonic()
    oom = _ftj("oom-once", ns, {"true-peak-factor": "1.7", "run-duration": "1s"})
    paris = _ftj("paris", ns, {"true-peak-factor": "1.0", "run-duration": "1s"},
                 placement={"regions": ["eu-fr-paris"]},
                 resources={"gpus": "auto", "maxGPUs": 8, "gpuTypes": ["A100-40GB"]})
    pause = _ftj("pause", ns, {"true-peak-factor": "1.0", "run-duration": "10s"})
    for job in (oom, paris, pause):
        h.apply_job(v2lab, job)

    running = h.wait_phase(v2lab, ns, "pause", ("Running",), timeout=90)
    assert running["status"]["attempts"][0]["pytorchJob"] == "pause-a1"
    v2lab.kubectl("patch", "ftj", "pause", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    h.wait_phase(v2lab, ns, "pause", ("Suspended",), timeout=60)
    (child,) = _trainjobs(v2lab, ns, "pause")
    wait_for(lambda: _get(v2lab, "trainjob", ns, "pause-a1")["spec"]["suspend"] is True, 30, "pause-a1 suspended")
    wait_for(lambda: not [p for p in h.pods(v2lab, ns, "pause") if (p.get("status") or {}).get("phase") == "Running"],
             60, "the suspended TrainJob's pods gone")
    suspended_at = time.monotonic() - t0
    v2lab.kubectl("patch", "ftj", "pause", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')

    done = {}
    for name in ("oom-once", "paris", "pause"):
        v2lab.kubectl("wait", "--for=condition=Succeeded", f"ftj/{name}", "-n", ns, "--timeout=150s", timeout=160)
        done[name] = time.monotonic() - t0
    status = h.get_job(v2lab, ns, "oom-once")["status"]
    assert [a["outcome"] for a in status["attempts"]] == ["GPUOutOfMemory", "Succeeded"], status["attempts"]
    assert "GPU OOM" in status["attempts"][0]["message"] and status["attempts"][1]["plan"]["calibration"] > 1.0
    assert [t["metadata"]["name"] for t in _trainjobs(v2lab, ns, "oom-once")] == ["oom-once-a2"]
    assert _regions_of_pods(v2lab, ns, "oom-once") <= {"eu-de-berlin"}
    paris_status = h.get_job(v2lab, ns, "paris")["status"]
    assert paris_status["plan"]["region"] == "eu-fr-paris"
    assert _regions_of_pods(v2lab, ns, "paris") == {"eu-fr-paris"}
    assert [a["outcome"] for a in h.get_job(v2lab, ns, "pause")["status"]["attempts"]] == ["Succeeded"]
    assert {"Suspended", "Resumed"} <= set(_event_reasons(v2lab, ns, "pause"))
    assert "pytorchjobs.kubeflow.org" not in v2lab.kubectl("api-resources", "-o", "name").stdout
    print(f"\nTrainJob lab with the operator: pause suspended at {suspended_at:.1f}s; Succeeded: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in done.items()))


def _kueue_queues(lab, ns: str) -> None:
    flavors = [{"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": f"{ns}-{r}"},
                "spec": {"nodeLabels": {REGION_LABEL: r}}} for r in ("eu-de-berlin", "eu-fr-paris")]
    quotas = {"eu-de-berlin": "8", "eu-fr-paris": "0"}
    cluster_queue = {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": ns},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": f"{ns}-{r}", "resources": [
                {"name": "cpu", "nominalQuota": "1000"}, {"name": "memory", "nominalQuota": "100Ti"},
                {"name": "nvidia.com/gpu", "nominalQuota": q}]} for r, q in quotas.items()],
        }]},
    }
    local_queue = {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                   "metadata": {"name": "gpus", "namespace": ns}, "spec": {"clusterQueue": ns}}
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([*flavors, cluster_queue, local_queue]))
    wait_for(lambda: _is_true(lab, "clusterqueue", None, ns, "Active"), 30, f"ClusterQueue {ns} Active")


def test_operator_through_kueue_quota_contention_oom_requeue_and_missing_local_queue(v2lab, v2operator, ns):
    """A ClusterQueue of 8 GPUs and two 8-GPU FineTuneJobs: the second stays Queued (its TrainJob suspended,
    never un-suspended by the operator) with Kueue's reason, and is admitted when the first finishes; its
    first attempt runs out of GPU memory and the next attempt goes through the queue again. A job naming a
    LocalQueue that does not exist says so."""
    from e2e import operator_harness as h

    _kueue_queues(v2lab, ns)
    eight = {"gpus": 8, "maxGPUs": 8, "gpuTypes": ["H100-80GB"]}
    t0 = time.monotonic()
    first = _ftj("first", ns, {"true-peak-factor": "1.0", "run-duration": "8s"}, queueName="gpus", resources=eight)
    h.apply_job(v2lab, first)
    try:
        h.wait_phase(v2lab, ns, "first", ("Launching", "Running"), timeout=60)
    except TimeoutError:
        print(yaml.safe_dump(h.get_job(v2lab, ns, "first").get("status")))
        print(v2lab.kubectl("get", "workloads,trainjobs", "-n", ns, "-o", "yaml").stdout)
        print(v2lab.kubectl("get", "events", "-n", ns).stdout)
        raise
    second = _ftj("second", ns, {"outcome-by-attempt": "gpu-oom,succeed", "run-duration": "1s"}, queueName="gpus",
                  resources=eight)
    h.apply_job(v2lab, second)
    lost = _ftj("lost", ns, {"run-duration": "1s"}, queueName="nowhere")
    h.apply_job(v2lab, lost)

    def kueue_said() -> dict | None:
        cond = h.condition(h.get_job(v2lab, ns, "second"), "Queued")
        return cond if cond and cond["status"] == "True" and "Kueue (" in cond["message"] else None

    queued = wait_for(kueue_said, 60, "second Queued with Kueue's reason")
    assert queued["reason"] == "WaitingForAdmission", queued
    print(f"\nsecond Queued: {queued['message']}")
    while not _is_true(v2lab, "trainjob", ns, "first-a1", "Complete"):
        assert _get(v2lab, "trainjob", ns, "second-a1")["spec"]["suspend"] is True, "second admitted while first holds the quota"
        assert h.get_job(v2lab, ns, "second")["status"]["phase"] == "Queued"
        assert time.monotonic() - t0 < 120, "first did not complete"
        time.sleep(0.5)
    first_done = time.monotonic() - t0
    v2lab.kubectl("wait", "--for=condition=Succeeded", "ftj/first", "-n", ns, "--timeout=60s", timeout=70)

    lost_cond = wait_for(lambda: (c := h.condition(h.get_job(v2lab, ns, "lost"), "Queued")) and c["reason"] == "LocalQueueNotFound" and c,
                         60, "lost: Queued reason LocalQueueNotFound")
    assert f"LocalQueue {ns}/nowhere does not exist" in lost_cond["message"]
    assert _get(v2lab, "trainjob", ns, "lost-a1")["spec"]["suspend"] is True

    v2lab.kubectl("wait", "--for=condition=Succeeded", "ftj/second", "-n", ns, "--timeout=150s", timeout=160)
    second_done = time.monotonic() - t0
    status = h.get_job(v2lab, ns, "second")["status"]
    assert [a["outcome"] for a in status["attempts"]] == ["GPUOutOfMemory", "Succeeded"], status["attempts"]
    reasons = _event_reasons(v2lab, ns, "second")
    assert reasons.count("Queued") >= 2, reasons  # attempt 2 went through the queue again
    assert "Resumed" not in reasons  # the operator never un-suspended a queued child
    admitted = h.condition(h.get_job(v2lab, ns, "second"), "Queued")
    assert admitted["status"] == "False" and admitted["reason"] == "Admitted"
    assert f"ClusterQueue {ns}" in admitted["message"] and f"{ns}-eu-de-berlin" in admitted["message"], admitted
    assert SUSPENDED_BY not in (_get(v2lab, "trainjob", ns, "second-a2")["metadata"].get("annotations") or {})
    assert _regions_of_pods(v2lab, ns, "second") <= {"eu-de-berlin"}
    print(f"\nKueue with the operator: first Complete {first_done:.1f}s, second (OOM, queued again) Succeeded"
          f" {second_done:.1f}s; lost: {lost_cond['message']}")


SUSPENDED_BY = "finetune.dev/suspended-by"
