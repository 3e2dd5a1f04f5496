"""The chart lints and renders with the default and several other value sets, and what it renders is
what the operator needs: its command line, probes, hardening, policy and least-privilege RBAC."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from chart_support import CHART, Rendered, forbidden, granted, kubernetes_version, needed, operator_access, with_values
from finetune_operator.planning.policy import load_policy

RELEASE_NS = "finetune-system"
FULLNAME = "finetune-operator"  # release "finetune-operator" already contains the chart name


def _namespaced(values: dict[str, Any], *namespaces: str) -> dict[str, Any]:
    return with_values(values, **{"watch.allNamespaces": False, "watch.namespaces": list(namespaces)})


def value_sets(defaults: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Value sets a platform team plausibly installs with; each must lint and render."""
    return {
        "default": defaults,
        "namespaced": _namespaced(defaults, "team-a", "team-b"),
        "namespaced-incl-release-ns": _namespaced(defaults, "team-a", RELEASE_NS),
        "single-replica": with_values(defaults, replicaCount=1),
        "monitoring": with_values(defaults, **{"metrics.serviceMonitor.enabled": True,
                                               "metrics.serviceMonitor.labels": {"release": "prom"}}),
        "byo-identity": with_values(defaults, **{"serviceAccount.create": False, "serviceAccount.name": "ops-bot",
                                                 "rbac.create": False}),
        "pinned-digest": with_values(defaults, **{"image.digest": "sha256:" + "ab" * 32, "logLevel": "debug",
                                                  "logFormat": "plain"}),
        "empty-policy": with_values(defaults, **{"policy.allowedRegions": [], "policy.catalog": [],
                                                 "topologySpread.enabled": False,
                                                 "podDisruptionBudget.enabled": False}),
        "platform-extras": with_values(defaults, **{
            "nodeSelector": {"node-role.example.com/system": "true"},
            "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
            "priorityClassName": "system-cluster-critical",
            "podAnnotations": {"example.com/owner": "platform"},
            "securityContext.runAsUser": None, "securityContext.runAsGroup": None, "securityContext.fsGroup": None,
        }),
    }


VALUE_SET_NAMES = [
    "default", "namespaced", "namespaced-incl-release-ns", "single-replica", "monitoring", "byo-identity",
    "pinned-digest", "empty-policy", "platform-extras",
]


@pytest.fixture
def render(helm, tmp_path):
    def _render(values: dict[str, Any], **kw: Any) -> Rendered:
        return helm.render(values, tmp_path, namespace=RELEASE_NS, **kw)

    return _render


def test_value_set_names_match(default_values):
    assert list(value_sets(default_values)) == VALUE_SET_NAMES


@pytest.mark.parametrize("name", VALUE_SET_NAMES)
def test_lint_and_template_pass(helm, default_values, tmp_path, name):
    values = value_sets(default_values)[name]
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    lint = helm.run("lint", str(CHART), "--strict", "--kube-version", kubernetes_version(),
                    "--namespace", RELEASE_NS, "--values", str(path))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    rendered = helm.render(values, tmp_path, namespace=RELEASE_NS)
    for obj in rendered.objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "finetune-operator", obj["kind"]


def test_default_objects(render, default_values):
    r = render(default_values)
    assert r.kinds() == sorted([
        "ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "Service", "Deployment",
        "PodDisruptionBudget", "Role", "RoleBinding", "Role", "RoleBinding", "Role", "RoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "NetworkPolicy",
    ])
    # The leader election's Role, the state Role (profile cache, calibration) and the profile pods' Role,
    # with their bindings, in the release namespace; no kopf peering objects.
    assert sorted((o["metadata"]["namespace"], o["metadata"]["name"]) for o in r.of_kind("Role")) == [
        (RELEASE_NS, f"{FULLNAME}-leader-election"), (RELEASE_NS, f"{FULLNAME}-profile"),
        (RELEASE_NS, f"{FULLNAME}-state")]
    assert not any(o["apiVersion"].startswith("kopf.dev/") for o in r.objects)


