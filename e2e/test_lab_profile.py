"""Sizing for models the analytic model does not know, and estimates that learn, on the lab (issue 16).

1. A FineTuneJob whose config.json (a ConfigMap) names a family the analytic memory model does not
   know (Falcon) is planned through the pre-flight profile: the operator creates the CPU-only
   profile pod; the pod lands on a kwok node (the lab runs no process there), so this test plays
   its kubelet: it reads the pod's request from the pod itself, runs the real profile code on it
   (`python -m finetune_trainer.profile`, a subprocess of the test) and hands the report to the
   lab's kwok stage, which terminates the pod with it as the termination message, exactly as the
   kubelet reports a container. The operator caches the figures, plans from them and deletes the
   pod; a second job of the same model is planned from the cache without a pod.
   (A model that cannot be built, and a pod that fails, are covered without the lab:
   tests/profiling/test_profiling_core.py, tests/trainer/test_profile.py.)
2. Learning: a run that used 1.3 times its predicted peak (the fake GPU's OOM report) teaches its
   kind of run; a later job of the same kind is planned with that correction, which its
   `kubectl describe` shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from finetune_operator.profiling.pod import PROFILE_UID_LABEL, profile_pod_name

from e2e import operator_harness as h
from e2e import real_processes as rp
from e2e.lab.waiting import wait_for
from finetune_operator import calibration as C
from finetune_operator.planning.policy import load_policy

pytestmark = pytest.mark.e2e

CONFIG = rp.TINY_FALCON


def _forget_what_was_learned(lab) -> None:
    lab.kubectl("delete", "configmap", "finetune-operator-calibration", "finetune-operator-profiles",
                "-n", h.RELEASE_NAMESPACE, "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, tmp_path_factory):
    # A new cluster for this module: another module on the same session lab may have taught the
    # calibration of the very kind these tests teach (a GPU OOM of the 8B example), and the first plan
    # of the teacher would then already carry it.
    _forget_what_was_learned(lab)
    h.install_chart(lab)
    with h.running_operator(lab, tmp_path_factory.mktemp("operator-profile")) as process:
        yield process
    # Leave the lab as a new cluster: later modules plan with the built-in model, not what this one taught.
    _forget_what_was_learned(lab)


def _gib(quantity: str) -> float:
    """A status quantity such as 61.3Gi, in GiB."""
    assert quantity.endswith("Gi"), quantity
    return float(quantity[:-2])


def _config_map(lab, namespace: str) -> None:
    lab.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "neox", "namespace": namespace},
        "data": {"config.json": json.dumps(CONFIG)}}))


def _neox_job(name: str, namespace: str) -> dict:
    job = h.job_from_example("llama-8b-lora.yaml", name, namespace, rule={"outcome": "succeed", "run-duration": "60s"})
    job["spec"]["model"] = {"name": "EleutherAI/tiny-neox", "architecture": {"configMapRef": {"name": "neox"}},
                            "source": {"pvc": {"claimName": "models", "path": "neox"}}}
    # Checkpointing and FSDP fixed: the profile traces its grid, 1 or 2 GPUs x micro-batch 1 or 2.
    job["spec"]["training"] = {"sequenceLength": 256, "globalBatchSize": 2, "maxSteps": 10, "gradientCheckpointing": True}
    job["spec"]["resources"] = {"gpus": "auto", "maxGPUs": 2, "strategy": "fsdp"}
    return job


def _profile_pod(lab, namespace: str, name: str) -> dict | None:
    """The job's profile pod: in the operator's namespace, never the tenant's."""
    pod_name = profile_pod_name(namespace, name)
    out = lab.kubectl("get", "pod", pod_name, "-n", h.RELEASE_NAMESPACE, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _run_profile_as_its_kubelet(lab, pod: dict, tmp_path) -> dict:
    """Run the pod's container command on its own request, here, and let kwok end the pod with the report."""
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    request = tmp_path / "request.json"
    request.write_text(env["FINETUNE_PROFILE_REQUEST"])
    report_path = tmp_path / "termination-log"
    command = container["command"]
    assert command[:3] == ["python", "-m", "finetune_trainer.profile"], command
    proc = subprocess.run([sys.executable, "-m", "finetune_trainer.profile", f"--request={request}",
                           f"--report-path={report_path}"], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
                               "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ":".join(sys.path)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    message = report_path.read_text()
    meta = pod["metadata"]
    lab.kubectl("annotate", "pod", meta["name"], "-n", meta["namespace"], "--overwrite",
                "lab.finetune.dev/exit-code=0", "lab.finetune.dev/container-reason=Completed",
                "lab.finetune.dev/pod-phase=Succeeded", "lab.finetune.dev/terminate-after=0s",
                f"lab.finetune.dev/termination-message={message}")
    return json.loads(message)


def test_an_unknown_family_is_planned_through_the_profile(lab, operator, namespace, tmp_path):
    start = time.monotonic()
    _config_map(lab, namespace)
    h.apply_job(lab, _neox_job("neox", namespace))
    pod = wait_for(lambda: (p := _profile_pod(lab, namespace, "neox")) and p["status"].get("phase") == "Running" and p,
                   60, "the profile pod running")
    job = h.get_job(lab, namespace, "neox")
    assert job["status"]["phase"] == "Pending" and not h.pytorch_jobs(lab, namespace, "neox")  # no GPU asked yet
    assert h.condition(job, "Profiled")["status"] == "Unknown"
    assert h.condition(job, "Profiled")["reason"] == "Profiling"
    # Bounded and safe, as rendered: no GPU, no token, non-root, a deadline, pinned to the job's region.
    spec = pod["spec"]
    assert "nvidia.com/gpu" not in json.dumps(spec["containers"][0]["resources"])
    assert spec["automountServiceAccountToken"] is False and spec["activeDeadlineSeconds"] > 0
    assert spec["securityContext"]["runAsNonRoot"] is True
    # In the operator's namespace, labelled with its job's uid (no ownerReference crosses namespaces);
    # nothing was created in the tenant's namespace, where the operator may create no pod at all.
    assert pod["metadata"]["namespace"] == h.RELEASE_NAMESPACE and "ownerReferences" not in pod["metadata"]
    assert pod["metadata"]["labels"][PROFILE_UID_LABEL] == job["metadata"]["uid"]
    assert not json.loads(lab.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    traced = time.monotonic()
    report = _run_profile_as_its_kubelet(lab, pod, tmp_path)
    assert report["ok"] and report["shape"]["modelType"] == "falcon" and len(report["measurements"]) == 4
    traced = time.monotonic() - traced

    planned = h.wait_phase(lab, namespace, "neox", ("Launching", "Running", "Succeeded"), timeout=90)
    profiled = h.condition(planned, "Profiled")
    assert profiled["status"] == "True" and "falcon" in profiled["message"], profiled
    plan = planned["status"]["plan"]
    assert "measured" in plan["breakdown"] and plan["strategy"] == "fsdp", plan
    assert h.pytorch_jobs(lab, namespace, "neox")
    wait_for(lambda: _profile_pod(lab, namespace, "neox") is None, 30, "the finished profile pod deleted")
    cache = json.loads(lab.kubectl("get", "configmap", "finetune-operator-profiles", "-n", h.RELEASE_NAMESPACE,
                                   "-o", "json").stdout)
    assert sum(1 for k in cache["data"] if not k.endswith((".model", ".written"))) >= 4
    described = lab.kubectl("describe", "ftj", "neox", "-n", namespace).stdout
    assert "Profiled" in described and "pre-flight profile" in described

    # The same model again: planned from the cache, no pod.
    h.apply_job(lab, _neox_job("neox-again", namespace))
    again = h.wait_phase(lab, namespace, "neox-again", ("Launching", "Running", "Succeeded"), timeout=60)
    assert h.condition(again, "Profiled")["status"] == "True"
    assert _profile_pod(lab, namespace, "neox-again") is None
    print(f"profile scenario: {time.monotonic() - start:.1f} s (profile traced in {traced:.1f} s)")


def test_a_run_that_used_more_than_predicted_corrects_later_plans_of_its_kind(lab, operator, namespace):
    # The teacher's first attempt runs out of GPU memory: the fake GPU's OOM report says how much was allocated.
    teacher = h.job_from_example("llama-8b-lora.yaml", "teacher", namespace,
                                 rule={"outcome-by-attempt": "gpu-oom,succeed", "true-peak-factor": "1.3",
                                       "run-duration": "1s"})
    teacher["spec"]["recovery"] = {"maxAttempts": 3, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    h.apply_job(lab, teacher)
    done = h.wait_phase(lab, namespace, "teacher", ("Succeeded", "Failed"), timeout=120)
    first = done["status"]["attempts"][0]
    assert first["outcome"] == "GPUOutOfMemory" and first["observedPeak"], first
    # The kind is keyed by the image the job ran: the chart's trainer image (the example names none).
    policy = json.loads(lab.kubectl("get", "configmap", f"{h.RELEASE}-finetune-operator-policy", "-n",
                                    h.RELEASE_NAMESPACE, "-o", "json").stdout)["data"]["policy.yaml"]
    image = load_policy(policy).trainer_image
    kind = C.Kind(first["plan"]["gpuType"], "llama", first["plan"]["method"], first["plan"]["strategy"], image)

    def learned():
        out = lab.kubectl("get", "configmap", "finetune-operator-calibration", "-n", h.RELEASE_NAMESPACE, "-o", "json",
                          check=False)
        if out.returncode != 0:
            return None
        entry = (json.loads(out.stdout).get("data") or {}).get(kind.key)
        return C.Learned.from_json(entry) if entry else None

    entry = wait_for(learned, 30, f"the calibration of {kind.key} learned")
    # What the OOM report says was allocated when it failed (the fake GPU: 97% of the card), over the prediction.
    ratio = _gib(first["observedPeak"]) / _gib(first["predictedPeak"])
    assert entry.runs >= 1 and abs(entry.last_ratio - ratio) < 0.01 and entry.factor == C.bounded(entry.factor), entry
    assert entry.factor > 1.0

    # A later job of the same kind (its GPU type and strategy fixed to the teacher's first plan's).
    student = h.job_from_example("llama-8b-lora.yaml", "student", namespace, rule={"outcome": "succeed",
                                                                                  "run-duration": "60s"})
    student["spec"]["resources"].update(strategy=kind.strategy, gpuTypes=[kind.gpu])
    h.apply_job(lab, student)
    planned = h.wait_phase(lab, namespace, "student", ("Launching", "Running", "Succeeded"))
    plan = planned["status"]["plan"]
    assert (plan["gpuType"], plan["method"], plan["strategy"]) == (kind.gpu, kind.method, kind.strategy)
    assert abs(plan["calibration"] - entry.factor) < 1e-3, plan
    assert plan["calibration"] > first["plan"].get("calibration", 1.0)  # planned before it was learned
    assert f"learned from {entry.runs} run(s) of lora {kind.strategy} llama on {kind.gpu}" in plan["reason"], plan["reason"]
    described = " ".join(lab.kubectl("describe", "ftj", "student", "-n", namespace).stdout.split())
    assert f"learned from {entry.runs} run(s)" in described, described[-3000:]


def test_the_profile_cache_stays_under_the_api_servers_size_limit(lab, namespace):
    """The real API server, on what the unit tests' fake plays (tests/operator/fake_kube.py): a
    ConfigMap over 1 MiB is refused with 422, and the cache write's merge patch deletes the models it
    evicts (nulls) while it adds the new one, in one request."""
    from finetune_operator.shell.cluster import Cluster
    from finetune_operator.profiling.cache import CACHE_BUDGET_BYTES, CACHE_CONFIGMAP, data_bytes, evictions
    from finetune_operator.shell.profiling import merge_into_config_map
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    cluster = Cluster(lab.api_client())
    old = {}
    # 200 models written on distinct days of 2025: values 1.5 KB short of the 1 MiB limit (the API
    # server counts the values, not the keys).
    for n in range(200):
        old[f"{n:016x}.written"] = f"2025-{1 + n % 12:02d}-{1 + n // 12:02d}T00:00:00Z"
        old[f"{n:016x}.model"] = "x" * 5215
    cluster.core.create_namespaced_config_map(namespace, {"metadata": {"name": CACHE_CONFIGMAP}, "data": old})
    new = {"ffffffffffffffff.model": "y" * 4000, "ffffffffffffffff.written": "2026-12-01T00:00:00Z"}
    with pytest.raises(ApiException) as refused:
        merge_into_config_map(cluster, namespace, CACHE_CONFIGMAP, new, "profile-cache")
    assert refused.value.status == 422 and "Too long: may not be more than 1048576 bytes" in refused.value.body

    data = merge_into_config_map(cluster, namespace, CACHE_CONFIGMAP, new, "profile-cache", evict=evictions)
    stored = client.CoreV1Api(lab.api_client()).read_namespaced_config_map(CACHE_CONFIGMAP, namespace).data
    assert stored == data and data_bytes(stored) <= CACHE_BUDGET_BYTES
    assert stored["ffffffffffffffff.written"] == "2026-12-01T00:00:00Z"
    gone = sorted(value for key, value in old.items() if key.endswith(".written") and key not in stored)
    kept = sorted(value for key, value in stored.items() if key.endswith(".written") and value.startswith("2025"))
    assert gone and kept and max(gone) < min(kept)
    assert all(key.replace(".written", ".model") in stored for key in stored if key.endswith(".written"))
