"""The upstream PyTorchJob CRD, read from the Go module cache at the version the lab pins.

The CRD is never copied into the repository: the lab's versions.env names the Kubeflow
training operator release, and its module (which the lab downloads anyway) holds the CRD.
When the module is not in the cache yet, `go mod download` fetches just that module.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
VERSIONS_MODULE = REPO / "e2e" / "lab" / "versions.py"
MODULE = "github.com/kubeflow/training-operator"
CRD_IN_MODULE = "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"


class UpstreamCrdMissing(RuntimeError):
    """The CRD could not be found or downloaded; the message says what to run."""


def training_operator_version() -> str:
    spec = importlib.util.spec_from_file_location("_lab_versions", VERSIONS_MODULE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module.parse_versions(module.VERSIONS_FILE.read_text()).training_operator


def _module_cache_dir(version: str) -> Path:
    go = shutil.which("go")
    if go is None:
        raise UpstreamCrdMissing("the `go` command is not on PATH; it is needed to find the training operator module")
    cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    # Module paths are case-encoded in the cache (upper-case letters become !lower-case).
    encoded = re.sub(r"[A-Z]", lambda m: "!" + m.group(0).lower(), MODULE)
    return Path(cache) / f"{encoded}@{version}"


@functools.cache
def pytorchjob_crd_path() -> Path:
    version = training_operator_version()
    path = _module_cache_dir(version) / CRD_IN_MODULE
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as scratch:
        # Outside any module, so the repository's own go.mod files play no part.
        result = subprocess.run(
            ["go", "mod", "download", f"{MODULE}@{version}"],
            cwd=scratch,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if not path.exists():
        raise UpstreamCrdMissing(
            f"{path} is missing and `go mod download {MODULE}@{version}` did not fetch it"
            f" (exit {result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return path


@functools.cache
def pytorchjob_schema() -> dict[str, Any]:
    """The v1 openAPIV3Schema, made strict the way `kubectl apply` (strict field validation) is."""
    document = yaml.safe_load(pytorchjob_crd_path().read_text())
    versions = {v["name"]: v for v in document["spec"]["versions"]}
    return _strict(copy.deepcopy(versions["v1"]["schema"]["openAPIV3Schema"]))


def _strict(schema: Any) -> Any:
    """Unknown fields are errors (the API server would prune them silently, losing a setting)."""
    if isinstance(schema, dict):
        for value in schema.values():
            _strict(value)
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _strict(item)
    return schema


def go_string_constant(path_in_module: str, name: str) -> str:
    """The value of a Go string constant (`Name Type = "value"`) in the pinned training operator's source."""
    source = (pytorchjob_crd_path().parents[3] / path_in_module).read_text()
    match = re.search(rf'^\s*{re.escape(name)}\s+\w+\s*=\s*"([^"]*)"', source, re.MULTILINE)
    if match is None:
        raise UpstreamCrdMissing(f"no string constant {name} in {path_in_module} of {MODULE}")
    return match.group(1)


# ---------------------------------------------------------------------------
# Kubeflow Trainer v2: the TrainJob CRD of the release the lab pins (TRAINER_VERSION)
# ---------------------------------------------------------------------------

TRAINER_MODULE = "github.com/kubeflow/trainer/v2"
TRAINJOB_CRD = "trainer.kubeflow.org_trainjobs.yaml"
RUNTIME_CRD = "trainer.kubeflow.org_clustertrainingruntimes.yaml"


def _lab_versions():
    spec = importlib.util.spec_from_file_location("_lab_versions", VERSIONS_MODULE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def trainer_version() -> str:
    module = _lab_versions()
    version = module.parse_versions(module.VERSIONS_FILE.read_text()).trainer
    if not version:
        raise UpstreamCrdMissing("e2e/lab/versions.env pins no TRAINER_VERSION")
    return version


def _lab_share_crd(version: str, file_name: str) -> Path | None:
    """The CRD the lab build copied into <lab>/v2/<key>/share/trainer-crds/, for this version."""
    import json

    root = _lab_versions().cache_root()
    for build_json in sorted(root.glob("*/v2/*/build.json")):
        try:
            if json.loads(build_json.read_text())["versions"]["trainer"] != version:
                continue
        except (OSError, ValueError, KeyError):
            continue
        path = build_json.parent / "share" / "trainer-crds" / file_name
        if path.exists():
            return path
    return None


@functools.cache
def trainjob_crd_path() -> Path:
    return trainer_crd_path(TRAINJOB_CRD)


@functools.cache
def trainer_crd_path(file_name: str) -> Path:
    """A CRD of the pinned Kubeflow Trainer release: from the lab's build, else the Go module cache."""
    version = trainer_version()
    found = _lab_share_crd(version, file_name)
    if found is not None:
        return found
    go = shutil.which("go")
    if go is None:
        raise UpstreamCrdMissing("no lab build of Kubeflow Trainer and no `go` on PATH to find its module")
    cache = subprocess.run([go, "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
    encoded = re.sub(r"[A-Z]", lambda m: "!" + m.group(0).lower(), TRAINER_MODULE)
    path = Path(cache) / f"{encoded}@{version}" / "manifests" / "base" / "crds" / file_name
    if path.exists():
        return path
    with tempfile.TemporaryDirectory() as scratch:
        result = subprocess.run(["go", "mod", "download", f"{TRAINER_MODULE}@{version}"], cwd=scratch,
                                capture_output=True, text=True, timeout=600)
    if not path.exists():
        raise UpstreamCrdMissing(
            f"{path} is missing and `go mod download {TRAINER_MODULE}@{version}` did not fetch it"
            f" (exit {result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return path


@functools.cache
def trainjob_crd() -> dict[str, Any]:
    return yaml.safe_load(trainjob_crd_path().read_text())


@functools.cache
def trainjob_schema() -> dict[str, Any]:
    """The v1alpha1 openAPIV3Schema of TrainJob, strict like the PyTorchJob's."""
    versions = {v["name"]: v for v in trainjob_crd()["spec"]["versions"]}
    return _strict(copy.deepcopy(versions["v1alpha1"]["schema"]["openAPIV3Schema"]))


@functools.cache
def cluster_training_runtime_schema() -> dict[str, Any]:
    """The v1alpha1 openAPIV3Schema of ClusterTrainingRuntime, strict like the others."""
    document = yaml.safe_load(trainer_crd_path(RUNTIME_CRD).read_text())
    versions = {v["name"]: v for v in document["spec"]["versions"]}
    return _strict(copy.deepcopy(versions["v1alpha1"]["schema"]["openAPIV3Schema"]))
