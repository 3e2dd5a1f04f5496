"""The lab's real kubelet node (`up --with kubelet`, e2e/lab/realnode.py): real containers from the images
the lab builds from the Dockerfiles (e2e/lab/images.py), and a host put back as it was by `down`.

Opt-in (FINETUNE_LAB_REAL_NODE=1): it needs root, Debian's containerd/runc/CNI plugins, mmdebstrap and
umoci, and changes host-wide state (a bridge, iptables, sysctls, cgroups) while it runs; see e2e/README.md.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def node_lab(real_node_lab):
    return real_node_lab


def _pod(name: str, image: str, command: list[str], **container) -> dict:
    from e2e.lab.realnode import RUNNER_KUBELET, RUNNER_LABEL

    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {RUNNER_LABEL: RUNNER_KUBELET},
            "tolerations": [{"key": RUNNER_LABEL, "operator": "Exists", "effect": "NoSchedule"},
                            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "IfNotPresent",
                            "command": command, **container}],
        },
    }


def _wait_terminated(lab, ns: str, name: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pod = json.loads(lab.kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
        for cs in pod.get("status", {}).get("containerStatuses") or []:
            if "terminated" in cs.get("state", {}):
                return pod
        time.sleep(1)
    raise AssertionError(f"pod {name} did not end in {timeout}s: {json.dumps(pod.get('status'))[:2000]}")


# What a pod checks from inside: its identity, cluster DNS, and the API server through the `kubernetes`
# Service with its own ServiceAccount token (a real bound token, mounted by the kubelet).
PROBE = r"""
import json, os, socket, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
req = urllib.request.Request("https://kubernetes.default.svc/api/v1/namespaces/" + open(f"{sa}/namespace").read()
                             + "/pods", headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
try:
    status = urllib.request.urlopen(req, context=ctx, timeout=10).status
except urllib.error.HTTPError as exc:
    status = exc.code
print(json.dumps({"uid": os.getuid(), "dns": socket.gethostbyname("kubernetes.default.svc.cluster.local"),
                  "api": status, "shm": os.statvfs("/dev/shm").f_bsize > 0}))
"""


def test_a_pod_runs_as_a_real_container_with_dns_and_the_api_server(node_lab):
    from e2e.lab import images
    from e2e.lab.realnode import NODE_NAMES

    lab = node_lab
    ns = f"real-{uuid.uuid4().hex[:5]}"
    lab.kubectl("create", "namespace", ns)
    image = images.image_names()["operator"][0]
    lab.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_pod("probe", image, ["python", "-c", PROBE])))
    pod = _wait_terminated(lab, ns, "probe")
    assert pod["spec"]["nodeName"] in NODE_NAMES
    state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    logs = lab.kubectl("logs", "-n", ns, "probe").stdout  # through the kubelet's own log endpoint
    assert state["exitCode"] == 0, logs
    seen = json.loads(logs.strip().splitlines()[-1])
    # 403: the API server authenticated the pod's token as system:serviceaccount:<ns>:default (no RBAC to list).
    assert seen == {"uid": 1000, "dns": "10.96.0.1", "api": 403, "shm": True}


def test_a_container_over_its_memory_limit_is_oomkilled_by_the_kubelet(node_lab):
    from e2e.lab import images

    lab = node_lab
    ns = f"oom-{uuid.uuid4().hex[:5]}"
    lab.kubectl("create", "namespace", ns)
    image = images.image_names()["operator"][0]
    hog = "x = bytearray(400 * 2**20); import time; time.sleep(5)"
    lab.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_pod(
        "hog", image, ["python", "-c", hog], resources={"limits": {"memory": "128Mi", "cpu": "500m"}})))
    state = _wait_terminated(lab, ns, "hog")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137)


# The main container looks for the sidecar's key in every process environment it can read.
ENVIRON_SCAN = r"""
import json, os, time
secret = os.environ["OWN_MARKER"].replace("own", "sidecar")
time.sleep(3)  # the sidecar runs (a native sidecar starts before the main container)
found, readable = [], 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read()
    except OSError:
        continue
    readable += 1
    if secret.encode() in environ:
        found.append(pid)
print(json.dumps({"found": found, "readable": readable,
                  "own": os.environ["OWN_MARKER"].encode() in open("/proc/self/environ", "rb").read()}))
"""


def test_a_training_container_cannot_read_the_upload_sidecar_s_credentials(node_lab):
    """What keeps the S3 keys from the training processes (issue 26 item 5): they are only in the
    upload sidecar's environment, and a container's processes see only their own PID namespace. A
    pod shaped like the master's (a native sidecar with the key, a main container without) whose main
    container reads /proc/*/environ finds its own variables and never the sidecar's key."""
    from e2e.lab import images

    lab = node_lab
    ns = f"env-{uuid.uuid4().hex[:5]}"
    lab.kubectl("create", "namespace", ns)
    image = images.image_names()["operator"][0]
    marker = uuid.uuid4().hex
    pod = _pod("scan", image, ["python", "-c", ENVIRON_SCAN], env=[{"name": "OWN_MARKER", "value": f"own-{marker}"}])
    pod["spec"]["initContainers"] = [{
        "name": "upload", "image": image, "imagePullPolicy": "IfNotPresent", "restartPolicy": "Always",
        "command": ["python", "-c", "import time; time.sleep(3600)"],
        "env": [{"name": "FINETUNE_S3_SECRET_ACCESS_KEY", "value": f"sidecar-{marker}"}]}]
    # The control: the same pod sharing one PID namespace (which our pods never ask for) does leak it,
    # so a scan that finds nothing above means the boundary, not a scan that cannot see.
    shared = json.loads(json.dumps(pod))
    shared["metadata"]["name"] = "scan-shared"
    shared["spec"]["shareProcessNamespace"] = True
    seen = {}
    for body in (pod, shared):
        name = body["metadata"]["name"]
        lab.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(body))
        done = _wait_terminated(lab, ns, name)
        assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        seen[name] = json.loads(lab.kubectl("logs", "-n", ns, name, "-c", "main").stdout.strip().splitlines()[-1])
    assert seen["scan"]["own"] is True and seen["scan"]["readable"] >= 1, seen
    assert seen["scan"]["found"] == [], seen
    assert seen["scan-shared"]["found"], seen


def test_crictl_sees_the_node_s_containers(node_lab):
    from e2e.real_node_jobs import crictl_containers

    lab = node_lab
    names = {c["metadata"]["name"] for c in crictl_containers(lab)}
    assert "main" in names


def test_the_chart_runs_the_operator_as_real_pods(node_lab):
    """`helm install` as a platform team would, pinned to the real node: two replicas of the operator
    image, their ServiceAccount tokens, probes and one leader through the Lease."""
    from e2e.lab.realnode import NODE_NAMES
    from e2e.operator_harness import RELEASE_NAMESPACE, install_chart_on_real_node

    lab = node_lab
    t0 = time.monotonic()
    install_chart_on_real_node(lab)
    pods = json.loads(lab.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "json").stdout)["items"]
    print(f"real node: chart installed, 2 operator pods Ready in {time.monotonic() - t0:.1f}s")
    print(lab.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide").stdout)
    assert len(pods) == 2 and {p["spec"]["nodeName"] for p in pods} <= set(NODE_NAMES)
    assert all(c["ready"] for p in pods for c in p["status"]["containerStatuses"])
    lease = json.loads(lab.kubectl("get", "lease", "-n", RELEASE_NAMESPACE, "finetune-operator", "-o", "json").stdout)
    assert lease["spec"]["holderIdentity"].startswith(tuple(p["metadata"]["name"] for p in pods))
