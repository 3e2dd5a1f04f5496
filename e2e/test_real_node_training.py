"""Training pods as real containers on the lab's real kubelet node (issue 24 item 4).

Everything here is what a platform team runs: the operator is the chart's Deployment (two replicas of
the operator image, leader election through the Lease) on the real node; the training operator turns
the PyTorchJob into pods; the kubelet runs them as containers of the trainer image built from its
Dockerfile (e2e/lab/images.py), with the securityContext, volumes, `/dev/shm`, termination message
and ServiceAccount setting the renderer writes; the lab's device plugin (e2e/lab/gpuplugin) gives
them `nvidia.com/gpu`; their claims are `local` PersistentVolumes on the node. The lab adds two
things a GPU cluster has and this machine does not: the host's Python (torch) mounted read-only into
every container by the node's runtime (realnode.base_spec), and the lab GPU's variables injected
into each GPU pod when it is created (e2e/lab/gpuwebhook.py, the rule the other runners apply).

Jobs run one after the other: the machine has two CPUs, and each training pod asks for one.

Opt-in, like e2e/test_real_node.py: FINETUNE_LAB_REAL_NODE=1 (root, containerd, runc, CNI plugins,
mmdebstrap, umoci; it changes host-wide state while it runs and puts it back at the end).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from e2e import operator_harness as h
from e2e import real_processes as rp
from e2e.real_node_jobs import POOL, crictl_containers, install_operator, restricted_namespace, start_lab
from e2e.real_node_jobs import job as _job
from e2e.real_node_jobs import trainer_events as _trainer_events

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

OOM_STEP = 6
BUCKET = "team-real"
SECRET = "s3-team-real"
CHECKPOINT_EVERY = 4


@pytest.fixture(scope="module")
def node_lab(real_node_lab):
    return real_node_lab


@pytest.fixture(scope="module")
def s3(node_lab, tmp_path_factory):
    """The lab's S3 server on the real node's bridge gateway, where the pods' containers reach it."""
    from e2e.lab.objectstore import server
    from e2e.lab.realnode import GATEWAY

    running = server(tmp_path_factory.mktemp("s3"))
    assert running is not None, "the lab's S3 server is not built (python -m e2e.lab build)"
    running.host = GATEWAY
    running.start()
    running.make_bucket(BUCKET)
    yield running
    running.stop()


def _chart_values(s3, backend: str = "pytorchjob") -> list[str]:
    """The chart's values for this module: the real node's pool and region, the S3 server for that
    region, and the training backend (both are served; the ClusterTrainingRuntime is installed)."""
    storage = [{"endpoint": s3.endpoint, "region": rp.load_pools().pool(POOL).region}]
    return [*rp.chart_args(POOL), "--set-json", f"policy.objectStorage={json.dumps(storage)}",
            "--set", f"policy.trainingBackend={backend}", "--set", "trainJobRuntime.enabled=true"]


@pytest.fixture(scope="module")
def operator(node_lab, s3):
    lab = node_lab
    print(f"chart installed, operator pods Ready: {install_operator(lab, *_chart_values(s3)):.1f}s")
    print(lab.kubectl("get", "pods", "-n", h.RELEASE_NAMESPACE, "-o", "wide").stdout)
    return lab


@pytest.fixture(scope="module")
def namespace(operator):
    ns = f"real-pods-{uuid.uuid4().hex[:5]}"
    vocab = restricted_namespace(operator, ns)
    yield ns, vocab
    from kubernetes import client

    try:
        client.CoreV1Api(operator.api_client()).delete_namespace(ns)
    finally:
        rp.remove_claims(ns)


def _run(lab, ns: str, job: dict[str, Any], timeout: float = 900) -> tuple[dict[str, Any], float]:
    """Apply, wait for a terminal phase; (status, seconds). Logs of the pods are read while they exist."""
    t0 = time.monotonic()
    lab.kubectl("apply", "-f", "-", input=json.dumps(job))
    return _ended(lab, ns, job["metadata"]["name"], timeout), time.monotonic() - t0


