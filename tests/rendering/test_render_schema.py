"""Rendered PyTorchJobs against the upstream CRD's OpenAPI schema (from the Go module cache)."""

from __future__ import annotations

import copy

import pytest
import yaml
from manifest_checks import attempt_errors, schema_errors
from render_factories import plan_for, policy, pool
from upstream_crd import CRD_IN_MODULE, go_string_constant, pytorchjob_crd_path, training_operator_version

from finetune_operator import api
from finetune_operator.rendering import render_attempt
from repo_files import example_jobs

SHAPES = [
    dict(nodes=1, gpus_per_node=1, strategy="ddp"),
    dict(nodes=1, gpus_per_node=8, strategy="fsdp", offload="optimizer+params"),
    dict(nodes=2, gpus_per_node=8, strategy="zero3", offload="optimizer+params"),
    dict(nodes=4, gpus_per_node=4, strategy="zero2", offload="optimizer"),
]


def test_crd_comes_from_the_pinned_module():
    path = pytorchjob_crd_path()  # fails (never skips) when it can be neither found nor downloaded
    assert f"training-operator@{training_operator_version()}" in str(path)
    assert str(path).endswith(CRD_IN_MODULE)


@pytest.mark.parametrize("example", example_jobs(), ids=lambda p: p.stem)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s['nodes']}x{s['gpus_per_node']}-{s['strategy']}")
def test_examples_in_every_shape_pass_the_schema(example, shape):
    job = api.parse_job(yaml.safe_load(example.read_text()))
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"namespace": "team-a", "uid": "u-1"})})
    if job.spec.method == "qlora":
        shape = dict(shape, strategy="ddp", offload="none")
    region = job.spec.placement.regions[0]
    plan = plan_for(job, pool(region=region, selector={"karpenter.sh/nodepool": f"gpu-{region}"}), **shape)
    rendered = render_attempt(job, plan, 2, policy())
    assert attempt_errors(rendered.config_map, rendered.pytorch_job) == []


def test_the_schema_check_can_fail(lora_job):
    job = api.parse_job(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, policy())
    broken = copy.deepcopy(rendered.pytorch_job)
    broken["spec"]["runPolicy"]["backoffLimit"] = "zero"
    broken["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    broken["spec"]["nprocPerNode"] = 2
    errors = schema_errors(broken)
    assert any("backoffLimit" in e for e in errors)
    assert any("resourcez" in e for e in errors)
    assert any("nprocPerNode" in e for e in errors)


def test_clean_pod_policy_is_upstreams_running(lora_job):
    # The CRD types cleanPodPolicy as any string. Training-operator v1.9 (DeletePodsAndServices) compares
    # it with its constants: "None" keeps every pod of a finished job, "Running" deletes those still
    # Running or Pending (hung ranks holding GPUs) and keeps the terminated ones that explain a
    # failure, and anything else deletes them all, the evidence too. So the value must be exactly
    # the pinned module's CleanPodPolicyRunning.
    job = api.parse_job(lora_job)
    rendered = render_attempt(job, plan_for(job, nodes=2), 1, policy())
    running = go_string_constant("pkg/apis/kubeflow.org/v1/common_types.go", "CleanPodPolicyRunning")
    assert rendered.pytorch_job["spec"]["runPolicy"]["cleanPodPolicy"] == running == "Running"
