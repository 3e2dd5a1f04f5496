"""The pods the operator's objects make for the examples, as Pod manifests: what the restricted Pod
Security Standard (test_render_pod_security.py, e2e/test_lab_pod_security.py) and the scanner
(tests/chart/test_checkov.py) look at.

- PyTorchJob: each replica's pod template as the training operator copies it into a Pod;
- TrainJob: the pod Trainer v2 builds from the chart's ClusterTrainingRuntime (its fixed fields,
  RUNTIME_POD below, the same as charts/.../trainjob-runtime.yaml) merged with the TrainJob's
  runtime patch and `spec.trainer` (image, command, env, resources);
- each example once more with its model, data and output in object storage (the init containers
  fetch-model and fetch-data, the upload from the master), and with a Hub model (HF_TOKEN);
- the pre-flight profile pod of the first example.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import yaml

from finetune_operator import api
from finetune_operator.planning import ClusterPolicy, Plan, plan_job
from finetune_operator.planning.report import planning_inputs
from finetune_operator.profiling.pod import render_profile_pod
from finetune_operator.rendering import render_attempt, render_trainjob
from finetune_operator.rendering.trainjob import TRAINER_CONTAINER, pod_template_patch
from finetune_trainer.contract import ProfileRequest, ProfileSetup

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ENDPOINT = "https://s3.eu-de-berlin.example"

# What the chart's ClusterTrainingRuntime fixes in every TrainJob pod (trainjob-runtime.yaml).
RUNTIME_POD = {"restartPolicy": "Never", "enableServiceLinks": False, "automountServiceAccountToken": False}
RUNTIME_CONTAINER = {"imagePullPolicy": "IfNotPresent", "terminationMessagePath": "/dev/termination-log",
                     "terminationMessagePolicy": "FallbackToLogsOnError"}


def _jobs() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted(EXAMPLES.glob("*.yaml"))
            if p.name != "pools.yaml"]


def _policy() -> tuple[list, ClusterPolicy]:
    pools_file = EXAMPLES / "pools.yaml"
    pools, policy = planning_inputs(str(pools_file), pools_file.read_text(), None, None)
    storage = [{"endpoint": ENDPOINT, "region": r, "accessibleFrom": policy.allowed_regions}
               for r in policy.allowed_regions[:1]]
    return pools, policy.model_copy(update={"object_storage": ClusterPolicy.model_validate(
        {"objectStorage": storage}).object_storage})


def _s3(key: str, secret: str) -> dict[str, Any]:
    return {"endpoint": ENDPOINT, "bucket": "team-a", "key": key, "credentialsSecretRef": {"name": secret}}


def _variants(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "", doc
    s3 = copy.deepcopy(doc)
    s3["metadata"]["name"] += "-s3"
    s3["spec"]["model"]["source"] = {"s3": _s3("models/m/", "s3-models")}
    s3["spec"]["dataset"]["source"] = {"s3": _s3("data/train.jsonl", "s3-data")}
    s3["spec"]["output"] = {"s3": _s3("results/", "s3-results")}
    s3["spec"].pop("checkpoint", None)
    yield "-s3", s3
    hub = copy.deepcopy(doc)
    hub["metadata"]["name"] += "-hub"
    hub["spec"]["model"]["source"] = {"hf": {"repo": "org/model", "revision": "0123abc",
                                             "tokenSecretRef": {"name": "hf-token"}}}
    yield "-hub", hub


def _pod(name: str, namespace: str, template: dict[str, Any]) -> dict[str, Any]:
    metadata = {"name": name, "namespace": namespace, "labels": dict(template["metadata"].get("labels") or {}),
                "annotations": dict(template["metadata"].get("annotations") or {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": copy.deepcopy(template["spec"])}


def _trainjob_pod(name: str, namespace: str, train_job: dict[str, Any]) -> dict[str, Any]:
    patch = copy.deepcopy(pod_template_patch(train_job))
    trainer = train_job["spec"]["trainer"]
    spec = {**RUNTIME_POD, **patch["spec"]}
    [container] = spec["containers"]
    assert container["name"] == TRAINER_CONTAINER
    container.update(RUNTIME_CONTAINER)
    container.update(image=trainer["image"], command=trainer["command"], env=trainer["env"],
                     resources=trainer["resourcesPerNode"])
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, **{k: patch["metadata"][k] for k in patch["metadata"]}},
            "spec": spec}


def example_network_policies(namespace: str = "team-a") -> list[dict[str, Any]]:
    """The attempts' NetworkPolicies of the pods above (one per job and variant; the TrainJob pod
    of a job carries the same job and attempt labels, so the same policy selects it)."""
    pools, policy = _policy()
    policies = []
    for doc in _jobs():
        for _, variant in _variants(doc):
            job = api.parse_job(variant)
            plan = plan_job(job.spec, pools, policy)
            assert isinstance(plan, Plan), plan
            network_policy = render_attempt(job, plan, 1, policy).network_policy
            assert network_policy is not None
            network_policy["metadata"]["namespace"] = namespace
            policies.append(network_policy)
    return policies


def example_pods(namespace: str = "team-a") -> list[dict[str, Any]]:
    """Every pod above, each named `<job>-<backend>-<replica>`, in `namespace`."""
    pools, policy = _policy()
    pods = []
    for doc in _jobs():
        for suffix, variant in _variants(doc):
            job = api.parse_job(variant)
            plan = plan_job(job.spec, pools, policy)
            assert isinstance(plan, Plan), plan
            name = job.metadata.name
            rendered = render_attempt(job, plan, 1, policy)
            for replica, spec in rendered.pytorch_job["spec"]["pytorchReplicaSpecs"].items():
                pods.append(_pod(f"{name}-pytorchjob-{replica.lower()}", namespace, spec["template"]))
            if suffix:  # fetched sources need init containers, which a TrainJob cannot carry
                continue
            pods.append(_trainjob_pod(f"{name}-trainjob-node", namespace, render_trainjob(job, plan, 1, policy)))
    pods.append(example_profile_pod())
    return pods


def example_profile_pod(namespace: str = "finetune-system") -> dict[str, Any]:
    """The profile pod of the first example, in the operator's namespace (where the operator runs it,
    and where the chart's profile-pods NetworkPolicy selects it)."""
    _, policy = _policy()
    first = api.parse_job(_jobs()[0])
    setup = ProfileSetup(method="lora", sequence_length=512, micro_batch_size=1, gradient_checkpointing=True,
                         strategy="ddp", world_size=1)
    return render_profile_pod(first, ProfileRequest(config={"model_type": "x"}, setups=[setup]), "abc", policy, namespace)