def _ended(lab, ns: str, name: str, timeout: float = 900) -> dict[str, Any]:
    """The job's status once its phase is Succeeded or Failed; the diagnosis when it does not end."""
    try:
        return _wait(f"{name} ends", lambda: (s := _status(lab, ns, name)).get("phase") in ("Succeeded", "Failed") and s,
                     timeout, 2)
    except AssertionError as late:
        raise AssertionError(f"{late}:\n{_diagnose(lab, ns, name)}") from None


def _diagnose(lab, ns: str, name: str) -> str:
    parts = [lab.kubectl("get", "ftj", name, "-n", ns, "-o", "yaml", check=False).stdout[-4000:],
             lab.kubectl("get", "pods,pytorchjobs,events", "-n", ns, "-o", "wide", check=False).stdout[-4000:]]
    for pod in json.loads(lab.kubectl("get", "pods", "-n", ns, "-o", "json", check=False).stdout or '{"items": []}')["items"]:
        parts.append(lab.kubectl("logs", "-n", ns, pod["metadata"]["name"], "--all-containers", "--tail=30",
                                 check=False).stdout)
    parts.append(lab.kubectl("logs", "-n", h.RELEASE_NAMESPACE, "deploy/finetune-operator", "--tail=40",
                             check=False).stdout)
    return "\n".join(parts)


def _pod(lab, ns: str, name: str) -> dict[str, Any]:
    return json.loads(lab.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)


