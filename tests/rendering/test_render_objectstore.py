"""Models, data and outputs in S3-compatible object storage: the init containers that fetch, the
master's upload sidecar, credentials only through secretKeyRef and only in the containers that
transfer, and the endpoint checked against the regions the job may use."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from manifest_checks import attempt_errors
from render_factories import plan_for, policy, pool

from finetune_operator import api
from finetune_operator.rendering import RenderError, render_attempt
from finetune_operator.rendering.layout import layout_of
from finetune_operator.rendering.output import manifests_yaml

GOLDEN = Path(__file__).parent / "golden" / "objectstore" / "s3-model-data-output.yaml"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
BERLIN = "https://s3.eu-de-berlin.example"
PARIS = "https://s3.eu-fr-paris.example"


def s3(endpoint: str = BERLIN, bucket: str = "team-a", key: str = "", secret: str = "s3-team-a") -> dict:
    return {"endpoint": endpoint, "bucket": bucket, "key": key, "credentialsSecretRef": {"name": secret}}


def storage_policy(**overrides):
    fields = {
        "object_storage": [
            {"endpoint": BERLIN, "region": "eu-de-berlin"},
            {"endpoint": PARIS, "region": "eu-fr-paris"},
        ]
    }
    fields.update(overrides)
    return policy(**fields)


def s3_job(lora_job, *, model=True, data_key="support/train.jsonl", output=True, **data) -> api.FineTuneJob:
    spec = lora_job["spec"]
    if model:
        spec["model"]["source"] = {"s3": s3(key="models/llama-3.1-8b", secret="s3-models")}
    spec["dataset"]["source"] = {"s3": s3(key=data_key, **data)}
    if output:
        spec["output"] = {"s3": s3(key="results/support-bot/")}
    return api.parse_job(lora_job)


def master(rendered) -> dict:
    return rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def trainer(rendered) -> dict:
    return json.loads(rendered.config_map["data"]["config.json"])


def _millicores(quantity: str) -> int:
    return int(quantity[:-1]) if quantity.endswith("m") else int(quantity) * 1000


@pytest.mark.parametrize("cpus, gpus_per_node, gpus", [(2, 2, 2), (192, 8, 2), (192, 8, 8), (16, 1, 1)])
def test_the_master_pod_with_its_upload_sidecar_stays_within_its_cpu_share(lora_job, cpus, gpus_per_node, gpus):
    """The sidecar's CPU comes out of the pod's share of the node, not on top of it: on the lab's real
    node (2 CPUs, 2 GPUs) the sidecar's whole CPU on top left the pod unschedulable."""
    from finetune_operator.rendering import pod

    job = s3_job(lora_job, model=False)
    node = pool(cpus=cpus, gpus_per_node=gpus_per_node)
    rendered = render_attempt(job, plan_for(job, node, gpus_per_node=gpus), 1, storage_policy())
    spec = master(rendered)
    long_running = [c for c in spec["initContainers"] if c.get("restartPolicy") == "Always"] + spec["containers"]
    assert [c["name"] for c in long_running] == ["upload", "pytorch"]
    total = sum(_millicores(c["resources"]["requests"]["cpu"]) for c in long_running)
    share = max(1000 + pod.UPLOAD_CPU_MILLIS, cpus * 1000 * pod.CPU_SHARE * gpus // gpus_per_node)
    assert total <= share, (total, share)
    assert _millicores(spec["containers"][0]["resources"]["requests"]["cpu"]) >= 1000


def test_s3_model_data_and_output_render_init_containers_and_an_upload_sidecar(lora_job):
    job = s3_job(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, storage_policy())
    spec = master(rendered)
    fetch_model, fetch_data, upload = spec["initContainers"]
    assert fetch_model["name"] == "fetch-model" and fetch_data["name"] == "fetch-data"
    assert fetch_model["command"] == [
        "python", "-m", "finetune_trainer.objectstore", "fetch", f"--endpoint={BERLIN}", "--bucket=team-a",
        "--key=models/llama-3.1-8b/", "--signing-region=us-east-1", "--dest=/mnt/model", "--phase=load",
    ]
    assert fetch_data["command"][4:] == [
        f"--endpoint={BERLIN}", "--bucket=team-a", "--key=support/train.jsonl", "--signing-region=us-east-1",
        "--dest=/mnt/data", "--phase=data",
    ]
    # Each fetch writes only its own emptyDir; the trainer mounts both read-only.
    assert [m["name"] for m in fetch_model["volumeMounts"]] == ["model", "scratch"]
    assert [m["name"] for m in fetch_data["volumeMounts"]] == ["data", "scratch"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["model"] == {"name": "model", "emptyDir": {}} and volumes["data"] == {"name": "data", "emptyDir": {}}
    assert volumes["output"] == {"name": "output", "emptyDir": {}}
    assert volumes["handoff"] == {"name": "handoff", "emptyDir": {"sizeLimit": "1Mi"}}
    (container,) = spec["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model"]["readOnly"] is True and mounts["data"]["readOnly"] is True
    assert mounts["output"] == {"name": "output", "mountPath": "/mnt/output"}
    assert mounts["handoff"] == {"name": "handoff", "mountPath": "/mnt/handoff"}
    assert container["command"] == [
        "python", "-m", "finetune_trainer.objectstore", "train-and-hand-off", "--handoff=/mnt/handoff", "--",
        "--config", "/etc/finetune/config.json", "--nnodes=1", "--nproc-per-node=2",
    ]
    # The upload: a native sidecar after the fetches, reading the output, small fixed resources.
    assert upload["name"] == "upload" and upload["restartPolicy"] == "Always"
    assert upload["command"] == [
        "python", "-m", "finetune_trainer.objectstore", "upload-sidecar", f"--endpoint={BERLIN}", "--bucket=team-a",
        "--key=results/support-bot/", "--signing-region=us-east-1", "--source=/mnt/output", "--handoff=/mnt/handoff",
    ]
    assert {m["name"]: m.get("readOnly", False) for m in upload["volumeMounts"]} == {
        "output": True, "handoff": False, "scratch": False}
    assert upload["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": "500m", "memory": "512Mi"}}
    config = trainer(rendered)
    assert config["model"]["path"] == "/mnt/model"
    assert config["dataset"]["path"] == "/mnt/data/train.jsonl"
    assert config["outputDirectory"] == "/mnt/output"
    # The same security contexts as the trainer, Guaranteed resources, no GPUs.
    for init in (fetch_model, fetch_data, upload):
        assert init["securityContext"] == container["securityContext"]
        assert init["resources"]["requests"] == init["resources"]["limits"]
        assert "nvidia.com/gpu" not in init["resources"]["limits"]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert attempt_errors(rendered.config_map, rendered.pytorch_job) == []


def test_only_the_master_uploads_and_workers_train_without_a_sidecar(lora_job):
    job = s3_job(lora_job)
    rendered = render_attempt(job, plan_for(job, nodes=2), 1, storage_policy())
    worker = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert [c["name"] for c in worker["initContainers"]] == ["fetch-model", "fetch-data"]
    assert worker["containers"][0]["command"][:3] == ["python", "-m", "finetune_trainer.launch"]
    assert [c["name"] for c in master(rendered)["initContainers"]] == ["fetch-model", "fetch-data", "upload"]


def test_credentials_come_only_from_the_secret_and_only_into_the_transfer_containers(lora_job):
    job = s3_job(lora_job)
    rendered = render_attempt(job, plan_for(job, nodes=2), 1, storage_policy())
    spec = master(rendered)
    fetch_model, fetch_data, upload = spec["initContainers"]
    (container,) = spec["containers"]

    def s3_env(c):
        return {e["name"]: e for e in c["env"] if e["name"].startswith("FINETUNE_S3_")}

    assert s3_env(fetch_model) == {
        "FINETUNE_S3_ACCESS_KEY_ID": {"name": "FINETUNE_S3_ACCESS_KEY_ID",
                                      "valueFrom": {"secretKeyRef": {"name": "s3-models", "key": "accessKeyId"}}},
        "FINETUNE_S3_SECRET_ACCESS_KEY": {"name": "FINETUNE_S3_SECRET_ACCESS_KEY",
                                          "valueFrom": {"secretKeyRef": {"name": "s3-models", "key": "secretAccessKey"}}},
    }
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in s3_env(fetch_data).values()} == {"s3-team-a"}
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in s3_env(upload).values()} == {"s3-team-a"}
    for c in (fetch_model, fetch_data, upload):
        assert all("value" not in e for e in s3_env(c).values())
        assert not any("secret" in arg.lower() for arg in c["command"])
    # The training containers (master and worker) hold no credential of any kind.
    worker = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    for training in (container, worker):
        assert not any("valueFrom" in e for e in training["env"]) and "envFrom" not in training
        assert not any(e["name"].startswith("FINETUNE_S3_") or e["name"] == "HF_TOKEN" for e in training["env"])
    # The trainer config says where, never with what key.
    config_text = rendered.config_map["data"]["config.json"]
    assert "s3-team-a" not in config_text and "FINETUNE_S3" not in config_text and "s3.eu-de-berlin" not in config_text


