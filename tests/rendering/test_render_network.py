"""The attempt's NetworkPolicy (rendering/network.py): whom it selects, what it lets in and out."""

from __future__ import annotations

import pytest
from render_factories import plan_for, policy

from finetune_operator import api
from finetune_operator.planning.policy import PolicyError, load_policy
from finetune_operator.rendering import render_attempt, render_trainjob
from finetune_operator.rendering.backend import DEFAULT_BACKEND
from finetune_operator.rendering.network import render_network_policy

ENDPOINT = "https://s3.eu-de-berlin.example:9000"


def _job(document: dict, **spec) -> api.FineTuneJob:
    document["spec"].update(spec)
    document["metadata"]["uid"] = "0f3c-uid"
    return api.parse_job(document)


def _s3(key: str) -> dict:
    return {"s3": {"endpoint": ENDPOINT, "bucket": "team-a", "key": key, "credentialsSecretRef": {"name": "keys"}}}


def _storage_policy(networks: list[str]) -> dict:
    return {"object_storage": [{"endpoint": ENDPOINT, "region": "eu-de-berlin", "networks": networks}]}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_it_selects_exactly_the_attempts_pods_on_both_backends_and_is_owned_by_the_job(lora_job):
    job = _job(lora_job)
    plan = plan_for(job, nodes=2, gpus_per_node=2)
    rendered = render_attempt(job, plan, 2, policy())
    netpol = rendered.network_policy
    assert netpol["metadata"]["name"] == rendered.name == "demo-a2"
    assert netpol["metadata"]["ownerReferences"][0]["uid"] == "0f3c-uid"
    assert netpol["metadata"]["ownerReferences"][0]["controller"] is True
    selector = netpol["spec"]["podSelector"]
    for spec in rendered.pytorch_job["spec"]["pytorchReplicaSpecs"].values():
        assert _selects(selector, spec["template"]["metadata"]["labels"])
    trainjob = render_trainjob(job, plan, 2, policy())
    assert _selects(selector, _trainjob_pod_labels(trainjob))
    # Another attempt's pods (the one before, still terminating) are not selected.
    older = render_attempt(job, plan, 1, policy()).pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]
    assert not _selects(selector, older["template"]["metadata"]["labels"])
    # Both backends create it, between the ConfigMap and the training job.
    objects = DEFAULT_BACKEND.render(job, plan, 2, policy()).objects
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]


def _trainjob_pod_labels(trainjob: dict) -> dict:
    from finetune_operator.rendering.trainjob import pod_template_patch

    return pod_template_patch(trainjob)["metadata"]["labels"]


def test_ingress_only_from_the_attempt_and_egress_only_to_it_dns_and_nothing_else_for_a_pvc_job(lora_job):
    job = _job(lora_job)
    spec = render_network_policy(job, 1, policy())["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    own = [{"podSelector": spec["podSelector"]}]
    assert spec["ingress"] == [{"from": own}]
    assert spec["egress"] == [
        {"to": own},
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
    ]


def test_egress_to_each_object_storage_endpoint_on_its_port_and_networks_once(lora_job):
    job = _job(lora_job, model={**lora_job["spec"]["model"], "source": _s3("models/m/")},
               dataset={"source": _s3("data/train.jsonl"), "format": "chat"}, output=_s3("out/"))
    narrowed = render_network_policy(job, 1, policy(**_storage_policy(["10.40.0.0/24", "10.41.0.7"])))
    # Three roles, one endpoint: one rule, to its networks on its port.
    assert narrowed["spec"]["egress"][2:] == [{"ports": [{"protocol": "TCP", "port": 9000}],
                                               "to": [{"ipBlock": {"cidr": "10.40.0.0/24"}},
                                                      {"ipBlock": {"cidr": "10.41.0.7/32"}}]}]
    # Without networks the operator cannot know the endpoint's addresses: its port, any address.
    anywhere = render_network_policy(job, 1, policy(**_storage_policy([])))
    assert anywhere["spec"]["egress"][2:] == [{"ports": [{"protocol": "TCP", "port": 9000}]}]


def test_egress_to_the_hub_for_an_hf_model(lora_job):
    model = {**lora_job["spec"]["model"], "source": {"hf": {"repo": "org/m", "revision": "0123abc"}}}
    job = _job(lora_job, model=model)
    rules = render_network_policy(job, 1, policy(network_policy={"hub_networks": ["192.0.2.0/24"], "hub_port": 8443}))
    assert rules["spec"]["egress"][2:] == [{"ports": [{"protocol": "TCP", "port": 8443}],
                                           "to": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]}]
    assert render_network_policy(job, 1, policy())["spec"]["egress"][2:] == [{"ports": [{"protocol": "TCP", "port": 443}]}]


def test_off_in_the_policy_renders_none_and_the_pods_say_so_to_the_scanner(lora_job):
    job = _job(lora_job)
    off = policy(network_policy={"enabled": False})
    rendered = render_attempt(job, plan_for(job), 1, off)
    assert rendered.network_policy is None
    assert [o["kind"] for o in rendered.objects] == ["ConfigMap", "PyTorchJob"]
    annotations = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"]
    assert any(v.startswith("CKV2_K8S_6=") for v in annotations.values())
    on = render_attempt(job, plan_for(job), 1, policy())
    annotations = on.pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"]
    assert not any(v.startswith("CKV2_K8S_6=") for v in annotations.values())


def test_a_trainjob_attempt_may_reach_trainers_status_endpoint_and_a_pytorchjob_attempt_may_not(lora_job):
    from finetune_operator.rendering.backend import TRAIN_JOB

    job = _job(lora_job)
    plan = plan_for(job)
    status_rule = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow-system"}}}],
                   "ports": [{"protocol": "TCP", "port": 10443}]}
    trainjob = TRAIN_JOB.render(job, plan, 1, policy()).network_policy
    assert trainjob["spec"]["egress"][-1] == status_rule
    assert status_rule not in DEFAULT_BACKEND.render(job, plan, 1, policy()).network_policy["spec"]["egress"]
    moved = policy(network_policy={"trainer_status_namespace": "trainer", "trainer_status_port": 9443})
    assert TRAIN_JOB.render(job, plan, 1, moved).network_policy["spec"]["egress"][-1] == {
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainer"}}}],
        "ports": [{"protocol": "TCP", "port": 9443}]}
    closed = policy(network_policy={"trainer_status_namespace": ""})
    assert len(TRAIN_JOB.render(job, plan, 1, closed).network_policy["spec"]["egress"]) == 2  # own pods, DNS


@pytest.mark.parametrize("document, field", [
    ({"networkPolicy": {"trainerStatusNamespace": "Kubeflow System"}}, "networkPolicy.trainerStatusNamespace"),
    ({"networkPolicy": {"trainerStatusPort": 70000}}, "networkPolicy.trainerStatusPort"),
    ({"networkPolicy": {"hubNetworks": ["10.0.0.0/33"]}}, "networkPolicy.hubNetworks"),
    ({"networkPolicy": {"hubPort": 0}}, "networkPolicy.hubPort"),
    ({"networkPolicy": {"egress": []}}, "networkPolicy.egress"),
    ({"objectStorage": [{"endpoint": ENDPOINT, "region": "r", "networks": ["s3.example"]}]}, "objectStorage.0.networks"),
    ({"objectStorage": [{"endpoint": ENDPOINT, "region": "r", "networks": ["10.0.0.0/8", "10.0.0.0/8"]}]},
     "objectStorage.0.networks"),
])
def test_bad_network_settings_are_refused_naming_the_field(document, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        load_policy(document)