def _container(r: Rendered) -> dict[str, Any]:
    (container,) = r.one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_deployment_runs_the_operator_as_agreed(render, default_values):
    r = render(default_values)
    deploy = r.one("Deployment", FULLNAME)
    pod = deploy["spec"]["template"]["spec"]
    c = _container(r)
    assert deploy["spec"]["replicas"] == 2
    assert c["image"] == "ghcr.io/finetune-operator/operator:0.1.0"
    args = c["args"]
    assert args[0] == "run" and "--all-namespaces" in args and "--namespace" not in args
    policy_cm = r.one("ConfigMap")["metadata"]
    assert _flag(args, "--policy-configmap") == [policy_cm["name"]]
    assert _flag(args, "--policy-namespace") == [RELEASE_NS] == [policy_cm["namespace"]]
    assert _flag(args, "--health-port") == ["8080"]
    assert _flag(args, "--metrics-port") == ["9090"]
    assert _flag(args, "--lease") == ["finetune-operator"] and "--peering" not in args
    assert _flag(args, "--log-format") == ["json"]
    assert _flag(args, "--log-level") == ["info"]
    assert all(isinstance(a, str) for a in args)
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["HOME"]["value"] == env["TMPDIR"]["value"] == "/tmp"
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == r.one("ServiceAccount")["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_pod_template_has_no_policy_checksum(render, default_values):
    """The operator reloads the policy ConfigMap itself; a checksum annotation would restart it on
    every policy change, so a policy-only upgrade must leave the pod template byte-identical."""
    before = render(default_values).one("Deployment", FULLNAME)["spec"]["template"]
    changed = with_values(default_values, **{"policy.allowedRegions": ["eu-de-berlin"],
                                             "policy.defaultMaxAttempts": 2})
    after_r = render(changed)
    assert after_r.one("Deployment", FULLNAME)["spec"]["template"] == before
    assert load_policy(after_r.one("ConfigMap")["data"]["policy.yaml"]).allowed_regions == ["eu-de-berlin"]


def test_container_is_hardened(render, default_values):
    r = render(default_values)
    pod = r.one("Deployment", FULLNAME)["spec"]["template"]["spec"]
    sc = _container(r)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["privileged"] is False
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_security_context_user_can_be_left_to_the_platform(render, default_values):
    values = value_sets(default_values)["platform-extras"]
    r = render(values)
    pod = r.one("Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert "runAsUser" not in pod["securityContext"] and "fsGroup" not in pod["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == {"node-role.example.com/system": "true"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["tolerations"] == [{"key": "CriticalAddonsOnly", "operator": "Exists"}]


def test_replicas_spread_across_zones_and_nodes(render, default_values):
    r = render(default_values)
    deploy = r.one("Deployment", FULLNAME)
    constraints = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in constraints] == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    for c in constraints:
        assert c["labelSelector"]["matchLabels"] == selector
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"


def test_pdb_only_with_more_than_one_replica(render, default_values):
    pdb = render(default_values).one("PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == render(default_values).one("Deployment")["spec"]["selector"]["matchLabels"]
    assert render(with_values(default_values, replicaCount=1)).of_kind("PodDisruptionBudget") == []


def test_metrics_service_and_service_monitor(render, default_values):
    r = render(default_values)
    assert r.of_kind("ServiceMonitor") == []
    svc = r.one("Service")
    deploy = r.one("Deployment")
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    m = render(value_sets(default_values)["monitoring"])
    monitor = m.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= m.one("Service")["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_image_digest_wins_over_tag(render, default_values):
    c = _container(render(value_sets(default_values)["pinned-digest"]))
    assert c["image"] == "ghcr.io/finetune-operator/operator@sha256:" + "ab" * 32
    assert _flag(c["args"], "--log-level") == ["debug"]
    assert _flag(c["args"], "--log-format") == ["plain"]


# ---- the policy ------------------------------------------------------------------------------


def test_policy_configmap_is_the_operators_cluster_policy(render, default_values):
    cm = render(default_values).one("ConfigMap", f"{FULLNAME}-policy", RELEASE_NS)
    assert list(cm["data"]) == ["policy.yaml"]
    policy = load_policy(cm["data"]["policy.yaml"])
    p = default_values["policy"]
    assert policy.allowed_regions == ["eu-de-berlin", "eu-fr-paris"]
    assert policy.region_label_key == "topology.kubernetes.io/region"
    assert policy.zone_label_key == "topology.kubernetes.io/zone"
    assert policy.default_memory_headroom == pytest.approx(p["defaultMemoryHeadroom"])
    assert policy.default_max_attempts == p["defaultMaxAttempts"]
    assert policy.unschedulable_timeout_seconds == p["unschedulableTimeoutSeconds"]
    assert policy.start_timeout_seconds == p["startTimeoutSeconds"]
    assert policy.create_retry_seconds == p["createRetrySeconds"]
    assert (policy.hung_after_factor, policy.hung_min_seconds) == (p["hungAfterFactor"], p["hungMinSeconds"])
    assert policy.placement_preference == p["placementPreference"] == "startTime"
    assert policy.start_time_cost_margin == p["startTimeCostMargin"]
    assert policy.pool_label_keys == p["poolLabelKeys"]
    assert policy.trainer_image == "registry.eu-de-berlin.internal/finetune-operator/trainer:0.1.0"
    assert [pool.name for pool in policy.catalog] == [pool["name"] for pool in p["catalog"]]


def test_object_storage_reaches_the_operator(render, default_values):
    """The policy's objectStorage: every field the schema allows loads, endpoints in one spelling."""
    entries = [
        {"endpoint": "https://S3.eu-de-berlin.internal:443/", "region": "eu-de-berlin"},
        {"endpoint": "http://127.0.0.1:8333", "region": "eu-fr-paris", "accessibleFrom": ["eu-fr-paris", "eu-de-berlin"],
         "networks": ["127.0.0.1/32"]},
    ]
    schema = __import__("json").loads((CHART / "values.schema.json").read_text())
    assert set(entries[1]) == set(schema["properties"]["policy"]["properties"]["objectStorage"]["items"]["properties"])
    assert load_policy(render(default_values).one("ConfigMap")["data"]["policy.yaml"]).object_storage == []
    values = with_values(default_values, **{"policy.objectStorage": entries})
    loaded = load_policy(render(values).one("ConfigMap")["data"]["policy.yaml"])
    berlin, paris = loaded.object_storage
    assert (berlin.endpoint, berlin.usable_regions) == ("https://s3.eu-de-berlin.internal", ["eu-de-berlin"])
    assert (paris.endpoint, paris.usable_regions) == ("http://127.0.0.1:8333", ["eu-fr-paris", "eu-de-berlin"])
    assert (paris.networks, paris.port, berlin.networks, berlin.port) == (["127.0.0.1/32"], 8333, [], 443)


def test_network_policy_settings_reach_the_operator_and_bad_ranges_are_refused(helm, render, default_values, tmp_path):
    assert load_policy(render(default_values).one("ConfigMap")["data"]["policy.yaml"]).network_policy.enabled
    values = with_values(default_values, **{"policy.networkPolicy": {"enabled": False, "hubNetworks": ["10.9.0.0/16"],
                                                                     "hubPort": 8443}})
    settings = load_policy(render(values).one("ConfigMap")["data"]["policy.yaml"]).network_policy
    assert (settings.enabled, settings.hub_networks, settings.hub_port) == (False, ["10.9.0.0/16"], 8443)
    bad = helm.template(with_values(default_values, **{"policy.networkPolicy": {"hubNetworks": ["not a network"]}}),
                        tmp_path, namespace=RELEASE_NS)
    assert bad.returncode != 0 and "hubNetworks" in bad.stderr, bad.stderr


def test_allowed_images_reach_the_operator(render, default_values):
    """policy.allowedImages: empty by default (only the trainer image), every schema field loads."""
    assert load_policy(render(default_values).one("ConfigMap")["data"]["policy.yaml"]).allowed_images == []
    entries = [{"prefix": "registry.eu-de-berlin.internal/ml/", "requireDigest": True}, {"prefix": "r.example/t"}]
    schema = __import__("json").loads((CHART / "values.schema.json").read_text())
    assert set(entries[0]) == set(schema["properties"]["policy"]["properties"]["allowedImages"]["items"]["properties"])
    loaded = load_policy(render(with_values(default_values, **{"policy.allowedImages": entries}))
                         .one("ConfigMap")["data"]["policy.yaml"])
    assert [(e.prefix, e.require_digest) for e in loaded.allowed_images] == [
        ("registry.eu-de-berlin.internal/ml/", True), ("r.example/t", False)]
    assert loaded.image_problem("registry.eu-de-berlin.internal/ml/x:1") is not None  # no digest
    assert loaded.image_problem("r.example/t:2") is None


def test_every_catalog_field_the_schema_allows_reaches_the_operator(render, default_values):
    """The schema's pool fields and the operator's catalog loader agree: a pool using every field the
    schema allows loads, and keeps the values given."""
    pool = {
        "name": "b200-berlin", "region": "eu-de-berlin", "zones": ["eu-de-berlin-1c"], "gpuType": "B200-192GB",
        "gpuMemory": "180Gi", "gpusPerNode": 8, "maxNodes": 4, "pricePerGpuHour": 6.5, "intraNode": "nvlink",
        "interNodeGbps": 3200, "hostMemory": "2Ti", "cpus": 224, "peakTflops": 2250,
        "selector": {"example.com/pool": "b200"}, "taints": [{"key": "example.com/gpu", "effect": "NoExecute"}],
        "gpuLabel": {"key": "nvidia.com/gpu.product", "values": ["NVIDIA-B200"]},
    }
    schema = __import__("json").loads((CHART / "values.schema.json").read_text())
    assert set(pool) == set(schema["properties"]["policy"]["properties"]["catalog"]["items"]["properties"])
    values = with_values(default_values, **{"policy.catalog": [pool]})
    (loaded,) = load_policy(render(values).one("ConfigMap")["data"]["policy.yaml"]).catalog
    assert loaded.gpu_memory_bytes == 180 * 2**30
    assert loaded.host_memory_bytes == 2 * 2**40
    assert loaded.peak_tflops == 2250 and loaded.price_per_gpu_hour == 6.5 and loaded.max_nodes == 4
    assert loaded.selector == {"example.com/pool": "b200"}
    assert (loaded.gpu_label.key, loaded.gpu_label.values) == ("nvidia.com/gpu.product", ["NVIDIA-B200"])
    assert loaded.taints[0].effect == "NoExecute"


def test_default_catalog_describes_the_lab(default_values):
    """The default values describe the lab of e2e/ (pools.yaml): every GPU pool, same region, zones,
    GPU type and count, node count as the ceiling, and the lab's pool label and GPU taint. The
    real-node pool (region lab-real), outside the default policy, is left out on purpose: only the
    scenarios that run pods on it name it, in their own values."""
    from e2e.lab import nodes as lab_nodes
    from finetune_operator.planning.pools import canonical_gpu_name, load_catalog

    catalog = {p.name: p for p in load_catalog(default_values["policy"]["catalog"])}
    lab = {p.name: p for p in lab_nodes.load_pools().gpu_pools() if p.runner != lab_nodes.RUNNER_KUBELET}
    assert "lab-real" not in catalog
    assert sorted(catalog) == sorted(lab)
    for name, lab_pool in lab.items():
        pool = catalog[name]
        assert pool.region == lab_pool.region, name
        assert pool.zones == lab_pool.zones, name
        assert pool.gpu_type == canonical_gpu_name(lab_pool.gpu.product), name
        assert pool.gpus_per_node == lab_pool.gpu.count, name
        assert pool.max_nodes == lab_pool.nodes, name
        assert pool.cpus == int(lab_pool.cpu), name
        assert pool.selector == {lab_nodes.POOL_LABEL: name}, name
        assert [(t.key, t.value, t.effect) for t in pool.taints] == [(lab_nodes.GPU_RESOURCE, "present", "NoSchedule")]
    assert tuple(default_values["policy"]["allowedRegions"]) == lab_nodes.DEFAULT_ALLOWED_REGIONS
    regions = {p.region for p in lab.values()}
    assert "us-east-virginia" in regions and "us-east-virginia" not in default_values["policy"]["allowedRegions"]


def test_default_catalog_agrees_with_examples_pools(default_values):
    """examples/pools.yaml (the catalog users copy) and the chart's default catalog describe the same
    hardware at the same prices: a pool of the same name has the same GPUs, interconnect, price,
    selector and taints, and the same GPU type in the same region costs the same. Zones, node counts
    and node sizes are the lab's own (the chart describes the lab)."""
    from finetune_operator.planning.pools import load_catalog

    path = CHART.parents[1] / "examples" / "pools.yaml"
    if not path.exists():
        pytest.skip("examples/pools.yaml is not written yet")
    example = {p.name: p for p in load_catalog(path.read_text())}
    chart = {p.name: p for p in load_catalog(default_values["policy"]["catalog"])}
    shared = sorted(set(example) & set(chart))
    assert shared, f"no pool in common: chart {sorted(chart)}, examples {sorted(example)}"
    for name in shared:
        a, b = example[name], chart[name]
        for field in ("region", "gpu_type", "gpu_memory_bytes", "gpus_per_node", "intra_node", "inter_node_gbps",
                      "price_per_gpu_hour", "selector", "taints"):
            assert getattr(a, field) == getattr(b, field), f"{name}.{field}: examples {getattr(a, field)!r} chart {getattr(b, field)!r}"
    prices = {(p.region, p.gpu_type): p.price_per_gpu_hour for p in example.values()}
    for pool in chart.values():
        key = (pool.region, pool.gpu_type)
        if key in prices:
            assert pool.price_per_gpu_hour == prices[key], f"{pool.name}: {key} costs {prices[key]} in examples/pools.yaml"


def test_policy_values_are_data_not_yaml_text(render, default_values):
    """Strings that look like YAML stay strings in policy.yaml (toYaml, no splicing)."""
    values = with_values(default_values, **{
        "policy.allowedRegions": ["true", "1.0", "null"],
        "policy.poolLabelKeys": ["example.com/yes"],
    })
    policy = yaml.safe_load(render(values).one("ConfigMap")["data"]["policy.yaml"])
    assert policy["allowedRegions"] == ["true", "1.0", "null"]
    assert policy["poolLabelKeys"] == ["example.com/yes"]


# ---- namespaces and RBAC -----------------------------------------------------------------------


def _rules(obj: dict[str, Any]) -> set:
    return granted(obj["rules"])


def test_all_namespaces_rbac_grants_exactly_what_the_operator_needs(render, default_values):
    r = render(default_values)
    assert _rules(r.one("ClusterRole")) == needed("namespaced") | needed("cluster")
    _assert_lease_role(r)
    _assert_state_role(r)
    _assert_profile_role(r)
    binding = r.one("ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": r.one("ClusterRole")["metadata"]["name"]}
    sa = r.one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]


def _assert_state_role(r: Rendered) -> None:
    """The operator's own ConfigMaps (profile cache, calibration) in the release namespace: get and patch by
    name, create; bound to the operator's ServiceAccount whichever namespaces are watched."""
    assert _rules(r.one("Role", f"{FULLNAME}-state", RELEASE_NS)) == needed("state")
    binding = r.one("RoleBinding", f"{FULLNAME}-state", RELEASE_NS)
    assert binding["roleRef"]["name"] == f"{FULLNAME}-state"


def _assert_profile_role(r: Rendered) -> None:
    """The profile pods' Role: pods in the release namespace only, bound to the operator's ServiceAccount."""
    assert _rules(r.one("Role", f"{FULLNAME}-profile", RELEASE_NS)) == needed("profile")
    binding = r.one("RoleBinding", f"{FULLNAME}-profile", RELEASE_NS)
    assert binding["roleRef"]["name"] == f"{FULLNAME}-profile"
    sa = r.one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": RELEASE_NS}]


def _assert_lease_role(r: Rendered, lease: str = "finetune-operator") -> None:
    """The leader election's Role: in the release namespace, exactly the lease needs (get and update of
    the one Lease by name, create), bound to the operator's ServiceAccount."""
    role = r.one("Role", f"{FULLNAME}-leader-election", RELEASE_NS)
    assert _rules(role) == needed("lease", lease)
    binding = r.one("RoleBinding", f"{FULLNAME}-leader-election", RELEASE_NS)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": f"{FULLNAME}-leader-election"}
    sa = r.one("ServiceAccount")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": RELEASE_NS}]


def test_namespaced_rbac_grants_only_in_the_watched_namespaces(render, default_values):
    r = render(value_sets(default_values)["namespaced"])
    args = _container(r)["args"]
    assert "--all-namespaces" not in args and _flag(args, "--namespace") == ["team-a", "team-b"]
    assert _rules(r.one("ClusterRole")) == needed("cluster")
    sa = r.one("ServiceAccount")["metadata"]
    for ns in ("team-a", "team-b"):
        role = r.one("Role", FULLNAME, ns)
        assert _rules(role) == needed("namespaced")
        binding = r.one("RoleBinding", FULLNAME, ns)
        assert binding["roleRef"]["kind"] == "Role" and binding["roleRef"]["name"] == FULLNAME
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": RELEASE_NS}]
    # The release namespace is not served, but the operator reads its policy there.
    reader = r.one("Role", f"{FULLNAME}-policy-reader", RELEASE_NS)
    assert _rules(reader) == {("", "configmaps", "get", f"{FULLNAME}-policy")}
    r.one("RoleBinding", f"{FULLNAME}-policy-reader", RELEASE_NS)
    _assert_lease_role(r)
    _assert_state_role(r)
    _assert_profile_role(r)


def test_namespaced_rbac_without_extra_reader_when_release_namespace_is_watched(render, default_values):
    r = render(value_sets(default_values)["namespaced-incl-release-ns"])
    roles = sorted((o["metadata"]["namespace"], o["metadata"]["name"]) for o in r.of_kind("Role"))
    assert roles == sorted([("team-a", FULLNAME), (RELEASE_NS, FULLNAME), (RELEASE_NS, f"{FULLNAME}-leader-election"),
                            (RELEASE_NS, f"{FULLNAME}-state"), (RELEASE_NS, f"{FULLNAME}-profile")])


def test_rbac_never_grants_wildcards_secrets_or_writes_to_nodes(render, default_values):
    for name in ("default", "namespaced"):
        r = render(value_sets(default_values)[name])
        for obj in r.of_kind("ClusterRole") + r.of_kind("Role"):
            for group, resource, verb, _ in _rules(obj):
                assert "*" not in (group, resource, verb), obj["metadata"]["name"]
                assert resource not in ("secrets", "serviceaccounts", "serviceaccounts/token", "pods/exec",
                                        "pods/attach", "pods/portforward"), (name, resource)
                # Logs are read (status.progress), never more than that.
                assert resource != "pods/log" or verb == "get", (name, verb)
                # Leases only in the leader election's Role (checked by _assert_lease_role).
                assert resource != "leases" or obj["metadata"]["name"] == f"{FULLNAME}-leader-election"
                assert not (resource == "nodes" and verb not in ("get", "list", "watch")), (name, verb)
                # Pods are written only in the release namespace (the profile pods): creating a pod in a
                # tenant's namespace could mount any of its Secrets, as good as reading them.
                assert not (resource == "pods" and verb not in ("get", "list", "watch")
                            and (obj["kind"] == "ClusterRole" or obj["metadata"]["name"] != f"{FULLNAME}-profile")), (
                    name, obj["kind"], obj["metadata"]["name"], verb)
                assert verb not in ("escalate", "bind", "impersonate", "deletecollection"), (name, verb)


def _grants_in(r: Rendered, namespace: str) -> set:
    """What the ServiceAccount may do in one namespace: the ClusterRole and that namespace's Roles."""
    out = set()
    for obj in r.of_kind("ClusterRole") + [o for o in r.of_kind("Role") if o["metadata"]["namespace"] == namespace]:
        out |= _rules(obj)
    return out


@pytest.mark.parametrize("name", ["default", "namespaced"])
def test_rbac_grants_nothing_the_access_file_forbids(render, default_values, name):
    """Every forbidden line, against the rendered roles: in a watched namespace (or the release
    namespace for `where: release`), a grant matches by verb and resource, for any name or that name."""
    r = render(with_values(value_sets(default_values)[name], **{"leaderElection.leaseName": "ft-lease"}))
    _assert_lease_role(r, "ft-lease")
    allowed = []
    for where, group, resource, verb, obj_name in forbidden("ft-lease"):
        grants = _grants_in(r, RELEASE_NS if where == "release" else "team-a")
        if any((group, resource, verb, n) in grants for n in {"", obj_name}):
            allowed.append((where, group, resource, verb, obj_name))
    assert not allowed, allowed


def test_leader_election_off_renders_no_lease_rules_and_one_replica_at_most(helm, render, default_values, tmp_path):
    off = with_values(default_values, **{"leaderElection.enabled": False, "replicaCount": 1})
    r = render(off)
    assert _flag(_container(r)["args"], "--lease") == [""]
    assert not any(res == "leases" for obj in r.of_kind("ClusterRole") + r.of_kind("Role") for _, res, _, _ in _rules(obj))
    assert [o["metadata"]["name"] for o in r.of_kind("Role")] == [f"{FULLNAME}-state", f"{FULLNAME}-profile"]
    assert [o["metadata"]["name"] for o in r.of_kind("RoleBinding")] == [f"{FULLNAME}-state", f"{FULLNAME}-profile"]
    render(with_values(off, replicaCount=0))
    proc = helm.template(with_values(off, replicaCount=2), tmp_path, namespace=RELEASE_NS)
    assert proc.returncode != 0
    assert "replicaCount (2) needs leaderElection.enabled" in proc.stderr, proc.stderr
    # Another lease name reaches the operator and its Role.
    named = render(with_values(default_values, **{"leaderElection.leaseName": "ft-lease"}))
    assert _flag(_container(named)["args"], "--lease") == ["ft-lease"]
    _assert_lease_role(named, "ft-lease")


def test_access_file_lists_a_reason_for_every_need():
    access = operator_access()
    for need in access["needs"]:
        assert need["why"].strip() and need["verbs"], need
        assert need["scope"] in ("namespaced", "cluster", "lease", "state", "profile"), need
        assert need["code"].strip(), need  # what in the operator uses it
    assert access["forbidden"]


def test_cluster_scoped_names_carry_the_release_namespace(helm, tmp_path, default_values):
    """The same release name in two namespaces must not fight over one ClusterRole."""
    names = {}
    for ns in ("team-a-ops", "team-b-ops"):
        r = helm.render(default_values, tmp_path, namespace=ns)
        names[ns] = {o["metadata"]["name"] for o in r.of_kind("ClusterRole") + r.of_kind("ClusterRoleBinding")}
        assert names[ns] == {f"{ns}-{FULLNAME}"}


def test_bring_your_own_identity(render, default_values):
    r = render(value_sets(default_values)["byo-identity"])
    assert r.of_kind("ServiceAccount") == []
    assert not any(r.of_kind(k) for k in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"))
    assert r.one("Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-bot"


def test_release_name_shapes_the_names(helm, tmp_path, default_values):
    r = helm.render(default_values, tmp_path, namespace="ml-platform", release="ftop")
    assert r.one("Deployment")["metadata"]["name"] == "ftop-finetune-operator"
    assert r.one("ConfigMap")["metadata"]["name"] == "ftop-finetune-operator-policy"
    assert _flag(_container(r)["args"], "--policy-configmap") == ["ftop-finetune-operator-policy"]
    assert _flag(_container(r)["args"], "--policy-namespace") == ["ml-platform"]
    assert r.one("ClusterRole")["metadata"]["name"] == "ml-platform-ftop-finetune-operator"


def test_profile_pod_settings_reach_the_operator_and_bad_ones_are_refused(helm, render, default_values, tmp_path):
    """policy.profilePod: none by default; every schema field loads; a bad toleration is refused by
    helm (the schema) and a key the API server would refuse by the operator's loader, naming the field."""
    assert load_policy(render(default_values).one("ConfigMap")["data"]["policy.yaml"]).profile_pod.tolerations == []
    toleration = {"key": "example.com/cpu", "operator": "Equal", "value": "shared", "effect": "NoExecute",
                  "tolerationSeconds": 30}
    schema = __import__("json").loads((CHART / "values.schema.json").read_text())
    profile = schema["properties"]["policy"]["properties"]["profilePod"]
    assert set(toleration) == set(profile["properties"]["tolerations"]["items"]["properties"])
    values = with_values(default_values, **{"policy.profilePod": {
        "tolerations": [toleration, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"example.com/pool": "cpu"}}})
    loaded = load_policy(render(values).one("ConfigMap")["data"]["policy.yaml"]).profile_pod
    assert [t.to_pod() for t in loaded.tolerations] == [
        toleration, {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert loaded.node_selector == {"example.com/pool": "cpu"}
    bad = helm.template(with_values(default_values, **{"policy.profilePod": {"tolerations": [{"effect": "Sometimes"}]}}),
                        tmp_path, namespace=RELEASE_NS)
    assert bad.returncode != 0 and "profilePod" in bad.stderr, bad.stderr
    from finetune_operator.planning.policy import PolicyError

    with pytest.raises(PolicyError, match=r"profilePod.tolerations.0.key: .*'bad key!' is not a valid taint key"):
        load_policy({"profilePod": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}})


def test_the_profile_pods_network_policy_selects_them_and_lets_nothing_through(render, default_values):
    sys.path.append(str(Path(__file__).resolve().parents[1] / "rendering"))
    from example_pods import example_profile_pod

    r = render(default_values)
    policy = r.one("NetworkPolicy", f"{FULLNAME}-profile-pods", RELEASE_NS)
    # Both directions closed, no rule opening either: the profile needs no network.
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"] and "egress" not in policy["spec"]
    # It selects the pods the operator renders for a profile (in its own namespace), not the operator's.
    selector = policy["spec"]["podSelector"]["matchLabels"]
    profile = example_profile_pod(RELEASE_NS)
    assert selector.items() <= profile["metadata"]["labels"].items()
    operator_pod = r.one("Deployment", FULLNAME)["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_pod.items()
    # With it, the profile pod needs no scanner skip for "no NetworkPolicy"; without it, it does.
    assert "CKV2_K8S_6" not in " ".join(profile["metadata"]["annotations"].values())
    off = render(with_values(default_values, **{"policy.networkPolicy.enabled": False}))
    assert not off.of_kind("NetworkPolicy")
