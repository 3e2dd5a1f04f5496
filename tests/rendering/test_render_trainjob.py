"""What render_trainjob produces (the Kubeflow Trainer v2 backend), checked against the upstream TrainJob
CRD of the Trainer release the lab pins, and against render_attempt's PyTorchJob: both backends must
pin, size, label and secure their pods by the same rules."""

from __future__ import annotations

import os

import jsonschema
import pytest
from manifest_checks import metadata_errors, pod_errors
from render_factories import plan_for, policy
from test_render_objectstore import BERLIN, s3, s3_job, storage_policy
from upstream_crd import UpstreamCrdMissing, trainjob_schema

from finetune_operator import api
from finetune_operator.rendering import RenderError, render_attempt, render_config_map, render_trainjob
from finetune_operator.rendering.trainjob import PATCH_MANAGER, _as_go_writes_it, pod_template_patch


def _required() -> bool:
    return os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no")


def trainjob_errors(train_job: dict) -> list[str]:
    """What the API server would refuse: the upstream schema (strict: unknown fields are errors, not
    silently pruned), the CRD's name rule (a DNS-1035 label of at most 63 characters), label values."""
    try:
        schema = trainjob_schema()
    except UpstreamCrdMissing as missing:
        if _required():
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but the TrainJob CRD is missing: {missing}", pytrace=False)
        pytest.skip(f"the upstream TrainJob CRD is not available: {missing}")
    validator = jsonschema.Draft7Validator(schema)
    problems = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(train_job)]
    problems += metadata_errors(train_job["metadata"], "trainJob.metadata")
    template = pod_template_patch(train_job)
    # The patch holds the pod's labels, annotations, affinity, tolerations and volumes (containers
    # come from the runtime); pod_errors checks them as it does a PyTorchJob's pod template.
    problems += pod_errors(template, "trainJob.runtimePatches")
    return problems


def job_of(document: dict, **spec_updates) -> api.FineTuneJob:
    document["spec"].update(spec_updates)
    return api.parse_job(document)


@pytest.mark.parametrize(
    "nodes, gpus, spec_updates",
    [
        (1, 2, {}),
        (4, 8, {}),
        (1, 8, {"queueName": "team-a-gpus"}),
        (2, 4, {"suspend": True}),
    ],
)
def test_trainjob_is_valid_against_the_upstream_crd(lora_job, nodes, gpus, spec_updates):
    job = job_of(lora_job, **spec_updates)
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "0f3c1d2e-1111-2222-3333-444455556666"})})
    train_job = render_trainjob(job, plan_for(job, nodes=nodes, gpus_per_node=gpus), 2, policy())
    assert trainjob_errors(train_job) == []


def test_one_trainjob_per_attempt_named_like_the_pytorchjob_and_its_configmap(lora_job):
    job = job_of(lora_job)
    plan = plan_for(job, nodes=2, gpus_per_node=8)
    for attempt in (1, 2, 7):
        train_job = render_trainjob(job, plan, attempt, policy())
        rendered = render_attempt(job, plan, attempt, policy())
        config_map, _ = render_config_map(job, plan, attempt, policy())
        assert train_job["metadata"]["name"] == rendered.name == config_map["metadata"]["name"] == f"demo-a{attempt}"
        assert config_map == rendered.config_map
        assert train_job == render_trainjob(job, plan, attempt, policy())  # deterministic


