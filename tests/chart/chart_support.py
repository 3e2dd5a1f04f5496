"""The helm binary and a renderer of the chart with a given set of values, for the chart tests.

helm comes from the lab's build (`make lab-build`, pinned in e2e/lab/versions.env), else from
~/.cache/finetune-operator/tools, else from PATH. Without one the tests skip, unless
FINETUNE_LAB_REQUIRED=1 (what `make test` and CI set), which makes that a failure.
"""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
# The lab's pinned versions and pools live in e2e/lab; `pytest tests/chart` alone must find them too.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
CHART = REPO / "charts" / "finetune-operator"
TOOLS_DIR = Path.home() / ".cache" / "finetune-operator" / "tools"


def _lab_helm() -> str | None:
    try:
        from e2e.lab.build import find_installation
    except ImportError:  # e2e is importable when pytest runs from the repository root
        return None
    inst = find_installation()
    return inst.binary("helm") if inst else None


def find_helm() -> str | None:
    for candidate in (_lab_helm(), str(TOOLS_DIR / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass(frozen=True)
class Rendered:
    """The objects one `helm template` produced, with lookups by kind and name."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None, namespace: str | None = None) -> dict[str, Any]:
        found = [
            o
            for o in self.of_kind(kind)
            if (name is None or o["metadata"]["name"] == name)
            and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]
        assert len(found) == 1, f"expected one {kind} {name or ''} {namespace or ''}, found {len(found)}"
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(o["kind"] for o in self.objects)


class Helm:
    def __init__(self, binary: str, home: Path) -> None:
        self.binary = binary
        # helm writes its cache, config and data under these; keep them out of the user's home.
        self.env = dict(os.environ)
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            self.env[var] = str(home / var.lower())
        self.env.pop("KUBECONFIG", None)

    def run(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.binary, *args], capture_output=True, text=True, env=self.env, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    def template(
        self, values: dict[str, Any] | None, tmp: Path, *, namespace: str = "finetune-system",
        release: str = "finetune-operator", extra: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess:
        args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", kubernetes_version(), *extra]
        if values is not None:
            text = yaml.safe_dump(values)
            path = tmp / f"values-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
            path.write_text(text)
            args += ["--values", str(path)]
        return self.run(*args)

    def render(self, values: dict[str, Any] | None, tmp: Path, **kw: Any) -> Rendered:
        proc = self.template(values, tmp, **kw)
        assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
        return Rendered([d for d in yaml.safe_load_all(proc.stdout) if d])


def with_values(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of `base` with dotted paths replaced: with_values(v, **{"watch.allNamespaces": False})."""
    out = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(leaf)] = value
        else:
            node[leaf] = value
    return out


def required() -> bool:
    return os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no")


ACCESS_FILE = Path(__file__).resolve().parent / "operator_access.yaml"


def kubernetes_version() -> str:
    """The lab's Kubernetes version (what `helm template --kube-version` renders for)."""
    try:
        from e2e.lab.versions import load_versions

        return load_versions().kubernetes
    except ImportError:
        return "v1.36.3"


def operator_access() -> dict[str, Any]:
    return yaml.safe_load(ACCESS_FILE.read_text())


Grant = tuple[str, str, str, str]  # (apiGroup, resource, verb, resourceName or "")


def granted(rules: list[dict[str, Any]]) -> set[Grant]:
    """Every (group, resource, verb, resourceName) a list of RBAC rules grants, wildcards kept as '*'."""
    out: set[Grant] = set()
    for rule in rules:
        names = rule.get("resourceNames") or [""]
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule["verbs"]:
                    for name in names:
                        out.add((group, resource, verb, name))
    return out


def applies(need: dict[str, Any], backend: str = "auto", kueue: bool = False) -> bool:
    """Whether a need of operator_access.yaml is granted under policy.trainingBackend `backend` and
    kueue.enabled."""
    when = need.get("when") or {}
    return backend in when.get("backends", [backend]) and (kueue or not when.get("kueue", False))


def needed(scope: str, lease_name: str = "finetune-operator", backend: str = "auto", kueue: bool = False) -> set[Grant]:
    """The grants operator_access.yaml lists for a scope (namespaced, cluster, lease, state, profile), under
    the chart's policy.trainingBackend and kueue.enabled values (the defaults: auto, false). They do not
    depend on which namespaces are watched."""
    out: set[Grant] = set()
    for need in operator_access()["needs"]:
        if need["scope"] != scope or not applies(need, backend, kueue):
            continue
        name = lease_name if need.get("resourceName") == "LEASE" else need.get("resourceName", "")
        for verb in need["verbs"]:
            out.add((need["group"], need["resource"], verb, name))
    return out


def forbidden(lease_name: str = "finetune-operator") -> list[tuple[str, str, str, str, str]]:
    """operator_access.yaml's forbidden list as (where, group, resource, verb, name): where is
    "watched" or "release"; group and resource split from kubectl's RESOURCE.GROUP; name "" for any."""
    out = []
    for item in operator_access()["forbidden"]:
        resource, _, group = item["resource"].partition(".")
        base, _, sub = resource.partition("/")
        name = {"LEASE": lease_name, "OTHER": "kube-scheduler", None: ""}[item.get("name")]
        out.append((item.get("where", "watched"), group, f"{base}/{sub}" if sub else base, item["verb"], name))
    return out
