"""The operator on the lab: installed with the Helm chart (CRDs, RBAC, policy), run as a
local process that authenticates as the chart's ServiceAccount, so that a missing RBAC
rule fails the scenario instead of hiding behind the lab's admin credentials."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import yaml

from e2e.lab.waiting import wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "charts" / "finetune-operator"
RELEASE = "ft"
RELEASE_NAMESPACE = "finetune-system"


# How long an operator may take to exit after SIGTERM: its cleanup lets running reconciles end
# (up to 10 s) and hands the Lease back; an idle one exits in well under a second.
STOP_GRACE_SECONDS = 20.0
# Each stop of an OperatorProcess that did not end with exit 0 within its grace (see stop()).
unclean_stops: list[str] = []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install_chart(lab: Any, *extra: str) -> None:
    """helm install the chart with no operator pods (the operator runs as a local process here)."""
    helm = lab.binary("helm")
    cmd = [helm, "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
           "--create-namespace", "--set", "replicaCount=0", "--wait=false", *extra]
    proc = subprocess.run(cmd, env=lab.env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm install failed: {proc.stderr or proc.stdout}")


def install_chart_on_real_node(lab: Any, *extra: str, timeout: str = "5m") -> None:
    """helm install as a platform team would: the chart's operator Deployment (two replicas, leader
    election through the Lease) as real pods of the operator image, pinned to the lab's real kubelet
    node (e2e/lab/realnode.py), which repels other pods with its taints."""
    from e2e.lab import nodes as lab_nodes

    pool = lab_nodes.load_pools().kubelet_pool()
    tolerations = [{"key": t["key"], "operator": "Exists", "effect": t["effect"]} for t in lab_nodes.node_taints(pool)]
    cmd = [lab.binary("helm"), "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
           "--create-namespace", "--wait", f"--timeout={timeout}",
           "--set-json", "nodeSelector=" + json.dumps({lab_nodes.RUNNER_LABEL: lab_nodes.RUNNER_KUBELET}),
           "--set-json", "tolerations=" + json.dumps(tolerations), *extra]
    proc = subprocess.run(cmd, env=lab.env(), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pods = lab.kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide", check=False).stdout
        raise RuntimeError(f"helm install failed: {proc.stderr or proc.stdout}\n{pods}")


def service_account() -> str:
    return f"{RELEASE}-finetune-operator"


class OperatorProcess:
    """`finetune-operator run` as the chart's ServiceAccount; start, kill -9 and start again."""

    def __init__(self, lab: Any, workdir: Path, extra_args: tuple[str, ...] = (), server: str | None = None) -> None:
        self.lab = lab
        self.extra_args = tuple(extra_args)  # more `finetune-operator run` flags, e.g. ("--workers", "8")
        # Its name in the leader election: one per replica, kept across restarts of it (as a pod's
        # name is across container restarts), so a restarted replica leads again at once.
        # None leaves the flag out (an operator from before the Lease election, e.g. bench/chaos.py --operator-rev).
        self.identity: str | None = f"operator-{workdir.name}-{uuid.uuid4().hex[:10]}"
        self.workdir = workdir
        # `server`: the API server through something in front of it (e2e/test_failover.py's frozen proxy).
        self.kubeconfig = lab.service_account_kubeconfig(RELEASE_NAMESPACE, service_account(),
                                                         path=workdir / "operator-sa.kubeconfig", server=server)
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "operator.log"
        self.health_port = free_port()
        self.metrics_port = free_port()
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts} =====\n")
        log.flush()
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        env.pop("KUBECONFIG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "finetune_operator.cli", "run", "--all-namespaces",
             "--kubeconfig", str(self.kubeconfig),
             "--policy-configmap", f"{RELEASE}-finetune-operator-policy", "--policy-namespace", RELEASE_NAMESPACE,
             "--health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
             "--log-format", "plain", "--log-level", "info", *(("--identity", self.identity) if self.identity else ()), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        wait_for(self._healthy, 60, "the operator's health endpoint")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.health_port), timeout=1) as sock:
                sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
                return b"200" in sock.recv(64)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, like a node failure: no cleanup runs."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM, as the kubelet stops a pod: the operator must exit 0 within `grace` (its
        cleanup hands the Lease back). Otherwise SIGKILL, and the stop is recorded in
        `unclean_stops`, which e2e/conftest.py turns into a failure of the module."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            start = time.monotonic()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
                unclean_stops.append(f"{self.identity or self.workdir.name}: still running {grace:.0f} s after "
                                     f"SIGTERM, SIGKILLed (log {self.log_path}):\n{self.logs()[-2000:]}")
                return
            if self.proc.returncode != 0:
                unclean_stops.append(f"{self.identity or self.workdir.name}: exit {self.proc.returncode} "
                                     f"{time.monotonic() - start:.1f} s after SIGTERM (log {self.log_path}):\n"
                                     f"{self.logs()[-2000:]}")

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def metrics(self) -> str:
        with socket.create_connection(("127.0.0.1", self.metrics_port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()


@contextlib.contextmanager
def running_operator(lab: Any, workdir: Path, extra_args: tuple[str, ...] = ()) -> Iterator[OperatorProcess]:
    """An operator started for a module's scenarios, stopped (and its log named) when they end."""
    process = OperatorProcess(lab, workdir, extra_args=extra_args)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        print(f"operator log: {process.log_path}")


def volumes(lab: Any, namespace: str, claims: list[str]) -> None:
    """PersistentVolumes pre-bound to the job's claims, so the scheduler can place the pods."""
    docs = []
    for claim in claims:
        pv = f"{namespace}-{claim}"
        docs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                     "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteMany"],
                              "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
                              "hostPath": {"path": f"/tmp/lab-volumes/{pv}"},
                              "claimRef": {"namespace": namespace, "name": claim}}})
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": claim, "namespace": namespace},
                     "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                              "resources": {"requests": {"storage": "100Gi"}}}})
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def local_volumes(lab: Any, namespace: str, claims: list[str], nodes: tuple[str, ...], owner: int = 1000) -> None:
    """`local` PersistentVolumes on the real nodes, pre-bound to the job's claims: directories of this
    machine, owned by the pods' user (rendering/pod.py runs them as uid 1000). The real nodes share this
    machine's disk, so one directory is reachable from each of them, as a shared filesystem is."""
    docs = []
    for claim in claims:
        pv = f"{namespace}-{claim}"
        path = Path("/tmp/lab-volumes") / pv
        path.mkdir(parents=True, exist_ok=True)
        for p in [path, *path.rglob("*")]:
            os.chown(p, owner, owner)
        docs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                     "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadWriteMany"],
                              "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                              "local": {"path": str(path)},
                              "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                                  {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}]}},
                              "claimRef": {"namespace": namespace, "name": claim}}})
        docs.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                     "metadata": {"name": claim, "namespace": namespace},
                     "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": pv,
                              "resources": {"requests": {"storage": "100Gi"}}}})
    lab.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def job_from_example(example: str, name: str, namespace: str, *, rule: dict[str, str] | None = None,
                     **spec: Any) -> dict[str, Any]:
    """An example FineTuneJob, renamed, with the lab's fake-GPU rule as annotations and spec overrides."""
    doc = copy.deepcopy(yaml.safe_load((REPO_ROOT / "examples" / example).read_text()))
    doc["metadata"] = {"name": name, "namespace": namespace,
                       "annotations": {f"lab.finetune.dev/{k}": v for k, v in (rule or {}).items()}}
    for key, value in spec.items():
        doc["spec"][key] = value
    return doc


