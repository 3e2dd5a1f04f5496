"""values.schema.json rejects bad values, and helm's message names the value's path."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from chart_support import CHART, with_values

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def _catalog_pool(values: dict[str, Any], index: int, **changes: Any) -> list[dict[str, Any]]:
    catalog = [dict(p) for p in values["policy"]["catalog"]]
    for key, value in changes.items():
        if value is None:
            catalog[index].pop(key, None)
        else:
            catalog[index][key] = value
    return catalog


# (case id, changes as dotted paths, text helm's error must contain: the path of the bad value)
BAD_VALUES: list[tuple[str, Any, str]] = [
    ("replicas-not-a-number", {"replicaCount": "two"}, "/replicaCount"),
    ("replicas-negative", {"replicaCount": -1}, "/replicaCount"),
    ("unknown-top-level-key", {"replicas": 2}, "'replicas'"),
    ("typo-in-policy-key", {"policy.allowedRegion": ["eu-de-berlin"]}, "'allowedRegion'"),
    ("region-with-space", {"policy.allowedRegions": ["eu de berlin"]}, "/policy/allowedRegions/0"),
    ("region-duplicated", {"policy.allowedRegions": ["eu-de-berlin", "eu-de-berlin"]}, "/policy/allowedRegions"),
    ("region-not-a-list", {"policy.allowedRegions": "eu-de-berlin"}, "/policy/allowedRegions"),
    ("region-label-key-invalid", {"policy.regionLabelKey": "region label"}, "/policy/regionLabelKey"),
    ("headroom-too-large", {"policy.defaultMemoryHeadroom": 0.9}, "/policy/defaultMemoryHeadroom"),
    ("headroom-negative", {"policy.defaultMemoryHeadroom": -0.1}, "/policy/defaultMemoryHeadroom"),
    ("max-attempts-zero", {"policy.defaultMaxAttempts": 0}, "/policy/defaultMaxAttempts"),
    ("trainer-registry-with-scheme", {"policy.trainer.registry": "https://registry.example"}, "/policy/trainer/registry"),
    ("trainer-tag-empty", {"policy.trainer.tag": ""}, "/policy/trainer/tag"),
    ("pool-gpus-zero", lambda v: {"policy.catalog": _catalog_pool(v, 0, gpusPerNode=0)}, "/policy/catalog/0/gpusPerNode"),
    ("pool-interconnect-unknown", lambda v: {"policy.catalog": _catalog_pool(v, 1, intraNode="infiniband")},
     "/policy/catalog/1/intraNode"),
    ("pool-without-region", lambda v: {"policy.catalog": _catalog_pool(v, 1, region=None)}, "/policy/catalog/1"),
    ("pool-unknown-field", lambda v: {"policy.catalog": _catalog_pool(v, 0, gpuMemoryGiB=80)}, "'gpuMemoryGiB'"),
    ("pool-price-negative", lambda v: {"policy.catalog": _catalog_pool(v, 2, pricePerGpuHour=-1)},
     "/policy/catalog/2/pricePerGpuHour"),
    ("pool-memory-not-a-quantity", lambda v: {"policy.catalog": _catalog_pool(v, 0, hostMemory="lots")},
     "/policy/catalog/0/hostMemory"),
    ("pool-name-uppercase", lambda v: {"policy.catalog": _catalog_pool(v, 0, name="H100-Berlin")}, "/policy/catalog/0/name"),
    ("pool-selector-value-injection", lambda v: {"policy.catalog": _catalog_pool(v, 0, selector={"pool": "a}\nb: c"})},
     "/policy/catalog/0/selector/pool"),
    ("pool-taint-effect", lambda v: {"policy.catalog": _catalog_pool(v, 0, taints=[{"key": "gpu", "effect": "Never"}])},
     "/policy/catalog/0/taints/0/effect"),
    ("object-storage-endpoint-with-path", {"policy.objectStorage": [{"endpoint": "https://s3.example/bucket", "region": "eu-de-berlin"}]},
     "/policy/objectStorage/0/endpoint"),
    ("object-storage-without-region", {"policy.objectStorage": [{"endpoint": "https://s3.example"}]}, "/policy/objectStorage/0"),
    ("object-storage-region-invalid", {"policy.objectStorage": [{"endpoint": "https://s3.example", "region": "eu de"}]},
     "/policy/objectStorage/0/region"),
    ("watch-list-empty", {"watch.allNamespaces": False}, "/watch/namespaces"),
    ("watch-all-with-list", {"watch.namespaces": ["team-a"]}, "/watch/namespaces"),
    ("watch-namespace-invalid", {"watch.allNamespaces": False, "watch.namespaces": ["Team_A"]}, "/watch/namespaces/0"),
    ("log-level-unknown", {"logLevel": "verbose"}, "/logLevel"),
    ("log-format-unknown", {"logFormat": "xml"}, "/logFormat"),
    ("image-digest-short", {"image.digest": "sha256:abc"}, "/image/digest"),
    ("image-tag-with-space", {"image.tag": "1.0 beta"}, "/image/tag"),
    ("health-port-out-of-range", {"health.port": 70000}, "/health/port"),
    ("metrics-port-string", {"metrics.port": "9090"}, "/metrics/port"),
    ("service-account-without-name", {"serviceAccount.create": False}, "/serviceAccount"),
    ("run-as-root", {"securityContext.runAsUser": 0}, "/securityContext/runAsUser"),
    ("pdb-min-zero", {"podDisruptionBudget.minAvailable": 0}, "/podDisruptionBudget/minAvailable"),
    ("spread-unknown-mode", {"topologySpread.whenUnsatisfiable": "Sometimes"}, "/topologySpread/whenUnsatisfiable"),
    ("monitor-interval", {"metrics.serviceMonitor.interval": "soon"}, "/metrics/serviceMonitor/interval"),
    ("lease-name-invalid", {"leaderElection.leaseName": "Finetune Operator"}, "/leaderElection/leaseName"),
    ("lease-name-empty", {"leaderElection.leaseName": ""}, "/leaderElection/leaseName"),
    ("lease-enabled-string", {"leaderElection.enabled": "yes"}, "/leaderElection/enabled"),
    ("peering-is-gone", {"peering": {"name": "finetune-operator"}}, "peering"),
]


def _bad(values: dict[str, Any], changes: Any) -> dict[str, Any]:
    if callable(changes):
        changes = changes(values)
    return with_values(values, **changes)


@pytest.mark.parametrize("case,changes,path", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_helm_rejects_bad_values_naming_the_path(helm, default_values, tmp_path, case, changes, path):
    proc = helm.template(_bad(default_values, changes), tmp_path)
    assert proc.returncode != 0, f"{case}: helm accepted the values"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert path in proc.stderr, f"{case}: {path!r} not named in:\n{proc.stderr}"


@pytest.mark.parametrize("case,changes,path", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_schema_alone_rejects_bad_values(default_values, case, changes, path):
    """The same cases against the schema with Python's jsonschema (no helm needed)."""
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(_bad(default_values, changes)))
    assert errors, case


