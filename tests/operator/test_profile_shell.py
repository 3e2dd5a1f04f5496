"""The profile and calibration shell on the strict fake API: the real Cluster/Reconciler create the
profile pod, read its report, cache it in the operator namespace, plan from it and delete the pod;
the calibration store reads and merge-patches its ConfigMap and shows the factors in metrics."""

from __future__ import annotations

import json

from finetune_operator.shell import metrics
from finetune_operator.calibration import Kind, Learned
from finetune_operator.shell.calibration_store import CALIBRATION_CONFIGMAP, CalibrationStore
from finetune_operator.profiling.cache import CACHE_BUDGET_BYTES, CACHE_CONFIGMAP, data_bytes
from finetune_operator.profiling.pod import PROFILE_UID_LABEL, profile_pod_name
from finetune_operator.profiling.setups import job_profile
from finetune_operator.shell.profiling import ProfileShell
from finetune_trainer.contract import PROFILE_PHASES, ProfileMeasurement, ProfileReport, ProfileRequest, ProfileShape

from reconcile_world import NAMESPACE, ReconcileWorld, job_document

OPERATOR_NS = "finetune-system"
CONFIG = {"model_type": "falcon", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4}


def _world() -> ReconcileWorld:
    doc = job_document(
        model={"name": "neox", "architecture": {"configMapRef": {"name": "neox"}},
               "source": {"pvc": {"claimName": "models"}}},
        training={"sequenceLength": 512, "globalBatchSize": 8, "maxSteps": 10, "gradientCheckpointing": True},
        resources={"gpus": "auto", "maxGPUs": 8, "strategy": "fsdp"})
    world = ReconcileWorld(doc)
    world.kube.put("ConfigMap", {"metadata": {"name": "neox", "namespace": NAMESPACE},
                                 "data": {"config.json": json.dumps(CONFIG)}})
    world.reconciler.profiles = ProfileShell(world.reconciler.cluster, OPERATOR_NS)
    return world


def _report(request: ProfileRequest) -> ProfileReport:
    shape = ProfileShape(model_type="falcon", hidden_size=128, num_layers=2, vocab_size=1024, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=32, intermediate_size=512)
    return ProfileReport(ok=True, shape=shape, params={"total": 700_000, "embedding": 131_072, "lmHead": 131_072},
                         measurements=[ProfileMeasurement(key=s.key, trainable_params=5000,
                                                          peaks={p: 10**7 * s.micro_batch_size + 10**8 // s.world_size
                                                                 for p in PROFILE_PHASES})
                                       for s in request.setups])


def _finish(world: ReconcileWorld, pod: dict) -> ProfileRequest:
    env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
    request = ProfileRequest.model_validate_json(env["FINETUNE_PROFILE_REQUEST"])
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [{"name": "profile", "state": {"terminated": {
        "exitCode": 0, "message": _report(request).to_termination_message()}}}]}
    world.kube.touch(pod)
    return request


def test_the_shell_profiles_caches_plans_and_cleans_up():
    world = _world()
    world.reconcile()
    # The profile pod runs in the operator's namespace (no pod is ever created in the tenant's), labelled
    # with its job's uid.
    assert not world.kube.of_kind("Pod", NAMESPACE)
    [pod] = world.kube.of_kind("Pod", OPERATOR_NS)
    assert pod["metadata"]["labels"][PROFILE_UID_LABEL] == world.kube.get("FineTuneJob", NAMESPACE, world.name)["metadata"]["uid"]
    assert not world.kube.of_kind("PyTorchJob", NAMESPACE)
    world.reconcile()  # still running: nothing new
    assert len(world.kube.of_kind("Pod", OPERATOR_NS)) == 1
    # micro-batch 1, 2, 4, 8 x GPUs 1, 2, 4, 8: 16 setups, 12 in the first pod, the rest in a second.
    first = _finish(world, pod)
    assert len(first.setups) == 12 and first.config["model_type"] == "falcon"
    world.reconcile()
    cache = world.kube.get("ConfigMap", OPERATOR_NS, CACHE_CONFIGMAP)
    assert cache is not None and len(cache["data"]) == 14  # twelve setups, the model, when it was written
    assert not world.kube.of_kind("Pod", OPERATOR_NS) and not world.kube.of_kind("PyTorchJob", NAMESPACE)
    world.reconcile()
    [pod] = world.kube.of_kind("Pod", OPERATOR_NS)
    second = _finish(world, pod)
    assert len(second.setups) == 4 and not {s.key for s in second.setups} & {s.key for s in first.setups}
    world.reconcile()
    assert len(world.kube.get("ConfigMap", OPERATOR_NS, CACHE_CONFIGMAP)["data"]) == 18
    assert world.kube.of_kind("PyTorchJob", NAMESPACE), "planned from the profile"
    assert not world.kube.of_kind("Pod", OPERATOR_NS), "the finished profile pod is deleted"
    status = world.kube.get("FineTuneJob", NAMESPACE, world.name)["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Profiled"] == "True"


