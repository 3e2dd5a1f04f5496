"""The chart's optional ClusterTrainingRuntime (Kubeflow Trainer v2), which the operator's TrainJobs
refer to: off by default, strict values, and valid against the pinned Trainer release's CRD."""

from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import pytest

from chart_support import REPO, required, with_values

sys.path.append(str(REPO / "tests" / "rendering"))
from upstream_crd import UpstreamCrdMissing, cluster_training_runtime_schema  # noqa: E402

from finetune_operator.rendering.trainjob import DEFAULT_RUNTIME, TRAINER_CONTAINER, TRAINER_JOB  # noqa: E402


def runtime_schema():
    try:
        return cluster_training_runtime_schema()
    except UpstreamCrdMissing as missing:
        if required():
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but the ClusterTrainingRuntime CRD is missing: {missing}", pytrace=False)
        pytest.skip(f"the upstream ClusterTrainingRuntime CRD is not available: {missing}")


def test_off_by_default(helm, default_values, tmp_path):
    assert default_values["trainJobRuntime"] == {"enabled": False, "name": DEFAULT_RUNTIME}
    assert helm.render(default_values, tmp_path).of_kind("ClusterTrainingRuntime") == []


def test_the_runtime_the_renderer_refers_to(helm, default_values, tmp_path):
    rendered = helm.render(with_values(default_values, **{"trainJobRuntime.enabled": True}), tmp_path)
    runtime = rendered.one("ClusterTrainingRuntime", DEFAULT_RUNTIME)
    assert "namespace" not in runtime["metadata"]  # cluster-scoped
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(runtime_schema()).iter_errors(runtime)]
    assert errors == []
    spec = runtime["spec"]
    assert "torch" in spec["mlPolicy"]
    assert spec["template"]["spec"]["failurePolicy"] == {"maxRestarts": 0}
    (job,) = spec["template"]["spec"]["replicatedJobs"]
    assert job["name"] == TRAINER_JOB
    assert job["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert job["template"]["spec"]["backoffLimit"] == 0
    pod = job["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["enableServiceLinks"] is False
    (container,) = pod["containers"]
    assert container["name"] == TRAINER_CONTAINER
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    trainer = default_values["policy"]["trainer"]
    assert container["image"] == f"{trainer['registry']}/{trainer['repository']}:{trainer['tag']}"


def test_the_name_is_a_value(helm, default_values, tmp_path):
    values = with_values(default_values, **{"trainJobRuntime.enabled": True, "trainJobRuntime.name": "team-torch"})
    assert helm.render(values, tmp_path).one("ClusterTrainingRuntime")["metadata"]["name"] == "team-torch"


@pytest.mark.parametrize(
    "changes, path",
    [
        ({"trainJobRuntime.name": "Not_A_Name"}, "/trainJobRuntime/name"),
        ({"trainJobRuntime.enabled": "yes"}, "/trainJobRuntime/enabled"),
        ({"trainJobRuntime": {"enabled": True, "name": "x", "image": "evil"}}, "/trainJobRuntime"),
    ],
)
def test_strict_values(helm, default_values, tmp_path, changes, path):
    proc = helm.template(with_values(default_values, **changes), tmp_path)
    assert proc.returncode != 0 and path in proc.stderr, proc.stderr