def test_gpu_count_goes_through_num_nodes_and_resources_per_node(lora_job):
    job = job_of(lora_job)
    plan = plan_for(job, nodes=4, gpus_per_node=8)
    spec = render_trainjob(job, plan, 3, policy())["spec"]
    trainer = spec["trainer"]
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["requests"] == trainer["resourcesPerNode"]["limits"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert spec["runtimeRef"] == {"name": "finetune-torch", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"}
    assert render_trainjob(job, plan, 3, policy(), runtime="ours")["spec"]["runtimeRef"]["name"] == "ours"


def test_the_pods_are_the_pytorchjobs_pods(lora_job):
    """Same command, env, image, resources, labels, annotations, affinity, tolerations, volumes and
    security as the PyTorchJob's pod template: one rule lives in one place (pod.py)."""
    job = job_of(lora_job, queueName="q")
    plan = plan_for(job, nodes=2, gpus_per_node=4)
    pytorch_pod = render_attempt(job, plan, 1, policy()).pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    train_job = render_trainjob(job, plan, 1, policy())
    patch = pod_template_patch(train_job)
    (container,) = pytorch_pod["spec"]["containers"]
    trainer = train_job["spec"]["trainer"]
    assert patch["metadata"] == pytorch_pod["metadata"]
    # The same objects, as Go writes them (no readOnly: false, no empty lists; see the next test).
    for key in ("securityContext", "affinity", "tolerations", "volumes"):
        assert patch["spec"].get(key) == _as_go_writes_it(pytorch_pod["spec"][key]) or (
            pytorch_pod["spec"][key] == [] and key not in patch["spec"]), key
    assert patch["spec"]["containers"] == [_as_go_writes_it(
        {"name": "node", "volumeMounts": container["volumeMounts"], "securityContext": container["securityContext"]})]
    assert trainer["command"] == container["command"] and trainer["env"] == container["env"]
    assert trainer["image"] == container["image"]
    assert trainer["resourcesPerNode"] == container["resources"]
    assert [p["manager"] for p in train_job["spec"]["runtimePatches"]] == [PATCH_MANAGER]


@pytest.mark.parametrize(
    "spec_updates, suspended",
    [({}, False), ({"suspend": True}, True), ({"queueName": "team-a-gpus"}, True)],
)
def test_suspended_when_the_user_says_so_or_a_queue_admits_it(lora_job, spec_updates, suspended):
    job = job_of(lora_job, **spec_updates)
    train_job = render_trainjob(job, plan_for(job), 1, policy())
    assert train_job["spec"]["suspend"] is suspended
    labels = train_job["metadata"]["labels"]
    assert labels.get("kueue.x-k8s.io/queue-name") == spec_updates.get("queueName")
    # The queue label is on the TrainJob (Kueue's workload), never on the pods.
    assert "kueue.x-k8s.io/queue-name" not in pod_template_patch(train_job)["metadata"]["labels"]


def test_owned_by_the_finetunejob(lora_job):
    lora_job["metadata"]["uid"] = "0f3c1d2e-1111-2222-3333-444455556666"
    job = job_of(lora_job)
    train_job = render_trainjob(job, plan_for(job), 1, policy())
    assert train_job["metadata"]["ownerReferences"] == [{
        "apiVersion": api.API_VERSION, "kind": api.KIND, "name": "demo",
        "uid": "0f3c1d2e-1111-2222-3333-444455556666", "controller": True, "blockOwnerDeletion": True,
    }]
    assert train_job["metadata"]["namespace"] == "team-a"


def test_a_source_that_needs_an_init_container_is_refused_naming_the_field(lora_job):
    # A runtime patch can only change containers the runtime has: it cannot add fetch-model.
    job = job_of(lora_job)
    hf = job_of(lora_job, model={**lora_job["spec"]["model"], "source": {"hf": {"repo": "org/m", "revision": "a" * 40}}})
    with pytest.raises(RenderError) as error:
        render_trainjob(hf, plan_for(hf), 1, policy())
    assert "spec.model.source" in str(error.value) and "fetch-model" in str(error.value)
    assert render_trainjob(job, plan_for(job), 1, policy())  # the pvc source renders


def test_an_s3_output_needs_the_upload_sidecar_which_a_trainjob_cannot_carry(lora_job):
    """The upload runs in a sidecar of its own (the training container never holds the keys); a
    TrainJob's runtime patch cannot add one, so an S3 output is refused naming spec.output."""
    lora_job["spec"]["output"] = {"s3": s3(key="results/demo/")}
    job = api.parse_job(lora_job)
    with pytest.raises(RenderError) as error:
        render_trainjob(job, plan_for(job), 1, storage_policy())
    assert error.value.path == "spec.output" and "upload" in str(error.value)
    with pytest.raises(RenderError):
        render_trainjob(s3_job(lora_job), plan_for(job), 1, storage_policy())  # fetches need init containers


def test_refuses_what_render_attempt_refuses(lora_job):
    job = job_of(lora_job)
    plan = plan_for(job)
    with pytest.raises(RenderError):
        render_trainjob(job, plan, 0, policy())
    outside = plan.model_copy(update={"allowed_regions": ["us-east-virginia"]})
    with pytest.raises(RenderError) as error:
        render_trainjob(job, outside, 1, policy())
    assert "plan.allowedRegions" in str(error.value)


def test_an_image_longer_than_the_crd_allows_is_refused_naming_the_field(lora_job):
    job = job_of(lora_job, image="registry.example/" + "a" * 490)
    with pytest.raises(RenderError) as error:
        render_trainjob(job, plan_for(job), 1, policy())
    assert "spec.image" in str(error.value)
    del lora_job["spec"]["image"]
    with pytest.raises(RenderError) as error:
        render_trainjob(job_of(lora_job), plan_for(job), 1, policy(trainer_image="r.example/" + "b" * 495))
    assert "policy.trainerImage" in str(error.value)


def _go_zero_values(node, path="") -> list[str]:
    """Paths of values Go's omitempty would drop on a round trip (readOnly: false, empty lists)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if (key == "readOnly" and value is False) or value == []:
                found.append(f"{path}.{key}")
            found += _go_zero_values(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _go_zero_values(value, f"{path}[{i}]")
    return found


def test_the_runtime_patch_reads_back_the_same_through_go_types(lora_job):
    """Kueue admits a TrainJob by updating it through Go types (omitempty drops readOnly: false and empty
    lists); Trainer's webhook refuses an update that changes our patch's containers or volumes as
    immutable. Seen on the lab: a job with a read-write checkpoint volume was never un-suspended."""
    from render_factories import pool

    document = dict(lora_job)
    document["spec"] = dict(lora_job["spec"], checkpoint={"pvc": {"claimName": "ckpt"}, "everySteps": 100},
                            queueName="q")
    job = job_of(document)
    for taints in ([], None):
        plan = plan_for(job, pool(taints=taints) if taints is not None else pool(), gpus_per_node=8)
        patch = pod_template_patch(render_trainjob(job, plan, 1, policy()))
        assert _go_zero_values(patch) == []
        mounts = {m["name"]: m for m in patch["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["checkpoints"].get("readOnly", False) is False and mounts["config"]["readOnly"] is True
