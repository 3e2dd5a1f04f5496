"""Checks a rendered attempt must pass: the upstream PyTorchJob schema and the API server's name rules."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from finetune_operator.k8s_names import is_label_value, is_qualified_name
from upstream_crd import pytorchjob_schema

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CONFIG_MAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
ANNOTATIONS_LIMIT = 256 * 1024
CONFIG_MAP_LIMIT = 1024 * 1024


def schema_errors(pytorch_job: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(pytorchjob_schema())
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(pytorch_job)]


def metadata_errors(meta: dict[str, Any], where: str, *, needs_name: bool = True) -> list[str]:
    problems = []
    if needs_name and not (DNS1035.fullmatch(meta.get("name", "")) and len(meta["name"]) <= 63):
        problems.append(f"{where}.name {meta.get('name')!r} is not a DNS-1035 label")
    for key, value in meta.get("labels", {}).items():
        if not is_qualified_name(key):
            problems.append(f"{where}.labels: bad key {key!r}")
        if not isinstance(value, str) or not is_label_value(value):
            problems.append(f"{where}.labels[{key}]: bad value {value!r}")
    annotations = meta.get("annotations", {})
    for key, value in annotations.items():
        if not is_qualified_name(key) or not isinstance(value, str):
            problems.append(f"{where}.annotations: bad entry {key!r}")
    if sum(len(k) + len(v.encode()) for k, v in annotations.items()) > ANNOTATIONS_LIMIT:
        problems.append(f"{where}.annotations exceed 256 KiB")
    return problems


def pod_errors(template: dict[str, Any], where: str) -> list[str]:
    problems = metadata_errors(template["metadata"], f"{where}.metadata", needs_name=False)
    spec = template["spec"]
    volumes = [v["name"] for v in spec["volumes"]]
    if len(set(volumes)) != len(volumes):
        problems.append(f"{where}: duplicate volume names {volumes}")
    for volume in volumes:
        if not DNS1123_LABEL.fullmatch(volume):
            problems.append(f"{where}: volume name {volume!r} is not a DNS-1123 label")
    for container in spec["containers"] + spec.get("initContainers", []):
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                problems.append(f"{where}: container {container['name']} mounts unknown volume {mount['name']}")
        paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
        if len(set(paths)) != len(paths):
            problems.append(f"{where}: container {container['name']} mounts two volumes at one path")
    for term in spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]:
        for expression in term["matchExpressions"]:
            if not is_qualified_name(expression["key"]) or not expression["values"]:
                problems.append(f"{where}: bad node selector requirement {expression}")
    for toleration in spec["tolerations"]:
        if not is_qualified_name(toleration["key"]) or not is_label_value(toleration.get("value", "")):
            problems.append(f"{where}: bad toleration {toleration}")
    return problems


def attempt_errors(config_map: dict[str, Any], pytorch_job: dict[str, Any]) -> list[str]:
    """Everything the API server (and the training operator's webhook) would refuse."""
    problems = schema_errors(pytorch_job)
    problems += metadata_errors(pytorch_job["metadata"], "pytorchJob.metadata")
    if len(pytorch_job["metadata"]["name"]) > 63 - len("-worker-4095"):
        problems.append("pytorchJob name leaves no room for the replica suffix")
    for rtype, replica in pytorch_job["spec"]["pytorchReplicaSpecs"].items():
        problems += pod_errors(replica["template"], f"pytorchJob.{rtype}")
    problems += metadata_errors(config_map["metadata"], "configMap.metadata")
    for key in config_map["data"]:
        if not CONFIG_MAP_KEY.fullmatch(key):
            problems.append(f"configMap.data key {key!r}")
    if len(json.dumps(config_map).encode()) > CONFIG_MAP_LIMIT:
        problems.append("configMap exceeds 1 MiB")
    return problems
