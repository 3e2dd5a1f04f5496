"""The chart's training backend and Kueue switches (issue 14): policy.trainingBackend reaches the
operator's policy and decides which backend's RBAC is granted; kueue.enabled grants the read of Kueue's
Workloads and LocalQueues; policy.defaultQueueName reaches the policy. RBAC is exactly
operator_access.yaml's needs under those values (least privilege), nothing more."""

from __future__ import annotations

from typing import Any

import pytest

from chart_support import Rendered, granted, needed, with_values
from finetune_operator.planning.policy import load_policy

RELEASE_NS = "finetune-system"
FULLNAME = "finetune-operator"


@pytest.fixture
def render(helm, tmp_path):
    def _render(values: dict[str, Any], **kw: Any) -> Rendered:
        return helm.render(values, tmp_path, namespace=RELEASE_NS, **kw)

    return _render


@pytest.mark.parametrize("backend", ["auto", "pytorchjob", "trainjob"])
@pytest.mark.parametrize("kueue", [False, True])
def test_rbac_is_exactly_the_needs_of_the_chosen_backend_and_kueue(render, default_values, backend, kueue):
    r = render(with_values(default_values, **{"policy.trainingBackend": backend, "kueue.enabled": kueue}))
    assert granted(r.one("ClusterRole")["rules"]) == (needed("namespaced", backend=backend, kueue=kueue)
                                                      | needed("cluster", backend=backend, kueue=kueue))
    grants = granted(r.one("ClusterRole")["rules"])
    resources = {res for _, res, _, _ in grants}
    creates = {res for _, res, verb, _ in grants if verb == "create"}
    # Both kinds are always read, suspended and deleted (a change of backend leaves the other kind's
    # attempts running); only the policy's backend(s) may be created.
    assert {"pytorchjobs", "trainjobs"} <= resources
    assert ("pytorchjobs" in creates) == (backend in ("auto", "pytorchjob"))
    assert ("trainjobs" in creates) == ("clustertrainingruntimes" in resources) == (backend in ("auto", "trainjob"))
    assert ("workloads" in resources) == ("localqueues" in resources) == kueue
    assert load_policy(r.one("ConfigMap")["data"]["policy.yaml"]).training_backend == backend


def test_namespaced_install_grants_the_backend_in_each_watched_namespace(render, default_values):
    values = with_values(default_values, **{"watch.allNamespaces": False, "watch.namespaces": ["team-a"],
                                            "policy.trainingBackend": "trainjob", "kueue.enabled": True})
    r = render(values)
    assert granted(r.one("ClusterRole")["rules"]) == needed("cluster", backend="trainjob", kueue=True)
    assert granted(r.one("Role", FULLNAME, "team-a")["rules"]) == needed("namespaced", backend="trainjob", kueue=True)


def test_policy_carries_the_runtime_and_the_default_queue(render, default_values):
    policy = load_policy(render(default_values).one("ConfigMap")["data"]["policy.yaml"])
    assert (policy.training_backend, policy.train_job_runtime, policy.default_queue_name) == ("auto", "finetune-torch", None)
    values = with_values(default_values, **{"policy.defaultQueueName": "gpus", "trainJobRuntime.name": "our-torch"})
    policy = load_policy(render(values).one("ConfigMap")["data"]["policy.yaml"])
    assert (policy.train_job_runtime, policy.default_queue_name) == ("our-torch", "gpus")


@pytest.mark.parametrize("changes, path", [
    ({"policy.trainingBackend": "jobset"}, "trainingBackend"),
    ({"policy.defaultQueueName": "has space"}, "defaultQueueName"),
    ({"kueue.enabled": "yes"}, "kueue"),
])
def test_bad_values_are_refused_naming_the_value(helm, tmp_path, default_values, changes, path):
    proc = helm.template(with_values(default_values, **changes), tmp_path, namespace=RELEASE_NS)
    assert proc.returncode != 0 and path in proc.stderr, proc.stderr