def claims_of(job: dict[str, Any]) -> list[str]:
    found = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "claimName" in node:
                found.add(node["claimName"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(job["spec"])
    return sorted(found)


def apply_job(lab: Any, job: dict[str, Any]) -> None:
    volumes(lab, job["metadata"]["namespace"], claims_of(job))
    lab.kubectl("apply", "-f", "-", input=json.dumps(job))


def get_job(lab: Any, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(lab.kubectl("get", "ftj", name, "-n", namespace, "-o", "json").stdout)


def wait_phase(lab: Any, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 120) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        job = get_job(lab, namespace, name)
        return job if (job.get("status") or {}).get("phase") in phases else None

    return wait_for(check, timeout, f"FineTuneJob {namespace}/{name} in phase {'/'.join(phases)}", interval=0.5)


def pytorch_jobs(lab: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    out = lab.kubectl("get", "pytorchjobs", "-n", namespace, "-l", f"finetune.dev/job={job}", "-o", "json").stdout
    return json.loads(out)["items"]


def pods(lab: Any, namespace: str, job: str) -> list[dict[str, Any]]:
    out = lab.kubectl("get", "pods", "-n", namespace, "-l", f"finetune.dev/job={job}", "-o", "json").stdout
    return json.loads(out)["items"]


def events(lab: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    out = lab.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                      "-o", "json").stdout
    return sorted(json.loads(out)["items"], key=lambda e: e.get("lastTimestamp") or "")


def condition(job: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == type_), None)


def elapsed(start: float) -> str:
    return f"{time.monotonic() - start:.1f}s"
