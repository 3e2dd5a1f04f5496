"""The lab itself: control plane, fake GPU nodes, the real scheduler, RBAC, garbage collection."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from e2e.helpers import GIB, gpu_pod_spec, training_pod
from e2e.lab.nodes import (DEFAULT_ALLOWED_REGIONS, GPU_RESOURCE, POOL_LABEL, REGION_LABEL, RUNNER_KUBELET, RUNNER_LABEL,
                           load_pools)
from e2e.lab.versions import load_versions
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e


def test_every_component_runs_at_the_pinned_version(lab):
    status = lab.status()
    assert set(status) >= {
        "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "training-operator", "fake-gpu",
    }
    assert all(status[name] for name in status), status
    version = json.loads(lab.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == load_versions().kubernetes
    assert version["clientVersion"]["gitVersion"] == load_versions().kubernetes


def test_fake_gpu_nodes_are_ready_and_labelled_like_real_ones(lab):
    core = client.CoreV1Api(lab.api_client())
    nodes = {n.metadata.name: n for n in core.list_node().items}
    catalog = load_pools()
    assert {r for p in catalog.pools for r in [p.region]} >= {"eu-de-berlin", "eu-fr-paris", "us-east-virginia"}
    # The real-node pool registers itself when `up --with kubelet` starts its kubelets (test_real_node.py).
    for pool in [p for p in catalog.pools if p.runner != RUNNER_KUBELET]:
        for name in pool.node_names():
            node = nodes[name]
            ready = {c.type: c.status for c in node.status.conditions}
            assert ready["Ready"] == "True", name
            labels = node.metadata.labels
            assert labels[REGION_LABEL] == pool.region
            assert labels["topology.kubernetes.io/zone"] in pool.zones
            assert labels[POOL_LABEL] == pool.name
            if pool.gpu:
                assert labels["nvidia.com/gpu.product"] == pool.gpu.product
                assert labels["nvidia.com/gpu.memory"] == str(pool.gpu.memory_mib)
                assert labels["nvidia.com/gpu.count"] == str(pool.gpu.count)
                assert node.status.allocatable[GPU_RESOURCE] == str(pool.gpu.count)
                # kwok's pools carry the GPU taint and no runner's.
                assert [(t.key, t.effect) for t in node.spec.taints] == [(GPU_RESOURCE, "NoSchedule")]
                assert RUNNER_LABEL not in labels
            else:
                assert GPU_RESOURCE not in node.status.allocatable
    # kubectl sees the same thing a platform engineer would look at.
    out = lab.kubectl("get", "nodes", "-L", REGION_LABEL, "-L", "nvidia.com/gpu.product").stdout
    assert "h100-berlin-0" in out and "NVIDIA-A100-SXM4-40GB" in out


def _free_gpus_per_node(core: client.CoreV1Api, nodes: list[str]) -> dict[str, int]:
    """Allocatable GPUs minus what non-terminated pods (of any test) hold on each node."""
    free = {n: int(core.read_node(n).status.allocatable[GPU_RESOURCE]) for n in nodes}
    for pod in core.list_pod_for_all_namespaces().items:
        if pod.spec.node_name in free and pod.status.phase not in ("Succeeded", "Failed"):
            for c in pod.spec.containers:
                limits = (c.resources.limits or {}) if c.resources else {}
                free[pod.spec.node_name] -= int(limits.get(GPU_RESOURCE, 0))
    return free


def test_scheduler_places_gpu_pods_only_in_allowed_regions(lab, namespace):
    """Fill every free GPU of the allowed regions; the next pod must stay Pending although
    us-east-virginia has free GPUs, and none may ever land there."""
    core = client.CoreV1Api(lab.api_client())
    catalog = load_pools()
    allowed_nodes = [n for p in catalog.gpu_pools() if p.region in DEFAULT_ALLOWED_REGIONS for n in p.node_names()]

    def no_terminating_pods() -> bool:
        return not [p for p in core.list_pod_for_all_namespaces().items
                    if p.metadata.deletion_timestamp and p.spec.node_name in allowed_nodes]

    # Pods of earlier tests' namespaces still hold GPUs until they are gone.
    wait_for(no_terminating_pods, 60, "pods being deleted on the allowed GPU nodes to go")
    per_pod = 4
    count = sum(f // per_pod for f in _free_gpus_per_node(core, allowed_nodes).values())
    assert count >= 4, "the allowed regions should have room for several 4-GPU pods"
    for i in range(count + 1):
        core.create_namespaced_pod(namespace, {
            "metadata": {"name": f"gpu-{i}"},
            "spec": gpu_pod_spec(per_pod, list(DEFAULT_ALLOWED_REGIONS)),
        })

    def placement():
        pods = core.list_namespaced_pod(namespace).items
        bound = [p for p in pods if p.spec.node_name]
        unschedulable = [
            p for p in pods
            if any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in (p.status.conditions or []))
        ]
        return (bound, unschedulable) if len(bound) == count and len(unschedulable) == 1 else None

    bound, unschedulable = wait_for(placement, 60, f"{count} pods bound and 1 unschedulable")
    node_region = {n.metadata.name: n.metadata.labels[REGION_LABEL] for n in core.list_node().items}
    assert {node_region[p.spec.node_name] for p in bound} <= set(DEFAULT_ALLOWED_REGIONS)
    message = next(c.message for c in unschedulable[0].status.conditions if c.type == "PodScheduled")
    assert "node affinity" in message, message
    assert f"Insufficient {GPU_RESOURCE}" in message, message


def test_pod_without_gpu_toleration_stays_off_gpu_nodes(lab, namespace):
    core = client.CoreV1Api(lab.api_client())
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "plain"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "resources": {"requests": {"cpu": "100m"}}}]},
    })
    pod = wait_for(lambda: core.read_namespaced_pod("plain", namespace).spec.node_name, 30, "plain pod bound")
    assert pod.startswith("system-berlin-")


def test_garbage_collector_deletes_owned_objects(lab, namespace):
    core = client.CoreV1Api(lab.api_client())
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(namespace, {
        "metadata": {
            "name": "child",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}],
        }
    })
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        return not any(c.metadata.name == "child" for c in core.list_namespaced_config_map(namespace).items)

    wait_for(child_gone, 30, "the garbage collector to delete the owned ConfigMap")


def test_service_account_kubeconfig_has_exactly_its_rbac(lab, namespace):
    lab.kubectl("create", "serviceaccount", "robot", "-n", namespace)
    kubeconfig = lab.service_account_kubeconfig(namespace, "robot")
    denied = lab.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr, denied.stderr
    assert f"system:serviceaccount:{namespace}:robot" in denied.stderr
    lab.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", namespace)
    lab.kubectl("create", "rolebinding", "robot-reads", "--role=pod-reader", f"--serviceaccount={namespace}:robot",
                "-n", namespace)
    wait_for(lambda: lab.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False).returncode == 0,
             10, "the RoleBinding to take effect")
    # Impersonation gives the same answer without a token.
    sa_user = f"system:serviceaccount:{namespace}:robot"
    assert lab.kubectl("auth", "can-i", "list", "pods", "-n", namespace, as_user=sa_user).stdout.strip() == "yes"
    no = lab.kubectl("auth", "can-i", "create", "pods", "-n", namespace, as_user=sa_user, check=False)
    assert no.stdout.strip() == "no"
    api = client.CoreV1Api(lab.impersonating_client(sa_user))
    with pytest.raises(client.ApiException) as err:
        api.list_namespaced_config_map(namespace)
    assert err.value.status == 403


def test_namespace_fixture_gives_a_usable_namespace(lab, namespace):
    core = client.CoreV1Api(lab.api_client())
    core.create_namespaced_pod(namespace, training_pod("probe", "probe", 10 * GIB, regions=["eu-de-berlin"]))
    assert core.read_namespaced_pod("probe", namespace).metadata.namespace == namespace
