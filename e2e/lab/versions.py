"""The lab's pinned upstream versions (read from versions.env) and where their binaries are cached."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

LAB_DIR = Path(__file__).resolve().parent
VERSIONS_FILE = LAB_DIR / "versions.env"
TOOLS_DIR = LAB_DIR / "tools"

_SEMVER = re.compile(r"^v(\d+)\.(\d+)\.(\d+)$")


class VersionsError(ValueError):
    """versions.env is missing a key or holds a malformed version."""


@dataclass(frozen=True)
class Versions:
    kubernetes: str
    etcd: str
    kwok: str
    training_operator: str
    helm: str
    # The lab's S3-compatible server (rclone `serve s3`). Optional in the file's grammar, and not
    # part of cache_key: it is built into its own directory under the lab's (build.s3_server_home),
    # so pinning or bumping it never rebuilds the Kubernetes binaries.
    rclone: str | None = None
    # Optional: JobSet, Kubeflow Trainer v2 and Kueue, started by `up --with trainer-v2,kueue`; built
    # into a cache directory of their own (build.v2_home), so they are not part of cache_key either.
    jobset: str | None = None
    trainer: str | None = None
    kueue: str | None = None
    # Optional: the real node's crictl and CoreDNS (`up --with kubelet`), built into build.node_home.
    crictl: str | None = None
    coredns: str | None = None

    @property
    def staging(self) -> str:
        """k8s.io/api & co. are published as v0.MINOR.PATCH for kubernetes v1.MINOR.PATCH."""
        major, minor, patch = _SEMVER.match(self.kubernetes).groups()
        return f"v0.{minor}.{patch}"

    @property
    def kubernetes_minor(self) -> str:
        return _SEMVER.match(self.kubernetes).group(2)

    def cache_key(self) -> str:
        """Binaries depend on the pinned versions and the tools module's dependency graph
        (go.sum); build.cache_key adds the Go version."""
        h = hashlib.sha256()
        for f in fields(self):
            if f.name in _OWN_CACHE:
                continue
            h.update(f"{f.name}={getattr(self, f.name)}\n".encode())
        go_sum = TOOLS_DIR / "go.sum"
        if go_sum.exists():
            h.update(go_sum.read_bytes())
        return h.hexdigest()[:16]


_KEYS = {
    "KUBERNETES_VERSION": "kubernetes",
    "ETCD_VERSION": "etcd",
    "KWOK_VERSION": "kwok",
    "TRAINING_OPERATOR_VERSION": "training_operator",
    "HELM_VERSION": "helm",
}
# Keys a versions.env may leave out; their components are built into a cache of their own.
_OPTIONAL_KEYS = {
    "RCLONE_VERSION": "rclone",
    "JOBSET_VERSION": "jobset",
    "TRAINER_VERSION": "trainer",
    "KUEUE_VERSION": "kueue",
    "CRICTL_VERSION": "crictl",
    "COREDNS_VERSION": "coredns",
}
_OWN_CACHE = set(_OPTIONAL_KEYS.values())


def parse_versions(text: str) -> Versions:
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise VersionsError(f"versions.env line {lineno}: expected KEY=VALUE, got {raw!r}")
        key, value = key.strip(), value.strip()
        known = {**_KEYS, **_OPTIONAL_KEYS}
        if key not in known:
            raise VersionsError(f"versions.env line {lineno}: unknown key {key!r} (known: {sorted(known)})")
        if not _SEMVER.match(value):
            raise VersionsError(f"versions.env: {key}={value!r} is not a version like v1.2.3")
        values[known[key]] = value
    missing = sorted(k for k, attr in _KEYS.items() if attr not in values)
    if missing:
        raise VersionsError(f"versions.env: missing {', '.join(missing)}")
    return Versions(**values)


def load_versions(path: Path = VERSIONS_FILE) -> Versions:
    return parse_versions(path.read_text())


def cache_root() -> Path:
    override = os.environ.get("FINETUNE_LAB_CACHE")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "finetune-operator" / "lab"