def test_schema_is_valid_and_accepts_the_defaults(default_values):
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(default_values, SCHEMA)


def test_schema_covers_every_value(default_values):
    """Every key of values.yaml is described (additionalProperties false all the way down), so a typo
    anywhere is an error rather than a silently ignored value."""

    def walk(schema: dict[str, Any], value: Any, path: str) -> None:
        if isinstance(value, dict) and "properties" in schema:
            assert schema.get("additionalProperties") is False, f"{path or '/'} accepts unknown keys"
            for key, child in value.items():
                assert key in schema["properties"], f"{path}/{key} is not in the schema"
                walk(schema["properties"][key], child, f"{path}/{key}")
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                walk(schema["items"], item, f"{path}/{i}")

    walk(SCHEMA, default_values, "")


# Checks across values that a JSON schema cannot express fail the render with the value named.
TEMPLATE_CHECKS = [
    ("pdb-blocks-drains", {"podDisruptionBudget.minAvailable": 2}, "podDisruptionBudget.minAvailable (2) must be below replicaCount (2)"),
    ("duplicate-pool", lambda v: {"policy.catalog": v["policy"]["catalog"] + [v["policy"]["catalog"][0]]},
     'policy.catalog[3].name: pool "h100-berlin" is already defined at policy.catalog[0]'),
]


@pytest.mark.parametrize("case,changes,message", TEMPLATE_CHECKS, ids=[c[0] for c in TEMPLATE_CHECKS])
def test_template_checks_name_the_value(helm, default_values, tmp_path, case, changes, message):
    proc = helm.template(_bad(default_values, changes), tmp_path)
    assert proc.returncode != 0, case
    assert message in proc.stderr, proc.stderr


def test_require_crd_cannot_be_checked_offline(helm, default_values, tmp_path):
    """helm template does not ask the cluster, so requireCRD cannot fail there (only a real install can)."""
    proc = helm.template(with_values(default_values, **{"trainingOperator.requireCRD": True}), tmp_path)
    assert proc.returncode == 0, proc.stderr
