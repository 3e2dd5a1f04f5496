"""The attempt's NetworkPolicy: its pods talk to each other, to DNS, and to the endpoints the job
downloads from and uploads to; nothing else reaches them and they reach nothing else.

Pure: from the job, the attempt and the cluster policy. Created with the attempt's ConfigMap,
before its training job, so no pod of the attempt runs unbounded; owned by the job and deleted
with the attempt. A NetworkPolicy does something only where the cluster's CNI enforces it.
"""

from __future__ import annotations

from typing import Any

from .. import api
from ..planning.policy import ClusterPolicy
from ..planning.storage import storage_uses
from .labels import ATTEMPT_LABEL, JOB_LABEL, common_labels, owner_reference
from .names import attempt_name, label_value

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
DNS_PORT = 53


def attempt_pods(job: api.FineTuneJob, attempt: int) -> dict[str, Any]:
    """The selector of the attempt's pods (both backends label them so: labels.common_labels)."""
    return {"matchLabels": {JOB_LABEL: label_value(job.metadata.name), ATTEMPT_LABEL: str(attempt)}}


def _egress_to(networks: list[str], port: int) -> dict[str, Any]:
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
    if networks:
        rule["to"] = [{"ipBlock": {"cidr": network}} for network in networks]
    return rule


def endpoint_rules(job: api.FineTuneJob, policy: ClusterPolicy) -> list[dict[str, Any]]:
    """Egress to what the job transfers from and to: the Hub for an `hf` source, and each object
    storage endpoint it names (one rule per endpoint, however many roles use it)."""
    rules = []
    spec = job.spec
    if spec.model.source.hf is not None:
        settings = policy.network_policy
        rules.append(_egress_to(list(settings.hub_networks), settings.hub_port))
    seen: set[str] = set()
    for use in storage_uses(spec):
        entry = policy.object_storage_for(use.location.endpoint)
        if entry is None or entry.endpoint in seen:
            continue  # an endpoint the policy does not list never gets this far (storage_regions)
        seen.add(entry.endpoint)
        rules.append(_egress_to(list(entry.networks), entry.port))
    return rules


def trainer_status_rule(policy: ClusterPolicy) -> list[dict[str, Any]]:
    """Egress to Kubeflow Trainer's status endpoint (the TrainJob backend's pods POST their
    progress there): the controller's namespace, on the endpoint's port only."""
    settings = policy.network_policy
    if not settings.trainer_status_namespace:
        return []
    namespace = {"kubernetes.io/metadata.name": settings.trainer_status_namespace}
    return [{"to": [{"namespaceSelector": {"matchLabels": namespace}}],
             "ports": [{"protocol": "TCP", "port": settings.trainer_status_port}]}]


def render_network_policy(job: api.FineTuneJob, attempt: int, policy: ClusterPolicy, *,
                          reports_status: bool = False) -> dict[str, Any] | None:
    """The attempt's NetworkPolicy, named like the attempt; None when the policy turns them off.
    `reports_status`: the backend's pods report to their controller (ReportsTrainerStatus)."""
    if not policy.network_policy.enabled:
        return None
    name = attempt_name(job.metadata.name, attempt)

    def peers() -> list[dict[str, Any]]:  # a fresh list each time: no shared nodes (no YAML anchors)
        return [{"podSelector": attempt_pods(job, attempt)}]

    metadata: dict[str, Any] = {"name": name, "namespace": job.metadata.namespace,
                                "labels": common_labels(job, attempt)}
    owner = owner_reference(job)
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "podSelector": attempt_pods(job, attempt),
            "policyTypes": ["Ingress", "Egress"],
            # The ranks' rendezvous and collectives (torchrun's store, NCCL/gloo) are among the
            # attempt's own pods; nothing outside the attempt has a reason to connect to them.
            "ingress": [{"from": peers()}],
            "egress": [
                {"to": peers()},
                # DNS wherever the cluster serves it (CoreDNS pods, or a node-local cache on a link-local address).
                {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]},
                *endpoint_rules(job, policy),
                *(trainer_status_rule(policy) if reports_status else []),
            ],
        },
    }