def test_a_gpu_oom_in_the_real_container_then_the_next_attempt_resumes_from_its_checkpoint(operator, namespace):
    lab = operator
    ns, vocab = namespace
    # Sized as Llama 3.1 8B at 4096 tokens (the trainer trains the tiny model): the plan fills the GPU,
    # the lab GPU's true peak is rp.OOM_FACTOR x the prediction, so attempt 1 runs out at OOM_STEP; the
    # calibrated re-plan fits. (Forcing an OOM on a tiny model's plan calibrates it by the whole GPU
    # over 1.5 GiB, and then rightly nothing fits.)
    # With evaluation on a held-out eighth and a merged export: both run inside the real containers too.
    job = _job("gpu-oom", ns, vocab, max_steps=12, every_steps=CHECKPOINT_EVERY, global_batch=8,
               sized_as="llama-3.1-8b", sequence_length=4096,
               rule={"true-peak-factor": rp.OOM_FACTOR, "oom-step": str(OOM_STEP)},
               evaluation={"heldOutFraction": 0.125, "everySteps": CHECKPOINT_EVERY}, export="merged")
    status, seconds = _run(lab, ns, job)
    print(f"scenario real-node gpu-oom: {seconds:.1f}s ({len(status.get('attempts') or [])} attempts)")
    assert status["phase"] == "Succeeded", _diagnose(lab, ns, "gpu-oom")
    first, last = status["attempts"][0], status["attempts"][-1]
    assert first["outcome"] == "GPUOutOfMemory" and last["outcome"] == "Succeeded", status["attempts"]
    # The trainer's failure report came through the kubelet's termination message: exit 75 at the step.
    failed = first["failedPods"][0]
    assert failed["exitCode"] == 75 and failed["step"] == OOM_STEP and failed["source"] == "report", failed
    assert first["plan"] != last["plan"], (first["plan"], last["plan"])
    # The next attempt resumed from the checkpoint attempt 1 wrote before the OOM.
    saved = (OOM_STEP - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    start = _trainer_events(lab, ns, f"gpu-oom-a{len(status['attempts'])}-master-0", "start")
    assert start and start[0]["startStep"] == saved, start
    # The held-out evaluation's last figure is in status and in the provenance record; the merged
    # folder the master pod wrote into the claim loads as is and computes base plus adapter.
    summary = status["provenance"]
    assert start[0]["heldOut"] == summary["heldOut"] == 8, (start, summary)
    assert status["progress"]["evalStep"] == 12 and status["progress"]["evalLoss"] == summary["evalLoss"], status
    final = rp.claim_dir(ns, "checkpoints") / "gpu-oom" / "final"
    assert summary["export"] == "pvc://checkpoints/gpu-oom/final/merged" and summary["exportBytes"] > 0, summary
    rp.merged_logits_match(rp.claim_dir(ns, "models") / "tiny-llama", final, final / "merged")


def test_a_real_oomkilled_from_the_kubelet_then_the_pod_memory_is_raised(operator, namespace):
    lab = operator
    ns, vocab = namespace
    # The pod's memory limit is scaled to 0.15 of what the operator planned (gpuwebhook.py): less than
    # one trainer process's resident memory, so the kernel kills it; each raise gives the next more.
    job = _job("host-oom", ns, vocab, max_steps=4, every_steps=4, rule={"host-memory-scale": "0.15"})
    status, seconds = _run(lab, ns, job)
    print(f"scenario real-node host-oom: {seconds:.1f}s ({len(status.get('attempts') or [])} attempts)")
    assert status["phase"] == "Succeeded", _diagnose(lab, ns, "host-oom")
    attempts = status["attempts"]
    outcomes = [a["outcome"] for a in attempts]
    assert outcomes[0] == "HostOutOfMemory" and outcomes[-1] == "Succeeded", outcomes
    assert set(outcomes[:-1]) == {"HostOutOfMemory"}, outcomes
    memory = [float(a["plan"]["hostMemory"].removesuffix("Gi")) for a in attempts]
    assert memory == sorted(memory) and len(set(memory)) == len(memory), memory


# Jobs slow enough to intervene in (about 2-3 s a step here): planned as Llama 3.1 8B at 4096 tokens,
# trained as the tiny model at that length.
SLOW = {"global_batch": 8, "sized_as": "llama-3.1-8b", "sequence_length": 4096}
STEPS = 20


def _wait(what: str, check, timeout: float = 300, every: float = 1.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = check()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


def _status(lab, ns: str, name: str) -> dict[str, Any]:
    return json.loads(lab.kubectl("get", "ftj", name, "-n", ns, "-o", "json").stdout).get("status") or {}


def _pods_of(lab, ns: str, name: str) -> list[dict[str, Any]]:
    items = json.loads(lab.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
    return [p for p in items if p["metadata"]["name"].startswith(f"{name}-a")]


def _pod_if_any(lab, ns: str, name: str) -> dict[str, Any] | None:
    out = lab.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _worker_training(lab, ns: str, name: str):
    """(attempt, pod, its trainer's start lines, whether crictl lists its container) for the worker of
    an attempt after the first once its trainer has started; None before."""
    for pod in _pods_of(lab, ns, name):
        attempt = int(pod["metadata"]["name"][len(name) + 2:].split("-", 1)[0])
        if attempt < 2 or not pod["metadata"]["name"].endswith("-worker-0") or pod["status"].get("phase") != "Running":
            continue
        started = _trainer_events(lab, ns, pod["metadata"]["name"], "start")
        if started:
            ran = (pod["metadata"]["name"], "pytorch") in {(c["labels"].get("io.kubernetes.pod.name"), c["metadata"]["name"])
                                                         for c in crictl_containers(lab)}
            return attempt, pod, started, ran
    return None


def _start_slow_job(lab, ns: str, vocab: int, name: str, gpus: int = 1) -> None:
    """Apply a SLOW job of STEPS steps and return once attempt 1 wrote its first checkpoint (read in
    the claim, not the status's progress: that is polled, and lags by more than a checkpoint interval)."""
    lab.kubectl("apply", "-f", "-", input=json.dumps(_job(name, ns, vocab, max_steps=STEPS, gpus=gpus,
                                                          every_steps=CHECKPOINT_EVERY, **SLOW)))
    _wait("attempt 1 wrote a checkpoint", lambda: rp.checkpoint_steps(ns, name), 600, 0.5)


def test_a_two_pod_job_meets_through_its_service_and_a_worker_deleted_mid_run_resumes(operator, namespace):
    """Two pods on the two real nodes (one GPU each): their ranks meet through torchrun's rendezvous at
    the master's Service name, which CoreDNS resolves. Once attempt 1 wrote a checkpoint, the worker
    pod is deleted (a drain, a person): the kubelet stops its container, the operator sees the attempt
    lost and the next attempt, two pods again, resumes from the newest checkpoint to the end."""
    from e2e.lab import images
    from e2e.lab.realnode import NODE_NAMES

    lab = operator
    ns, vocab = namespace
    t0 = time.monotonic()
    _start_slow_job(lab, ns, vocab, "two-pod", gpus=2)
    lab.kubectl("delete", "pod", "two-pod-a1-worker-0", "-n", ns, "--wait=false")
    # The next attempt's worker is seen while it trains: when the master ends first, the training
    # operator may delete a worker still exiting (cleanPodPolicy Running, as rendered), and with it
    # the worker's log and its container.
    seen_attempt, seen_worker, on_worker, ran_worker = _wait("the next attempt's worker trains",
                                                            lambda: _worker_training(lab, ns, "two-pod"), 600, 1)
    status = _ended(lab, ns, "two-pod")
    assert status["phase"] == "Succeeded", _diagnose(lab, ns, "two-pod")
    print(f"scenario real-node two-pod, worker deleted: {time.monotonic() - t0:.1f}s ({len(status['attempts'])} attempts)")
    print(lab.kubectl("get", "pods", "-n", ns, "-o", "wide").stdout)
    outcomes = [a["outcome"] for a in status["attempts"]]
    assert len(outcomes) >= 2 and outcomes[-1] == "Succeeded", outcomes
    assert set(outcomes[:-1]) <= {"Evicted", "Preempted", "NodeFailure"}, outcomes
    plan = status["attempts"][-1]["plan"]
    assert plan["gpus"] == 2 and plan["nodes"] == 2 and plan["nodePool"] == POOL, plan
    last = len(outcomes)
    assert seen_attempt == last, (seen_attempt, outcomes)
    master, worker = f"two-pod-a{last}-master-0", f"two-pod-a{last}-worker-0"
    pods = {master: _pod(lab, ns, master), worker: seen_worker}
    # One pod on each real node, in the trainer image, each with the GPU its node's plugin allocated ...
    assert {p["spec"]["nodeName"] for p in pods.values()} == set(NODE_NAMES), pods
    for pod in pods.values():
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "pytorch")
        assert trainer["image"] == images.image_names()["trainer"][0]
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["spec"].get("automountServiceAccountToken") is False
    ended = [pods[master]] + [p for p in [_pod_if_any(lab, ns, worker)] if p]
    for pod in ended:
        state = next(c for c in pod["status"]["containerStatuses"] if c["name"] == "pytorch")["state"]["terminated"]
        assert state["exitCode"] == 0 and state["reason"] == "Completed", state
    # ... as containers of the nodes' runtimes (crictl), ...
    ran = {(c["labels"].get("io.kubernetes.pod.name"), c["metadata"]["name"]) for c in crictl_containers(lab)}
    assert (master, "pytorch") in ran and ran_worker, ran
    # ... two ranks that met at the master's Service name and started from the newest checkpoint
    # attempt 1 wrote (4, or a later one it reached before its worker was stopped) ...
    start = _trainer_events(lab, ns, master, "start")
    assert start and start[0]["worldSize"] == 2 and start[0]["rank"] == 0, start
    assert on_worker[0]["worldSize"] == 2 and on_worker[0]["rank"] == 1, on_worker
    assert start[0]["startStep"] >= CHECKPOINT_EVERY and start[0]["startStep"] % CHECKPOINT_EVERY == 0, start
    steps = rp.losses(_trainer_events(lab, ns, master, "progress"))
    assert min(steps) == start[0]["startStep"] + 1 and max(steps) == STEPS, steps
    # ... and the adapter in the claim (a volume both nodes reach), written by uid 1000.
    final = rp.claim_dir(ns, "checkpoints") / "two-pod" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_config.json").stat().st_uid == 1000


def test_suspend_and_resume_continue_from_the_checkpoint_in_the_claim(operator, namespace):
    lab = operator
    ns, vocab = namespace
    t0 = time.monotonic()
    _start_slow_job(lab, ns, vocab, "suspended")
    lab.kubectl("patch", "ftj", "suspended", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": true}}')
    # The operator suspends the attempt's PyTorchJob: its pod goes, the job object stays.
    _wait("Suspended with no pod left", lambda: _status(lab, ns, "suspended").get("phase") == "Suspended"
          and not _pods_of(lab, ns, "suspended"), 180)
    saved = rp.checkpoint_steps(ns, "suspended")
    assert saved and max(saved) < STEPS, saved
    lab.kubectl("patch", "ftj", "suspended", "-n", ns, "--type=merge", "-p", '{"spec": {"suspend": false}}')
    status = _ended(lab, ns, "suspended")
    assert status["phase"] == "Succeeded", _diagnose(lab, ns, "suspended")
    print(f"scenario real-node suspend-resume: {time.monotonic() - t0:.1f}s ({len(status['attempts'])} attempts)")
    assert status["attempts"][-1]["outcome"] == "Succeeded", status["attempts"]
    running = [p["metadata"]["name"] for p in _pods_of(lab, ns, "suspended")]
    assert len(running) == 1, running
    start = _trainer_events(lab, ns, running[0], "start")
    assert start and start[0]["startStep"] == max(saved), (saved, start)
    steps = rp.losses(_trainer_events(lab, ns, running[0], "progress"))
    assert min(steps) == max(saved) + 1 and max(steps) == STEPS, steps
    assert (rp.claim_dir(ns, "checkpoints") / "suspended" / "final" / "adapter_config.json").is_file()


def test_s3_data_in_and_the_adapter_out_through_the_fetch_and_upload_containers(operator, namespace, s3):
    """The pod the renderer writes for object storage, run for real in the restricted namespace: the
    fetch init container reads the dataset from the bucket, the training container trains and hands
    off, the upload sidecar (a native sidecar) stores the adapter; only those two hold the key pair."""
    lab = operator
    ns, vocab = namespace
    t0 = time.monotonic()
    data = rp.claim_dir(ns, "data") / "chat.jsonl"
    (s3.root / BUCKET / "support").mkdir(parents=True, exist_ok=True)
    (s3.root / BUCKET / "support" / "train.jsonl").write_bytes(data.read_bytes())
    lab.kubectl("create", "secret", "generic", SECRET, "-n", ns, f"--from-literal=accessKeyId={s3.access_key_id}",
                f"--from-literal=secretAccessKey={s3.secret_access_key}")
    job = _job("s3-real", ns, vocab, max_steps=8, every_steps=4)
    ref = {"endpoint": s3.endpoint, "bucket": BUCKET, "credentialsSecretRef": {"name": SECRET}}
    job["spec"]["dataset"]["source"] = {"s3": {**ref, "key": "support/train.jsonl"}}
    job["spec"]["output"] = {"s3": {**ref, "key": "results/s3-real/"}}
    status, seconds = _run(lab, ns, job)
    print(f"scenario real-node s3 in and out: {time.monotonic() - t0:.1f}s")
    assert status["phase"] == "Succeeded", _diagnose(lab, ns, "s3-real")
    master = f"s3-real-a{len(status['attempts'])}-master-0"
    pod = _pod(lab, ns, master)
    names = [c["name"] for c in pod["spec"]["initContainers"]] + [c["name"] for c in pod["spec"]["containers"]]
    assert "fetch-data" in names and "upload" in names, names
    for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        holds = any("valueFrom" in e for e in c.get("env") or [])
        assert holds == (c["name"] in ("fetch-data", "upload")), (c["name"], c.get("env"))
    # Each ran as a container of the node's runtime ...
    ran = {c["metadata"]["name"] for c in crictl_containers(lab) if c["labels"].get("io.kubernetes.pod.name") == master}
    assert {"fetch-data", "upload", "pytorch"} <= ran, ran
    # ... and the adapter is in the bucket, where the trainer's output went.
    stored = sorted(p.relative_to(s3.root / BUCKET) for p in (s3.root / BUCKET / "results" / "s3-real").rglob("*")
                    if p.is_file())
    assert any(p.name == "adapter_config.json" for p in stored), stored


def test_the_trainjob_backend_runs_a_gpu_oom_and_its_resume_in_real_containers(operator, namespace, s3):
    """The same cluster with the policy's backend switched to TrainJob (Kubeflow Trainer v2 and JobSet
    running beside the training operator): the attempts are TrainJobs of the chart's
    ClusterTrainingRuntime, their pods JobSet's, run by the real kubelet; attempt 1 runs out of GPU
    memory at OOM_STEP in the real trainer, attempt 2 (another plan) resumes from its checkpoint."""
    from e2e.lab.realnode import NODE_NAMES

    lab = operator
    ns, vocab = namespace
    h.install_chart_on_real_node(lab, *_chart_values(s3, backend="trainjob"))
    # The operator polls its policy (shell/handlers.py POLICY_POLL_SECONDS, 10 s): twice that, so
    # that the job below is planned under trainingBackend trainjob, not the policy before.
    from finetune_operator.shell.handlers import POLICY_POLL_SECONDS
    time.sleep(2 * POLICY_POLL_SECONDS)
    try:
        t0 = time.monotonic()
        job = _job("tj-oom", ns, vocab, max_steps=12, every_steps=CHECKPOINT_EVERY,
                   rule={"true-peak-factor": rp.OOM_FACTOR, "oom-step": str(OOM_STEP)}, **SLOW)
        status, _ = _run(lab, ns, job)
        print(f"scenario real-node trainjob gpu-oom: {time.monotonic() - t0:.1f}s ({len(status.get('attempts') or [])} attempts)")
        assert status["phase"] == "Succeeded", _diagnose(lab, ns, "tj-oom")
        attempts = status["attempts"]
        assert attempts[0]["outcome"] == "GPUOutOfMemory" and attempts[-1]["outcome"] == "Succeeded", attempts
        # TrainJobs, not PyTorchJobs (the one of attempt 1 was deleted before attempt 2 began) ...
        trainjobs = json.loads(lab.kubectl("get", "trainjobs", "-n", ns, "-o", "json").stdout)["items"]
        assert [t["metadata"]["name"] for t in trainjobs] == [f"tj-oom-a{len(attempts)}"], trainjobs
        assert not json.loads(lab.kubectl("get", "pytorchjobs", "-n", ns, "-l", "finetune.dev/job=tj-oom",
                                          "-o", "json").stdout)["items"]
        # ... whose pods (JobSet's) ran as containers of the node's runtime, the trainer as `node` ...
        pods = [p for p in json.loads(lab.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
                if p["metadata"]["name"].startswith(f"tj-oom-a{len(attempts)}-")]
        assert len(pods) == 1 and pods[0]["spec"]["nodeName"] in NODE_NAMES, [p["metadata"]["name"] for p in pods]
        last = pods[0]["metadata"]["name"]
        ran = {c["metadata"]["name"] for c in crictl_containers(lab) if c["labels"].get("io.kubernetes.pod.name") == last}
        assert "node" in ran, ran
        # ... and the last attempt resumed from the checkpoint attempt 1 wrote before its OOM.
        saved = (OOM_STEP - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        start = _trainer_events(lab, ns, last, "start", container="node")
        assert start and start[0]["startStep"] == saved, start
        failed = attempts[0]["failedPods"][0]
        assert failed["exitCode"] == 75 and failed["step"] == OOM_STEP and failed["source"] == "report", failed
    finally:
        h.install_chart_on_real_node(lab, *_chart_values(s3))


def test_a_profile_pod_runs_on_the_real_node_once_the_policy_tolerates_its_taints(operator, namespace, s3):
    """The pre-flight profile on the real kubelet (issue 26 item 4): a model of a family the analytic
    model does not know (tiny Falcon) is profiled by a CPU-only pod in the operator's namespace, which
    enforces the restricted standard here. The real node is tainted (a GPU node of a dedicated pool),
    so under the chart's default policy the scheduler leaves the pod Pending and the job says why
    (ProfilePodUnschedulable, naming policy.profilePod); once `helm upgrade` sets profilePod
    tolerations, the operator replaces the pod, it runs as a container of the trainer image, and the
    job is planned from what it measured."""
    from e2e.lab import nodes as lab_nodes
    from e2e.lab.realnode import NODE_NAMES
    from finetune_operator.profiling.pod import profile_pod_name
    from finetune_operator.shell.handlers import POLICY_POLL_SECONDS

    lab = operator
    ns, _vocab = namespace
    name = "falcon"
    pod_name = profile_pod_name(ns, name)
    lab.kubectl("label", "namespace", h.RELEASE_NAMESPACE, "--overwrite",
                "pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")
    lab.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "falcon", "namespace": ns},
        "data": {"config.json": json.dumps(rp.TINY_FALCON)}}))
    job = _job(name, ns, 512, max_steps=4)
    job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "falcon"}}
    # Checkpointing and FSDP fixed: the profile traces 1 or 2 GPUs x micro-batch 1 or 2.
    job["spec"]["training"].update(sequenceLength=256, globalBatchSize=2, gradientCheckpointing=True)
    job["spec"]["resources"] = {"gpus": "auto", "maxGPUs": 2, "strategy": "fsdp"}
    tolerations = [{"key": t["key"], "operator": "Exists", "effect": t["effect"]}
                   for t in lab_nodes.node_taints(lab_nodes.load_pools().kubelet_pool())]
    t0 = time.monotonic()
    try:
        lab.kubectl("apply", "-f", "-", input=json.dumps(job))
        waiting = _wait("the profile pod unschedulable", lambda: (c := _condition(lab, ns, name, "Profiled"))
                        and c.get("reason") == "ProfilePodUnschedulable" and c, 90, 1)
        assert "untolerated taint" in waiting["message"] and "profilePod" in waiting["message"], waiting
        assert _status(lab, ns, name)["phase"] == "Pending"
        h.install_chart_on_real_node(lab, *_chart_values(s3), "--set-json",
                                     "policy.profilePod=" + json.dumps({"tolerations": tolerations}))
        seen: dict[str, Any] = {}

        def planned():
            # The operator deletes the profile pod once it has read its report: note where it ran meanwhile.
            pod = json.loads(lab.kubectl("get", "pod", pod_name, "-n", h.RELEASE_NAMESPACE, "-o", "json",
                                         check=False).stdout or "{}")
            if (pod.get("spec") or {}).get("nodeName"):
                seen["node"] = pod["spec"]["nodeName"]
                seen["tolerations"] = pod["spec"].get("tolerations")
            seen.setdefault("containers", set()).update(
                c["metadata"]["name"] for c in crictl_containers(lab)
                if c["labels"].get("io.kubernetes.pod.name") == pod_name)
            c = _condition(lab, ns, name, "Profiled")
            return c is not None and c.get("status") == "True" and c

        try:
            profiled = _wait("the job profiled", planned, 4 * POLICY_POLL_SECONDS + 240, 1)
        except AssertionError as late:
            raise AssertionError(f"{late}:\n{_diagnose(lab, ns, name)}") from None
        assert "falcon" in profiled["message"], profiled
        try:
            status = _wait("the job planned", lambda: (st := _status(lab, ns, name)).get("plan") and st, 60, 1)
        except AssertionError as late:
            raise AssertionError(f"{late}:\n{_diagnose(lab, ns, name)}") from None
        assert "measured" in status["plan"].get("breakdown", ""), status["plan"]
        # The pod ran on the real node, tolerating its taints, as a container of the node's runtime.
        # (The API server adds its default not-ready/unreachable tolerations.)
        assert seen.get("node") in NODE_NAMES and all(t in seen["tolerations"] for t in tolerations), seen
        assert seen["containers"] == {"profile"}, seen
        print(f"scenario real-node profile: {time.monotonic() - t0:.1f}s")
    finally:
        lab.kubectl("delete", "ftj", name, "-n", ns, "--wait=false", check=False)
        lab.kubectl("label", "namespace", h.RELEASE_NAMESPACE, "pod-security.kubernetes.io/enforce-",
                    "pod-security.kubernetes.io/enforce-version-", check=False)
        lab.kubectl("delete", "configmap", "finetune-operator-profiles", "-n", h.RELEASE_NAMESPACE,
                    "--ignore-not-found", check=False)
        h.install_chart_on_real_node(lab, *_chart_values(s3))


def _condition(lab, ns: str, name: str, kind: str) -> dict[str, Any] | None:
    return next((c for c in _status(lab, ns, name).get("conditions") or [] if c.get("type") == kind), None)