def test_custom_secret_keys_and_a_data_folder(lora_job):
    job = s3_job(lora_job, model=False, output=False, data_key="support/")
    lora_job["spec"]["dataset"]["source"]["s3"]["credentialsSecretRef"] = {
        "name": "minio", "accessKeyIdKey": "AWS_ACCESS_KEY_ID", "secretAccessKeyKey": "AWS_SECRET_ACCESS_KEY"}
    job = api.parse_job(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, storage_policy())
    spec = master(rendered)
    (fetch_data,) = spec["initContainers"]
    refs = [e["valueFrom"]["secretKeyRef"] for e in fetch_data["env"] if "valueFrom" in e]
    assert refs == [{"name": "minio", "key": "AWS_ACCESS_KEY_ID"}, {"name": "minio", "key": "AWS_SECRET_ACCESS_KEY"}]
    assert trainer(rendered)["dataset"]["path"] == "/mnt/data"
    # Model on a volume, no output: the trainer runs as before, without the upload step.
    assert spec["containers"][0]["command"][:3] == ["python", "-m", "finetune_trainer.launch"]
    assert not any(e["name"].startswith("FINETUNE_S3_") for e in spec["containers"][0]["env"])


def test_a_key_that_looks_like_an_option_stays_a_value(lora_job):
    job = s3_job(lora_job, model=False, output=False, data_key="--dest=/etc/x.jsonl")
    (fetch_data,) = master(render_attempt(job, plan_for(job), 1, storage_policy()))["initContainers"]
    assert "--key=--dest=/etc/x.jsonl" in fetch_data["command"]
    assert [a for a in fetch_data["command"] if a.startswith("--dest")] == ["--dest=/mnt/data"]


