"""Every pod the operator makes (training on both backends, init, upload, profile) is one the restricted
Pod Security Standard admits, with no service-account token, a read-only root filesystem with explicit
writable volumes, and a bounded memory-backed /dev/shm. The lab's kube-apiserver enforces the same
standard on these pods in e2e/test_lab_pod_security.py."""

from __future__ import annotations

import pytest
from example_pods import example_pods

WRITABLE = {"/tmp", "/dev/shm"}
CACHE_ENV = {"HOME", "HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"}


def restricted_problems(pod: dict) -> list[str]:
    """What the restricted profile (and our own hardening beyond it) would refuse in `pod`."""
    spec = pod["spec"]
    problems = []
    if spec.get("automountServiceAccountToken") is not False:
        problems.append("automountServiceAccountToken is not false")
    pod_sc = spec.get("securityContext") or {}
    for kind in ("initContainers", "containers"):
        for c in spec.get(kind) or []:
            sc = c.get("securityContext") or {}
            where = f"{kind}[{c['name']}]"
            if sc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation")
            if (sc.get("capabilities") or {}).get("drop") != ["ALL"] or (sc.get("capabilities") or {}).get("add"):
                problems.append(f"{where}: capabilities")
            if not (sc.get("runAsNonRoot") or pod_sc.get("runAsNonRoot")):
                problems.append(f"{where}: runAsNonRoot")
            seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                problems.append(f"{where}: seccompProfile")
            if sc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: readOnlyRootFilesystem")
            if sc.get("privileged"):
                problems.append(f"{where}: privileged")
            mounts = {m["mountPath"] for m in c.get("volumeMounts") or []}
            if "/tmp" not in mounts:
                problems.append(f"{where}: no writable /tmp (HOME and the caches)")
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            for name in CACHE_ENV - {"HF_HOME"} if kind == "initContainers" else CACHE_ENV:
                value = env.get(name)
                if value is None or not any(value == w or value.startswith(w + "/") for w in WRITABLE):
                    problems.append(f"{where}: {name}={value!r} is not on a writable volume")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            problems.append(f"volume {v['name']}: hostPath")
        empty = v.get("emptyDir")
        if empty is not None and empty.get("medium") == "Memory" and not empty.get("sizeLimit"):
            problems.append(f"volume {v['name']}: memory-backed emptyDir without sizeLimit")
    if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
        problems.append("host namespaces")
    return problems


PODS = example_pods()


def test_the_examples_render_pods_of_every_kind():
    names = [p["metadata"]["name"] for p in PODS]
    assert any(n.endswith("-trainjob-node") for n in names) and any(n.endswith("-pytorchjob-master") for n in names)
    inits = {c["name"] for p in PODS for c in p["spec"].get("initContainers") or []}
    assert inits == {"fetch-model", "fetch-data", "upload"}
    assert any(c["command"][3] == "train-and-hand-off" for p in PODS for c in p["spec"]["containers"]
               if len(c["command"]) > 3)
    # Credentials only in the containers that transfer, never in one that trains.
    for p in PODS:
        for c in p["spec"]["containers"]:
            assert not any("valueFrom" in e for e in c.get("env") or []) and "envFrom" not in c, p["metadata"]["name"]
    assert any(p["metadata"]["name"].endswith("-profile") for p in PODS)


@pytest.mark.parametrize("pod", PODS, ids=lambda p: p["metadata"]["name"])
def test_each_pod_meets_the_restricted_standard_with_a_read_only_root(pod):
    assert restricted_problems(pod) == []
