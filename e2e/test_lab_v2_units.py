"""Fast checks (no cluster) of the lab's optional components: versions.env keys, the JobSet tools
module, component names, and how release webhook manifests are pointed at local processes."""

from __future__ import annotations

import base64

import pytest
import yaml

from e2e.lab import build, components
from e2e.lab.versions import load_versions, parse_versions

BASE = """KUBERNETES_VERSION=v1.36.3
ETCD_VERSION=v3.6.8
KWOK_VERSION=v0.8.0
TRAINING_OPERATOR_VERSION=v1.9.3
HELM_VERSION=v3.22.0
"""


def test_optional_versions_never_change_the_kubernetes_cache_key():
    without = parse_versions(BASE)
    with_v2 = parse_versions(BASE + "JOBSET_VERSION=v0.12.0\nTRAINER_VERSION=v2.3.0\nKUEUE_VERSION=v0.19.2\n")
    assert (with_v2.jobset, with_v2.trainer, with_v2.kueue) == ("v0.12.0", "v2.3.0", "v0.19.2")
    assert without.cache_key() == with_v2.cache_key()
    assert without.jobset is None


def test_committed_jobset_module_matches_versions_env():
    build.check_jobset_module(load_versions())


def test_jobset_module_drift_is_reported():
    v = load_versions()
    with pytest.raises(build.BuildError, match="JOBSET_VERSION=v0.0.1"):
        build.check_jobset_module(type(v)(**{**v.__dict__, "jobset": "v0.0.1"}))


def test_the_v2_cache_lives_inside_the_labs_and_follows_the_versions():
    v = load_versions()
    home = build.v2_home(v)
    assert home.parent.parent == build.lab_home(v)
    assert build.v2_home(type(v)(**{**v.__dict__, "kueue": "v0.19.1"})) != home


def test_component_names():
    assert components.parse_components("kueue, trainer-v2") == ("trainer-v2", "kueue")
    assert components.parse_components(None) == () == components.parse_components("")
    with pytest.raises(ValueError, match="known"):
        components.parse_components("trainer-v3")


MANIFEST = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata: {name: mutating-webhook-configuration}
webhooks:
- name: mjob.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}}
  failurePolicy: Fail
  rules: [{apiGroups: [batch], apiVersions: [v1], operations: [CREATE], resources: [jobs]}]
- name: mpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  failurePolicy: Fail
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {name: validating-webhook-configuration}
webhooks:
- name: vclusterqueue.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /validate-cq}}
  failurePolicy: Fail
  rules: [{apiGroups: [kueue.x-k8s.io], apiVersions: [v1beta2], operations: [CREATE], resources: [clusterqueues]}]
"""


def test_release_webhooks_are_pointed_at_the_local_process(tmp_path):
    path = tmp_path / "webhooks.yaml"
    path.write_text(MANIFEST)
    configs = components.local_webhooks(path, "kueue", 4321, b"CA", keep=components._kueue_keeps)
    assert [c["metadata"]["name"] for c in configs] == ["kueue-mutating-webhook-configuration",
                                                       "kueue-validating-webhook-configuration"]
    mutating, validating = configs
    assert [h["name"] for h in mutating["webhooks"]] == ["mjob.kb.io"]  # the pod webhook is not the lab's
    hook = mutating["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:4321/mutate-batch-v1-job",
                                    "caBundle": base64.b64encode(b"CA").decode()}
    assert hook["failurePolicy"] == "Fail"
    scoped = components._kueue_scoped(dict(hook))
    assert scoped["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "kueue-system"]
    assert "namespaceSelector" not in components._kueue_scoped(dict(validating["webhooks"][0]))


def test_release_patches_replace_a_webhook(tmp_path):
    path = tmp_path / "webhooks.yaml"
    path.write_text(MANIFEST)
    patch = {"op": "replace", "path": "/webhooks/1", "value": {
        **yaml.safe_load(MANIFEST.split("---")[0])["webhooks"][1],
        "objectSelector": {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}}}
    (mutating, _) = components.local_webhooks(path, "jobset", 1, b"CA",
                                              patches={"MutatingWebhookConfiguration": [patch]})
    assert mutating["webhooks"][1]["objectSelector"]["matchExpressions"][0]["key"] == "jobset.sigs.k8s.io/jobset-name"


def test_fake_gpu_ranks_trainjob_pods_by_their_completion_index():
    from e2e.lab.fate import rank_of

    assert rank_of({"jobset.sigs.k8s.io/jobset-name": "j-a1", "batch.kubernetes.io/job-completion-index": "1"}) == 1
    assert rank_of({"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"}) == 1