def test_a_key_with_a_line_break_is_refused(lora_job):
    with pytest.raises(api.JobValidationError) as error:
        s3_job(lora_job, data_key="x\n  - --dest=/etc\n")
    assert [p.path for p in error.value.problems] == ["spec.dataset.source.s3.key"]


@pytest.mark.parametrize("key", ['a"], "command": ["sh", "-c', "{{ 7*7 }}/", "$(id)`id`;/", "--dest=/etc/"])
def test_a_hostile_key_is_one_argument_and_nothing_else(lora_job, key):
    job = s3_job(lora_job, data_key=key)
    rendered = render_attempt(job, plan_for(job), 1, storage_policy())
    (_, fetch_data, _) = master(rendered)["initContainers"]
    assert [a for a in fetch_data["command"] if a.startswith("--key=")] == [f"--key={key}"]
    assert len(fetch_data["command"]) == 10 and fetch_data["command"][-2:] == ["--dest=/mnt/data", "--phase=data"]
    assert set(master(rendered)) == {"enableServiceLinks", "automountServiceAccountToken", "securityContext", "affinity", "tolerations",
                                     "initContainers", "containers", "volumes"}
    assert attempt_errors(rendered.config_map, rendered.pytorch_job) == []


def test_an_endpoint_the_policy_does_not_list_is_named(lora_job):
    job = s3_job(lora_job, model=False, output=False, endpoint="https://s3.elsewhere.example")
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job), 1, storage_policy())
    assert error.value.path == "spec.dataset.source.s3.endpoint"
    assert "not an object storage endpoint the cluster policy allows" in error.value.message
    with pytest.raises(RenderError) as error:
        layout_of(job.spec, storage_policy())
    assert error.value.path == "spec.dataset.source.s3.endpoint"
    layout_of(job.spec)  # without the policy only the shape is checked


