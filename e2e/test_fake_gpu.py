"""The fake GPU and the training operator: PyTorchJobs whose pods end as the rule says."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from e2e.helpers import GIB, job_condition, pytorchjob, terminated_state, training_pod
from e2e.lab.fate import RULES_CONFIGMAP, VERDICT_SUMMARY
from e2e.lab.waiting import wait_for
from finetune_trainer.contract import EXIT_GPU_OOM, FailureReason, FailureReport

pytestmark = pytest.mark.e2e

H100_MIB = 81559


def _apis(lab):
    api = lab.api_client()
    return client.CoreV1Api(api), client.CustomObjectsApi(api)


def _create_pytorchjob(custom, namespace, body):
    return custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", body)


def test_pytorchjob_that_fits_succeeds(lab, namespace):
    core, custom = _apis(lab)
    _create_pytorchjob(custom, namespace, pytorchjob("fits", "fits", 60 * GIB, workers=1, regions=["eu-de-berlin"]))
    job = job_condition(custom, namespace, "fits", "Succeeded")
    assert job["status"]["replicaStatuses"]["Master"].get("succeeded") == 1
    for pod in ("fits-master-0", "fits-worker-0"):
        p, term = terminated_state(core, namespace, pod)
        assert term.exit_code == 0 and term.reason == "Completed"
        assert p.status.phase == "Succeeded"
        node = core.read_node(p.spec.node_name)
        assert node.metadata.labels["topology.kubernetes.io/region"] == "eu-de-berlin"


def test_pytorchjob_cut_too_close_dies_with_a_gpu_oom_report(lab, namespace):
    core, custom = _apis(lab)
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": RULES_CONFIGMAP}, "data": {"true-peak-factor": "1.15"},
    })
    # 75 GiB predicted x 1.15 = 86 GiB > the H100's 79.6 GiB.
    _create_pytorchjob(custom, namespace, pytorchjob("tight", "tight", 75 * GIB, regions=["eu-de-berlin"]))
    job = job_condition(custom, namespace, "tight", "Failed")
    pod, term = terminated_state(core, namespace, "tight-master-0")
    assert pod.status.phase == "Failed"
    assert term.exit_code == EXIT_GPU_OOM
    report = FailureReport.model_validate_json(term.message)
    assert report.reason is FailureReason.GPU_OUT_OF_MEMORY
    assert report.phase.value == "backward" and report.step == 0 and report.rank == 0
    assert report.device_total_bytes == H100_MIB * 1024 * 1024
    assert report.peak_allocated_bytes <= report.device_total_bytes
    assert "CUDA out of memory" in report.message
    assert "gpu-oom" in pod.metadata.annotations[VERDICT_SUMMARY]
    assert any(c["type"] == "Failed" for c in job["status"]["conditions"])


def test_same_prediction_fits_on_a_looser_plan(lab, namespace):
    """The rule is relative: 60 GiB x 1.15 = 69 GiB fits where 75 GiB x 1.15 did not."""
    core, _ = _apis(lab)
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": RULES_CONFIGMAP}, "data": {"true-peak-factor": "1.15"},
    })
    core.create_namespaced_pod(namespace, training_pod("loose", "loose", 60 * GIB, regions=["eu-de-berlin"]))
    _, term = terminated_state(core, namespace, "loose")
    assert term.exit_code == 0


def test_a100_node_memory_decides_the_outcome(lab, namespace):
    """The node's own nvidia.com/gpu.memory label is the capacity: 45 GiB fits an H100, not an A100-40GB."""
    core, _ = _apis(lab)
    core.create_namespaced_pod(namespace, training_pod("on-a100", "a", 45 * GIB, regions=["eu-fr-paris"]))
    core.create_namespaced_pod(namespace, training_pod("on-h100", "h", 45 * GIB, regions=["eu-de-berlin"]))
    _, a100 = terminated_state(core, namespace, "on-a100")
    _, h100 = terminated_state(core, namespace, "on-h100")
    assert a100.exit_code == EXIT_GPU_OOM
    assert json.loads(a100.message)["deviceTotalBytes"] == 40960 * 1024 * 1024
    assert h100.exit_code == 0


def test_host_oom_ends_like_the_kubelet_reports_it(lab, namespace):
    core, _ = _apis(lab)
    core.create_namespaced_pod(namespace, training_pod(
        "hostoom", "hostoom", 10 * GIB, annotations={"lab.finetune.dev/outcome": "host-oom"}))
    pod, term = terminated_state(core, namespace, "hostoom")
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
    assert not term.message
    assert pod.status.phase == "Failed"


def test_fail_rule_sets_the_message_verbatim(lab, namespace):
    core, _ = _apis(lab)
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": RULES_CONFIGMAP},
        "data": {"outcome": "fail", "fail-message": "Traceback: ValueError: dataset row 17 has no 'messages'"},
    })
    core.create_namespaced_pod(namespace, training_pod("broken", "broken", 10 * GIB))
    _, term = terminated_state(core, namespace, "broken")
    assert (term.exit_code, term.reason) == (1, "Error")
    assert term.message == "Traceback: ValueError: dataset row 17 has no 'messages'"


def test_pod_annotation_overrides_the_namespace_rule(lab, namespace):
    core, _ = _apis(lab)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": RULES_CONFIGMAP}, "data": {"outcome": "host-oom"}})
    core.create_namespaced_pod(namespace, training_pod(
        "override", "override", 10 * GIB, annotations={"lab.finetune.dev/outcome": "succeed"}))
    _, term = terminated_state(core, namespace, "override")
    assert term.exit_code == 0


def test_malformed_rule_fails_the_pod_with_a_message_naming_the_key(lab, namespace):
    core, _ = _apis(lab)
    core.create_namespaced_pod(namespace, training_pod(
        "badrule", "badrule", 10 * GIB, annotations={"lab.finetune.dev/true-peak-factor": "lots"}))
    _, term = terminated_state(core, namespace, "badrule")
    assert term.exit_code == 1
    assert "lab.finetune.dev/true-peak-factor='lots'" in term.message and f"pod {namespace}/badrule" in term.message


def test_training_operator_webhook_rejects_an_invalid_pytorchjob(lab, namespace):
    """The training operator's own validating webhook is live (called on its local URL)."""
    _, custom = _apis(lab)
    body = pytorchjob("badname", "badname", 10 * GIB, container="not-pytorch")
    with pytest.raises(client.ApiException) as err:
        _create_pytorchjob(custom, namespace, body)
    assert err.value.status in (400, 422, 403)
    assert "validator.pytorchjob.training-operator.kubeflow.org" in err.value.body
    assert "pytorch" in err.value.body


def test_deleting_a_pytorchjob_deletes_its_pods(lab, namespace):
    core, custom = _apis(lab)
    core.create_namespaced_config_map(namespace, {
        "metadata": {"name": RULES_CONFIGMAP}, "data": {"outcome": "succeed", "run-duration": "10m"},
    })
    _create_pytorchjob(custom, namespace, pytorchjob("gone", "gone", 10 * GIB, regions=["eu-fr-paris"]))
    wait_for(lambda: core.read_namespaced_pod("gone-master-0", namespace).status.phase == "Running", 60, "master Running")
    custom.delete_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "gone")
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, 60, "pods to be garbage-collected")
