"""No confused deputy, on the lab's real kube-apiserver: the chart's ValidatingAdmissionPolicy refuses
a FineTuneJob that names a Secret, claim, ConfigMap or LocalQueue its author may not `get`, on create
and when an existing job is edited to point at another one; users are impersonated (`kubectl --as`),
so the API server's own authorizer answers for each of them. Writes that leave the spec alone
(metadata, and the operator's status writes: its ServiceAccount may read no Secret) pass.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.lab.waiting import wait_for
from e2e.test_chart import CHART, Helm

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
ALICE, BOB = "alice@example.com", "bob@example.com"
USER_GROUPS = ("system:authenticated",)


def _job(name: str, namespace: str, secret: str | None = "hub-alice", **spec: Any) -> dict[str, Any]:
    """The 8B LoRA example with its model from the Hub (the token from `secret`)."""
    doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "llama-8b-lora.yaml").read_text()))
    doc["metadata"] = {"name": name, "namespace": namespace}
    hf: dict[str, Any] = {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "main"}
    if secret:
        hf["tokenSecretRef"] = {"name": secret}
    doc["spec"]["model"]["source"] = {"hf": hf}
    doc["spec"].update(spec)
    return doc


@pytest.fixture(scope="module")
def helm(lab, tmp_path_factory) -> Helm:
    return Helm(lab, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def release(lab, helm, ftj_crd):
    ns = f"vap-e2e-{uuid.uuid4().hex[:5]}"
    lab.kubectl("create", "namespace", ns)
    name = f"fto-{uuid.uuid4().hex[:5]}"
    helm("install", name, str(CHART), "--namespace", ns, "--set", f"leaderElection.leaseName={name}",
         "--set", "replicaCount=0")
    yield {"namespace": ns, "release": name, "sa": f"system:serviceaccount:{ns}:{name}-finetune-operator"}
    helm("uninstall", name, "--namespace", ns, "--wait", check=False)
    lab.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture
def tenant(lab, release, namespace):
    """Two Secrets, claims, a ConfigMap; alice may get hub-alice, claims models/data/checkpoints, the
    ConfigMap arch-alice and the LocalQueue team; bob may do everything with FineTuneJobs but read nothing."""
    for secret in ("hub-alice", "hub-other"):
        lab.kubectl("create", "secret", "generic", secret, "-n", namespace, "--from-literal=token=t")
    rules = {
        "alice": [
            {"apiGroups": ["finetune.dev"], "resources": ["finetunejobs"], "verbs": ["get", "create", "update", "patch"]},
            {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hub-alice"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["persistentvolumeclaims"],
             "resourceNames": ["models", "data", "checkpoints"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["arch-alice"], "verbs": ["get"]},
            {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "resourceNames": ["team"], "verbs": ["get"]},
        ],
        "bob": [
            {"apiGroups": ["finetune.dev"], "resources": ["finetunejobs"], "verbs": ["get", "create", "update", "patch"]},
            {"apiGroups": [""], "resources": ["persistentvolumeclaims"], "verbs": ["get"]},
        ],
    }
    for who, user in (("alice", ALICE), ("bob", BOB)):
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": {"name": who, "namespace": namespace}, "rules": rules[who]}
        lab.kubectl("apply", "-f", "-", input=json.dumps(role))
        lab.kubectl("create", "rolebinding", who, "-n", namespace, f"--role={who}", f"--user={user}")
    # The policy is enforced once the API server's policy informer has it: wait for bob's first refusal.
    wait_for(lambda: _create(lab, BOB, _job("probe", namespace), dry_run=True).returncode != 0, 30,
             "the admission policy to be enforced")
    return namespace


def _create(lab, user: str, job: dict[str, Any], dry_run: bool = False):
    args = ["create", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    return lab.kubectl(*args, input=json.dumps(job), check=False, as_user=user, as_groups=USER_GROUPS)


def _patch(lab, user: str, namespace: str, name: str, patch: dict[str, Any], groups=USER_GROUPS):
    return lab.kubectl("patch", "finetunejob", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch),
                       check=False, as_user=user, as_groups=groups)


def _refused(proc, field: str, user: str) -> None:
    assert proc.returncode != 0, f"accepted: {proc.stdout}"
    assert "denied request" in proc.stderr and field in proc.stderr and user in proc.stderr, proc.stderr


def test_a_user_may_name_only_the_secret_they_may_read(lab, tenant):
    ns = tenant
    created = _create(lab, ALICE, _job("alice-own", ns))
    assert created.returncode == 0, created.stderr
    _refused(_create(lab, ALICE, _job("alice-other", ns, secret="hub-other")),
             "spec.model.source.hf.tokenSecretRef.name", ALICE)
    # bob may create FineTuneJobs but read no Secret: the operator must not read one for him.
    _refused(_create(lab, BOB, _job("bob", ns)), "spec.model.source.hf.tokenSecretRef.name", BOB)
    assert _create(lab, BOB, _job("bob-public", ns, secret=None), dry_run=True).returncode == 0
    # Everything alice may get, all at once: her Secret, claims, ConfigMap and LocalQueue.
    job = _job("alice-all", ns, queueName="team")
    job["spec"]["model"]["architecture"] = {"configMapRef": {"name": "arch-alice"}}
    proc = _create(lab, ALICE, job, dry_run=True)
    assert proc.returncode == 0, proc.stderr


def test_editing_a_job_to_point_at_another_secret_is_refused(lab, tenant):
    ns = tenant
    assert _create(lab, ALICE, _job("edited", ns)).returncode == 0
    repoint = {"spec": {"model": {"source": {"hf": {"tokenSecretRef": {"name": "hub-other"}}}}}}
    proc = _patch(lab, ALICE, ns, "edited", repoint)
    # The CRD's transition rules refuse it first (spec.model is immutable); the policy would on its own.
    assert proc.returncode != 0 and ("immutable" in proc.stderr or "tokenSecretRef" in proc.stderr), proc.stderr
    # bob may edit FineTuneJobs, but any change of the spec of a job that names alice's Secret is his
    # to answer for, even of a field the CRD lets change (resources): the policy checks every reference.
    more = {"spec": {"resources": {"maxGPUs": 4}}}
    _refused(_patch(lab, BOB, ns, "edited", more), "spec.model.source.hf.tokenSecretRef.name", BOB)
    stored = json.loads(lab.kubectl("get", "finetunejob", "edited", "-n", ns, "-o", "json").stdout)
    assert stored["spec"]["model"]["source"]["hf"]["tokenSecretRef"]["name"] == "hub-alice"
    assert stored["spec"]["resources"]["maxGPUs"] == 8
    proc = _patch(lab, ALICE, ns, "edited", more)
    assert proc.returncode == 0, proc.stderr


def test_metadata_and_status_writes_name_nothing_and_pass(lab, release, tenant):
    """A write that leaves the spec alone is not checked: a label or annotation by someone who may
    read nothing (bob), and the operator's status writes (its ServiceAccount may read no Secret; the
    status is another subresource, which the policy does not match)."""
    ns = tenant
    assert _create(lab, ALICE, _job("meta", ns)).returncode == 0
    proc = _patch(lab, BOB, ns, "meta", {"metadata": {"annotations": {"finetune.dev/e2e": "1"}}})
    assert proc.returncode == 0, proc.stderr
    # As the operator writes it: a merge patch of the status subresource (kubectl patch would GET the
    # object first, which the operator's RBAC does not grant on finetunejobs/status).
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    custom = client.CustomObjectsApi(lab.impersonating_client(release["sa"], ("system:serviceaccounts",)))
    written = custom.patch_namespaced_custom_object_status("finetune.dev", "v1alpha1", ns, "finetunejobs", "meta",
                                                           {"status": {"phase": "Pending"}})
    assert written["status"]["phase"] == "Pending"
    # ... and the operator's ServiceAccount may not change a spec at all (no patch in its RBAC).
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object("finetune.dev", "v1alpha1", ns, "finetunejobs", "meta",
                                              {"spec": {"resources": {"maxGPUs": 4}}})
    assert refused.value.status == 403


S3 = {"endpoint": "https://s3.eu-de-berlin.example", "credentialsSecretRef": {"name": "hub-other"}}


@pytest.mark.parametrize(("field", "at", "value"), [
    ("spec.model.source.s3.credentialsSecretRef.name", ("model", "source"), {"s3": {**S3, "bucket": "models"}}),
    ("spec.dataset.source.s3.credentialsSecretRef.name", ("dataset", "source"),
     {"s3": {**S3, "bucket": "data", "key": "train.jsonl"}}),
    ("spec.output.s3.credentialsSecretRef.name", ("output",), {"s3": {**S3, "bucket": "out"}}),
    ("spec.model.source.pvc.claimName", ("model", "source"), {"pvc": {"claimName": "bobs"}}),
    ("spec.dataset.source.pvc.claimName", ("dataset", "source"), {"pvc": {"claimName": "bobs", "path": "x.jsonl"}}),
    ("spec.checkpoint.pvc.claimName", ("checkpoint", "pvc"), {"claimName": "bobs"}),
    ("spec.output.pvc.claimName", ("output",), {"pvc": {"claimName": "bobs"}}),
    ("spec.model.architecture.configMapRef.name", ("model", "architecture"), {"configMapRef": {"name": "arch-bob"}}),
    ("spec.queueName", ("queueName",), "other-team"),
])
def test_every_reference_is_checked(lab, tenant, field, at, value):
    """alice's job with one object she may not get put at `at` (replacing what was there)."""
    job = _job("ref", tenant, secret=None)
    node = job["spec"]
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = value
    _refused(_create(lab, ALICE, job, dry_run=True), field, ALICE)