def test_an_endpoint_in_a_region_the_job_may_not_use_is_named(lora_job):
    # Paris's storage, a job placed in Berlin: the data would cross the border.
    job = s3_job(lora_job, model=False, output=False, endpoint=PARIS)
    with pytest.raises(RenderError) as error:
        layout_of(job.spec, storage_policy())
    assert error.value.path == "spec.dataset.source.s3.endpoint"
    assert "eu-fr-paris" in error.value.message and "eu-de-berlin" in error.value.message
    # The policy may say that Paris's storage may be read from Berlin: then it renders.
    readable = storage_policy(object_storage=[{"endpoint": PARIS, "region": "eu-fr-paris",
                                               "accessible_from": ["eu-fr-paris", "eu-de-berlin"]}])
    render_attempt(job, plan_for(job), 1, readable)
    # A region the cluster policy does not allow is no way around it.
    outside = storage_policy(allowed_regions=["eu-fr-paris"])
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job, pool(name="a100-paris", region="eu-fr-paris")), 1, outside)
    assert error.value.path == "plan.allowedRegions"


def test_the_output_endpoint_is_checked_too(lora_job):
    lora_job["spec"]["output"] = {"s3": s3(endpoint=PARIS, key="out/")}
    job = api.parse_job(lora_job)
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job), 1, storage_policy())
    assert error.value.path == "spec.output.s3.endpoint"


def test_a_plan_outside_the_storage_regions_is_refused(lora_job):
    # The job may use Berlin and Paris, its data may be read only in Paris: a Berlin plan is refused.
    lora_job["spec"]["placement"]["regions"] = ["eu-de-berlin", "eu-fr-paris"]
    job = s3_job(lora_job, model=False, output=False, endpoint=PARIS)
    berlin_plan = plan_for(job, allowed_regions=["eu-de-berlin", "eu-fr-paris"])
    with pytest.raises(RenderError) as error:
        render_attempt(job, berlin_plan, 1, storage_policy())
    assert error.value.path == "plan.allowedRegions" and "object storage" in error.value.message
    paris = pool(name="a100-paris", region="eu-fr-paris", selector={"karpenter.sh/nodepool": "a100-paris"})
    rendered = render_attempt(job, plan_for(job, paris), 1, storage_policy())
    (term,) = master(rendered)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["eu-fr-paris"]} in term["matchExpressions"]


def test_s3_job_matches_its_golden_file(lora_job):
    job = s3_job(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, storage_policy())
    text = manifests_yaml(rendered.objects)
    if UPDATE:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"renders differently from {GOLDEN.name} (UPDATE_GOLDEN=1 after review)"
    assert all(doc for doc in yaml.safe_load_all(text))


def test_an_eval_dataset_in_object_storage_is_fetched_and_narrows_the_regions(lora_job):
    lora_job["spec"]["evaluation"] = {"dataset": {"s3": s3(endpoint=PARIS, key="evals/support.jsonl")}}
    lora_job["spec"]["placement"]["regions"] = ["eu-de-berlin", "eu-fr-paris"]
    job = api.parse_job(lora_job)
    from finetune_operator.planning.storage import storage_regions

    assert storage_regions(job.spec, storage_policy()) == ["eu-fr-paris"]
    plan = plan_for(job, node_pool=pool(region="eu-fr-paris"))
    rendered = render_attempt(job, plan, 1, storage_policy())
    spec = master(rendered)
    (fetch_eval,) = spec["initContainers"]
    assert fetch_eval["name"] == "fetch-eval"
    assert fetch_eval["command"][4:] == [f"--endpoint={PARIS}", "--bucket=team-a", "--key=evals/support.jsonl",
                                         "--signing-region=us-east-1", "--dest=/mnt/eval", "--phase=data"]
    assert {"name": "eval", "emptyDir": {}} in spec["volumes"]
    assert {"name": "eval", "mountPath": "/mnt/eval", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    assert trainer(rendered)["evaluation"]["dataset"]["path"] == "/mnt/eval/support.jsonl"
    # Its endpoint gets an egress rule of its own in the attempt's NetworkPolicy.
    egress = rendered.network_policy["spec"]["egress"]
    assert {"ports": [{"protocol": "TCP", "port": 443}]} in egress
