"""The chart's ValidatingAdmissionPolicy (templates/admission-policy.yaml): every Secret, volume
claim, ConfigMap and queue a FineTuneJob can name is checked against the requesting user's own
`get`, on create and on any change of the spec. The list of references is read from the CRD itself,
so a field added to the API without its check fails here. The lab's API server evaluates the CEL
(e2e/test_admission_policy.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from chart_support import REPO, with_values

RELEASE_NS = "finetune-system"
POLICY = f"{RELEASE_NS}-finetune-operator-references"

# What a property of the FineTuneJob schema names, by its key: (API group, resource, suffix of the
# field that holds the object's name).
NAMED_BY_KEY = {
    "tokenSecretRef": ("", "secrets", ".name"),
    "credentialsSecretRef": ("", "secrets", ".name"),
    "claimName": ("", "persistentvolumeclaims", ""),
    "configMapRef": ("", "configmaps", ".name"),
    "queueName": ("kueue.x-k8s.io", "localqueues", ""),
}
# Words that mark a property as a reference to another object; each such key must be in NAMED_BY_KEY.
REFERENCE_WORDS = ("secret", "claim", "configmap", "queue", "serviceaccount", "ref")


def references_in(schema: dict[str, Any], path: str = "spec") -> dict[str, tuple[str, str]]:
    """field holding a name -> (group, resource), for every reference under `schema`; a property
    whose key looks like a reference but is not in NAMED_BY_KEY fails (the policy cannot check it)."""
    out: dict[str, tuple[str, str]] = {}
    for key, child in (schema.get("properties") or {}).items():
        if key in NAMED_BY_KEY:  # its own keys (name, key, accessKeyIdKey...) are not references
            group, resource, suffix = NAMED_BY_KEY[key]
            out[f"{path}.{key}{suffix}"] = (group, resource)
            continue
        assert not any(word in key.lower() for word in REFERENCE_WORDS), (
            f"{path}.{key}: a reference the admission policy does not know how to check")
        out |= references_in(child, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out |= references_in(schema["items"], path)
    return out


def crd_references() -> dict[str, tuple[str, str]]:
    crd = yaml.safe_load((REPO / "crds" / "finetunejob.yaml").read_text())
    return references_in(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"])


@pytest.fixture
def render(helm, tmp_path):
    return lambda values: helm.render(values, tmp_path, namespace=RELEASE_NS)


def _validations(policy: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """field -> (group, resource, verb) of each validation, parsed from its authorizer call."""
    out = {}
    for v in policy["spec"]["validations"]:
        expr = v["expression"]
        value = expr.split(" == ''", 1)[0]
        assert value.startswith("object.?spec.?") and value.endswith(".orValue('')"), expr
        field = value[len("object.?"):-len(".orValue('')")].replace(".?", ".")
        group = expr.split("authorizer.group('", 1)[1].split("'", 1)[0]
        resource = expr.split(".resource('", 1)[1].split("'", 1)[0]
        verb = expr.split(".check('", 1)[1].split("'", 1)[0]
        assert f".namespace(request.namespace).name({value})" in expr, expr
        assert expr.endswith(".allowed()"), expr
        assert v["messageExpression"].startswith(f"'{field}: ' + request.userInfo.username"), v
        assert v["reason"] == "Forbidden"
        out[field] = (group, resource, verb)
    return out


def test_every_reference_of_the_crd_is_checked_against_the_requesting_user(render, default_values):
    policy = render(default_values).one("ValidatingAdmissionPolicy", POLICY)
    expected = {field: (group, resource, "get") for field, (group, resource) in crd_references().items()}
    # 5 Secrets, 5 claims, 1 ConfigMap, 1 queue (the CRD at this commit). spec.evaluation.dataset is
    # refused by the CRD for now; it is checked anyway, so supporting it later opens no hole.
    assert len(expected) == 12
    assert _validations(policy) == expected
    assert len(policy["spec"]["validations"]) == len(expected)  # one check per expression: the CEL cost


def test_policy_matches_creates_and_spec_changes_and_is_bound_to_deny(render, default_values):
    r = render(default_values)
    policy = r.one("ValidatingAdmissionPolicy", POLICY)
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": ["finetune.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
         "resources": ["finetunejobs"]}]
    # Only creates and spec changes: a label, an annotation, a finalizer name nothing new.
    (condition,) = policy["spec"]["matchConditions"]
    assert condition["expression"] == "request.operation == 'CREATE' || object.spec != oldObject.spec"
    binding = r.one("ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}


def test_policy_can_be_switched_off(render, default_values):
    r = render(with_values(default_values, **{"admissionPolicy.enabled": False}))
    assert not r.of_kind("ValidatingAdmissionPolicy") and not r.of_kind("ValidatingAdmissionPolicyBinding")


def test_reference_walk_refuses_a_reference_it_cannot_check():
    """What keeps the policy complete: a new field naming another object (here a ServiceAccount) fails
    the walk until NAMED_BY_KEY and the chart's list say how to check it."""
    schema = {"properties": {"training": {"properties": {"serviceAccountName": {"type": "string"}}}}}
    with pytest.raises(AssertionError, match="spec.training.serviceAccountName"):
        references_in(schema)
    assert references_in({"properties": {"queueName": {"type": "string"}}}) == {
        "spec.queueName": ("kueue.x-k8s.io", "localqueues")}