def test_a_full_cache_evicts_the_least_recently_written_models_to_take_a_new_one():
    """The API server refuses a ConfigMap over 1 MiB (so does the fake): without evictions the
    cache write would fail on every reconcile and the job would never be planned."""
    world = _world()
    world.reconciler.profiles.clock = lambda: 1796083200.0  # 2026-12-01T00:00:00Z
    old = {}
    for n in range(200):  # 200 models written on distinct days of 2025, 1.5 KB short of the 1 MiB limit
        digest = f"{n:016x}"
        old[f"{digest}.written"] = f"2025-{1 + n % 12:02d}-{1 + n // 12:02d}T00:00:00Z"
        old[f"{digest}.model"] = "x" * 5215
    assert 1024 * 1024 - 2048 < sum(len(value) for value in old.values()) < 1024 * 1024
    world.kube.put("ConfigMap", {"metadata": {"name": CACHE_CONFIGMAP, "namespace": OPERATOR_NS}, "data": old})
    world.reconcile()
    [pod] = world.kube.of_kind("Pod", OPERATOR_NS)
    _finish(world, pod)
    world.reconcile()
    data = world.kube.get("ConfigMap", OPERATOR_NS, CACHE_CONFIGMAP)["data"]
    assert data_bytes(data) <= CACHE_BUDGET_BYTES
    new = {key.split(".")[0] for key in data} - {key.split(".")[0] for key in old}
    [digest] = new
    assert len([key for key in data if key.startswith(digest)]) == 14
    assert data[f"{digest}.written"] == "2026-12-01T00:00:00Z"
    kept = sorted(data[key] for key in data if key.endswith(".written") and not key.startswith(digest))
    evicted = sorted(value for key, value in old.items() if key.endswith(".written") and key not in data)
    assert evicted and kept and max(evicted) < min(kept), "the least recently written models went first"
    assert all(f"{key.split('.')[0]}.model" in data for key in data if key.endswith(".written")), "whole models"
    world.reconcile()
    assert len(world.kube.of_kind("Pod", OPERATOR_NS)) == 1, "the next pod, for the four setups left"


def test_a_foreign_pod_holding_the_name_is_never_read_or_deleted():
    from finetune_operator.profiling.setups import config_hash

    world = _world()
    # Someone else's pod under the profile pod's name, even with a failure report for this very config:
    # its report must not fail the job, and it is never deleted.
    lie = ProfileReport(ok=False, error="not ours", error_field="config").to_termination_message()
    name = profile_pod_name(NAMESPACE, world.name)
    world.kube.put("Pod", {"metadata": {"name": name, "namespace": OPERATOR_NS,
                                        "annotations": {"finetune.dev/profile-config": config_hash(CONFIG, world.policy.trainer_image)}},
                           "status": {"phase": "Failed", "containerStatuses": [{"name": "profile", "state": {
                               "terminated": {"exitCode": 78, "message": lie}}}]}})
    world.reconcile()
    status = world.kube.get("FineTuneJob", NAMESPACE, world.name)["status"]
    assert status["phase"] != "Failed"
    blocked = {c["type"]: c for c in status["conditions"]}.get("Blocked")
    assert blocked is not None and blocked["reason"] == "NameConflict" and name in blocked["message"]
    assert world.kube.get("Pod", OPERATOR_NS, name) is not None
    world.reconciler.profiles.sweep()
    assert world.kube.get("Pod", OPERATOR_NS, name) is not None, "a pod the operator did not render is not swept"


def test_the_sweep_deletes_profile_pods_whose_job_is_gone():
    """No garbage collector follows a job into the operator's namespace: a job deleted while its profile
    runs (or replaced by another of its name) leaves a pod that the leader's sweep deletes."""
    world = _world()
    world.reconcile()
    [pod] = world.kube.of_kind("Pod", OPERATOR_NS)
    assert world.reconciler.profiles.sweep() == 0, "its job exists: kept"
    job = world.kube.get("FineTuneJob", NAMESPACE, world.name)
    world.kube.remove("FineTuneJob", NAMESPACE, world.name)
    world.kube.put("FineTuneJob", {**job, "metadata": {**job["metadata"], "uid": "another-uid"}})
    assert world.reconciler.profiles.sweep() == 1, "the job of that name is another one"
    assert not world.kube.of_kind("Pod", OPERATOR_NS)
    world.kube.remove("FineTuneJob", NAMESPACE, world.name)
    world.kube.put("Pod", pod)
    assert world.reconciler.profiles.sweep() == 1 and not world.kube.of_kind("Pod", OPERATOR_NS)


def test_the_calibration_store_merges_its_keys_and_shows_them(caplog):
    world = ReconcileWorld(job_document())
    store = CalibrationStore(world.reconciler.cluster, OPERATOR_NS, clock=lambda: 0.0)
    assert store.read() == {}
    lora = Kind("H100-80GB", "llama", "lora", "ddp", "registry.example/trainer:1")
    full = Kind("A100-80GB", "llama", "full", "fsdp", "registry.example/trainer:1")
    store.write({lora.key: Learned(1.2, 1, 1.2)})
    store.write({full.key: Learned(1.1, 2, 1.05)})
    data = world.kube.get("ConfigMap", OPERATOR_NS, CALIBRATION_CONFIGMAP)["data"]
    assert set(data) == {lora.key, full.key}
    assert metrics.CALIBRATION.labels("H100-80GB", "llama", "lora", "ddp", lora.image_hash)._value.get() == 1.2
    assert metrics.CALIBRATION_RUNS.labels("A100-80GB", "llama", "full", "fsdp", full.image_hash)._value.get() == 2
    # A factor outside its bounds in the ConfigMap (written by hand, or by anything but the rule) is refused.
    forged = Kind("H100-80GB", "llama", "lora", "fsdp", "registry.example/trainer:1")
    world.kube.get("ConfigMap", OPERATOR_NS, CALIBRATION_CONFIGMAP)["data"][forged.key] = Learned(0.2, 9, 0.2).to_json()
    store._table = None
    with caplog.at_level("WARNING", logger="finetune_operator.calibration"):
        assert set(store.read()) == {lora.key, full.key}
    assert "refused" in caplog.text and "0.2" in caplog.text
