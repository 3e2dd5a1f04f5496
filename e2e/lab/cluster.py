"""The lab cluster: a real control plane on loopback ports, fake GPU nodes, the training operator.

    lab = up()            # seconds when the binaries are cached (see build.py)
    lab.kubectl("get", "nodes")
    lab.down()            # stops every process it started, by pid, and removes its directory

Everything lives in one temporary directory (pki/, logs/, etcd data, kubeconfigs, lab.json);
lab.json records the pids so that `python -m e2e.lab down` from another process can stop it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import nodes as lab_nodes
from . import pki as lab_pki
from .build import Installation, find_installation
from .waiting import wait_crd_established
from .processes import LabStartError, Proc, free_ports, http_ok, is_alive, start, stop, tail, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
LAB_STAGES = Path(__file__).resolve().parent / "kwok" / "lab-pod-terminate.yaml"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
TRAINING_OPERATOR_NAMESPACE = "kubeflow"
WEBHOOK_CONFIGURATION = "validator.training-operator.kubeflow.org"
WEBHOOK_SECRET = "training-operator-webhook-cert"
PYTORCH_WEBHOOK = "validator.pytorchjob.training-operator.kubeflow.org"
# Controllers the lab needs from kube-controller-manager: ownerReference deletes, namespace
# deletion, the `default` ServiceAccount every pod needs, kube-root-ca.crt, and node
# lifecycle (it lifts the not-ready taint the apiserver puts on every new node, and would
# taint a node whose kwok heartbeat stopped).
CONTROLLERS = (
    "garbage-collector-controller",
    "node-lifecycle-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    # Binds the PersistentVolumes that e2e scenarios pre-create for a job's model/data/checkpoint claims;
    # the scheduler will not place a pod whose claims are unbound.
    "persistentvolume-binder-controller",
)

# With the optional components (JobSet, Trainer v2, Kueue): the Job controller, which turns a JobSet's
# (and a queued batch Job's) Jobs into pods.
JOB_CONTROLLERS = ("job-controller",)
# With a real node: Deployments become pods (the chart's operator), and Services get EndpointSlices
# (CoreDNS answers for them, kube-proxy routes them; torchrun's rendezvous goes through them).
REAL_NODE_CONTROLLERS = ("deployment-controller", "replicaset-controller", "endpointslice-controller")


class LabNotBuilt(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message carries kubectl's own error output."""

    def __str__(self) -> str:
        return f"{' '.join(self.cmd[2:])} failed (exit {self.returncode}): {(self.stderr or '').strip()}"


def _kubeconfig(server: str, ca: Path, user: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "finetune-lab", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "user", "user": user}],
        "contexts": [{"name": "finetune-lab", "context": {"cluster": "finetune-lab", "user": "user"}}],
        "current-context": "finetune-lab",
    }


def write_kubeconfig(path: Path, server: str, ca: Path, user: dict) -> Path:
    path.write_text(yaml.safe_dump(_kubeconfig(server, ca, user), sort_keys=False))
    path.chmod(0o600)
    return path


@dataclass
class Lab:
    workdir: Path
    home: Path  # the cached installation (binaries, upstream files)
    server: str
    ports: dict[str, int]
    procs: list[Proc] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    die_with_parent: bool = False  # processes get PR_SET_PDEATHSIG (labs owned by a test session)
    # Optional components started (components.COMPONENTS), and whether the PyTorchJob CRD and the
    # training operator are there.
    components: tuple[str, ...] = ()
    pytorchjob: bool = True
    v2_home: Path | None = None  # the cached JobSet/Trainer v2/Kueue build, when components are started
    node_home: Path | None = None  # the cached real-node build (kubelet, ...), with `--with kubelet`
    # What `down` could not put back on the host after a real node (realnode.restore_host); [] when all is.
    host_left: list[str] = field(default_factory=list)

    # ---- persistence -------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        return self.workdir / "lab.json"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.workdir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def installation(self) -> Installation:
        return Installation(self.home)

    def save(self) -> None:
        data = {
            "workdir": str(self.workdir),
            "home": str(self.home),
            "server": self.server,
            "ports": self.ports,
            "procs": [p.to_json() for p in self.procs],
            "started_at": self.started_at,
            "kubeconfig": str(self.kubeconfig),
            "components": list(self.components),
            "pytorchjob": self.pytorchjob,
            "v2_home": str(self.v2_home) if self.v2_home else None,
            "node_home": str(self.node_home) if self.node_home else None,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, workdir: Path) -> "Lab":
        data = json.loads((Path(workdir) / "lab.json").read_text())
        return cls(
            workdir=Path(data["workdir"]),
            home=Path(data["home"]),
            server=data["server"],
            ports={k: int(v) for k, v in data["ports"].items()},
            procs=[Proc(**p) for p in data["procs"]],
            started_at=data["started_at"],
            components=tuple(data.get("components", ())),
            pytorchjob=data.get("pytorchjob", True),
            v2_home=Path(data["v2_home"]) if data.get("v2_home") else None,
            node_home=Path(data["node_home"]) if data.get("node_home") else None,
        )

    # ---- using the lab -----------------------------------------------------------------
    @property
    def real_node(self) -> bool:
        from .components import REAL_NODE

        return REAL_NODE in self.components

    def binary(self, name: str) -> str:
        if self.node_home is not None and (self.node_home / "bin" / name).is_file():
            return Installation(self.node_home).binary(name)
        if self.v2_home is not None and (self.v2_home / "bin" / name).is_file():
            return Installation(self.v2_home).binary(name)
        return self.installation.binary(name)

    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should talk to this lab (kubectl, helm, the operator)."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.installation.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
        kubeconfig: Path | None = None,
        as_user: str | None = None,
        as_groups: tuple[str, ...] = (),
    ) -> subprocess.CompletedProcess:
        cmd = [self.binary("kubectl"), f"--kubeconfig={kubeconfig or self.kubeconfig}"]
        if as_user:
            cmd.append(f"--as={as_user}")
            cmd += [f"--as-group={g}" for g in as_groups]
        cmd += list(args)
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def api_client(self, kubeconfig: Path | None = None):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def impersonating_client(self, user: str, groups: tuple[str, ...] = ()):
        """An admin client that acts as `user` (the apiserver authorizes the request as that user)."""
        api = self.api_client()
        api.set_default_header("Impersonate-User", user)
        for g in groups:
            # The python client cannot repeat a default header; one group is what tests need.
            api.set_default_header("Impersonate-Group", g)
        return api

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path | None = None, hours: int = 6,
                                   server: str | None = None) -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/name with a real bound
        token (TokenRequest), so any client (the operator, kubectl, helm) runs with exactly that SA's RBAC.
        The ServiceAccount must exist (the chart creates it). `server`: another address of the API
        server (a proxy in front of it), the lab's own by default."""
        proc = self.kubectl("create", "token", name, "-n", namespace, f"--duration={hours}h")
        token = proc.stdout.strip()
        path = path or (self.workdir / f"sa-{namespace}-{name}.kubeconfig")
        return write_kubeconfig(path, server or self.server, self.pki_dir / "ca.crt", {"token": token})

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> Proc:
        """Start a process that belongs to the lab (e.g. the operator under test): its log goes
        to logs/<name>.log and `down` stops it with the rest."""
        proc = start(name, argv, self.log_dir, env=env if env is not None else self.env(),
                     die_with_parent=self.die_with_parent)
        self.procs.append(proc)
        self.save()
        return proc

    def stop_process(self, proc: Proc, kill: bool = False) -> None:
        """Stop one lab process: SIGTERM with a grace period, or at once with SIGKILL
        (what a crash or `kubectl delete pod --force` would look like to the cluster)."""
        stop([proc], grace=0 if kill else 10.0)

    def restart_process(self, name: str, down_for: float = 0.0, kill: bool = False, ready_timeout: float = 120.0) -> Proc:
        """Stop the lab process `name` (SIGTERM, or SIGKILL with kill=True), keep it down for
        `down_for` seconds, and start it again with the same command line: same ports, same
        etcd data, same certificates. For the kube-apiserver and etcd, waits until it serves
        again (/readyz, /health). The new process gets this process's environment, as `up` gives
        the control plane (etcd, apiserver, controller-manager, scheduler, kwok); the training
        operator and the fake GPU were started with extra variables and are not meant for this.
        Returns the new process record."""
        index = next((i for i, p in enumerate(self.procs) if p.name == name), None)
        if index is None:
            raise KeyError(f"no lab process named {name!r}")
        old = self.procs[index]
        if not old.argv:
            raise RuntimeError(f"{name} was started without a recorded command line; it cannot be restarted")
        stop([old], grace=0 if kill else 10.0)
        if down_for > 0:
            time.sleep(down_for)
        new = start(name, old.argv, self.log_dir, env=dict(os.environ), die_with_parent=self.die_with_parent)
        self.procs[index] = new
        self.save()
        if name == "kube-apiserver":
            ctx = _tls_context(self)
            wait_until("kube-apiserver /readyz after a restart", lambda: http_ok(f"{self.server}/readyz", ctx), new,
                       ready_timeout)
        elif name == "etcd":
            wait_until("etcd /health after a restart",
                       lambda: http_ok(f"http://127.0.0.1:{self.ports['etcd']}/health", expect=b'"health":"true"'),
                       new, ready_timeout)
        return new

    def restart_apiserver(self, down_for: float = 0.0, kill: bool = False) -> Proc:
        """Restart the kube-apiserver in place (same port, same etcd); see restart_process."""
        return self.restart_process("kube-apiserver", down_for=down_for, kill=kill)

    def status(self) -> dict[str, bool]:
        return {p.name: is_alive(p) for p in self.procs}

    def down(self, keep_workdir: bool = False) -> list[str]:
        """Stop every process of this lab, newest first; returns the names that needed SIGKILL."""
        # Clients first (together), then the apiserver, then etcd: an apiserver whose etcd is
        # already gone hangs in its graceful shutdown. A real node's kubelet goes first (it would
        # restart the pods), then its pods through the CRI, while containerd still runs.
        from . import realnode

        killed: list[str] = []
        if self.real_node:
            killed += stop([p for p in self.procs if p.name.startswith("kubelet")])
            realnode.remove_pods(self, self.node_home)
        backend = ("kube-apiserver", "etcd")
        killed += stop([p for p in self.procs if p.name not in backend])
        for name in backend:
            killed += stop([p for p in self.procs if p.name == name])
        self.host_left = realnode.restore_host(self.workdir)
        if self.host_left:
            print("the real node left host state it could not put back:\n  " + "\n  ".join(self.host_left),
                  file=sys.stderr)
        if not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return killed


# ---- bringing a lab up -----------------------------------------------------------------------
def _tls_context(lab: Lab) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(lab.pki_dir / "ca.crt"))
    admin = lab.pki_dir
    ctx.load_cert_chain(str(admin / "admin.crt"), str(admin / "admin.key"))
    return ctx


def _insecure_context() -> ssl.SSLContext:
    # The scheduler and controller-manager serve /healthz with a self-signed cert of their own.
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _component_kubeconfigs(lab: Lab) -> dict[str, Path]:
    ca = lab.pki_dir / "ca.crt"
    out = {}
    for ident in lab_pki.CLIENTS:
        user = {
            "client-certificate": str(lab.pki_dir / f"{ident.file_stem}.crt"),
            "client-key": str(lab.pki_dir / f"{ident.file_stem}.key"),
        }
        name = "admin.kubeconfig" if ident is lab_pki.ADMIN else f"{ident.file_stem}.kubeconfig"
        out[ident.file_stem] = write_kubeconfig(lab.workdir / name, lab.server, ca, user)
    return out


def audit_log(lab: Lab) -> Path:
    return lab.log_dir / "audit.log"


def _audit_policy(lab: Lab) -> Path:
    """The API server's audit policy: the metadata (who, verb, object, user agent, response code, when)
    of every write by a ServiceAccount, nothing else (the lab's own components authenticate with
    certificates, and their heartbeats would drown it)."""
    path = lab.workdir / "audit-policy.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
        "rules": [
            # A FineTuneJob's status patches with their body: a progress patch (a JSON patch that tests
            # the attempt first) is told from a conditions patch (guarded by a resourceVersion).
            {"level": "Request", "userGroups": ["system:serviceaccounts"], "verbs": ["patch"],
             "resources": [{"group": "finetune.dev", "resources": ["finetunejobs/status"]}]},
            {"level": "Metadata", "userGroups": ["system:serviceaccounts"],
             "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
            {"level": "None"}]}, sort_keys=False))
    return path


def audit_events(lab: Lab) -> list[dict]:
    """The audit log's events so far (audit_log), oldest first."""
    path = audit_log(lab)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _kwok_config(lab: Lab) -> Path:
    """kwok's stages: its own (node heartbeat, pod ready, pod delete) and the fake GPU's. kwok manages
    only its own nodes (an annotation selects them), so the real nodes' pods are the kubelets'."""
    docs = []
    for text in [f.read_text() for f in sorted((lab.home / "share" / "kwok-stages").glob("*.yaml"))] + [LAB_STAGES.read_text()]:
        docs.append(yaml.safe_dump(yaml.safe_load(text), sort_keys=False).strip())
    path = lab.workdir / "kwok.yaml"
    path.write_text("\n---\n".join(docs) + "\n")
    return path


def _webhook_configuration(lab: Lab, ca_pem: bytes) -> dict:
    """The training operator's own PyTorchJob webhook (from its release manifests), pointed at
    the local process instead of an in-cluster Service the lab cannot route."""
    manifest = yaml.safe_load((lab.home / "share" / "training-operator-webhooks.yaml").read_text())
    hooks = [h for h in manifest["webhooks"] if h["name"] == PYTORCH_WEBHOOK]
    if len(hooks) != 1:
        raise LabStartError(f"{PYTORCH_WEBHOOK} not found in the training operator's webhook manifest")
    hook = hooks[0]
    path = hook["clientConfig"]["service"]["path"]
    hook["clientConfig"] = {
        "url": f"https://127.0.0.1:{lab.ports['to-webhook']}{path}",
        "caBundle": base64.b64encode(ca_pem).decode(),
    }
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIGURATION},
        "webhooks": [hook],
    }


def up(
    workdir: Path | None = None,
    die_with_parent: bool = False,
    say=None,
    start_fake_gpu: bool = True,
    components: tuple[str, ...] | str | None = None,
    pytorchjob: bool = True,
) -> Lab:
    """Start a lab. On any failure everything started so far is stopped again.

    `components`: optional components to start too, e.g. ("trainer-v2", "kueue") (see
    e2e/lab/components.py); `pytorchjob=False` leaves out the PyTorchJob CRD and the training
    operator (a cluster with only TrainJob)."""
    from . import components as lab_components
    from .build import find_v2

    say = say or (lambda msg: print(f"[lab] {msg}", file=sys.stderr, flush=True))
    components = lab_components.parse_components(components)
    inst = find_installation()
    if inst is None:
        raise LabNotBuilt("the lab's binaries are not built: run `python -m e2e.lab build` (or e2e/lab/build.sh)")
    v2_wanted = [c for c in components if c in lab_components.V2_COMPONENTS]
    v2 = find_v2() if v2_wanted else None
    if v2_wanted and v2 is None:
        raise LabNotBuilt(f"{', '.join(v2_wanted)} not built: run `python -m e2e.lab build` (or e2e/lab/build.sh)")
    node = None
    if lab_components.REAL_NODE in components:
        from .build import find_node

        node = find_node()
        if node is None:
            raise LabNotBuilt("the real node's binaries are not built: run `python -m e2e.lab build --with kubelet`")
    t0 = time.monotonic()
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="finetune-lab-"))
    # Ports are picked free and released before the components bind them; another lab
    # starting at the same moment can take one in between. That shows as "address already in
    # use" and is worth one more try on fresh ports; anything else is a real failure.
    for attempt in (1, 2):
        lab = _prepare(workdir, inst, die_with_parent)
        lab.components, lab.pytorchjob, lab.v2_home = components, pytorchjob, (v2.home if v2 else None)
        lab.node_home = node.home if node else None
        lab.save()
        try:
            _bring_up(lab, inst, say, start_fake_gpu)
            break
        except LabStartError as exc:
            say(f"start failed; stopping what was started (logs kept in {lab.log_dir})")
            lab.down(keep_workdir=True)
            if attempt == 1 and "address already in use" in str(exc):
                say("a port was taken meanwhile; starting again on fresh ports")
                shutil.rmtree(workdir, ignore_errors=True)
                continue
            raise
        except BaseException:
            say(f"start failed; stopping what was started (logs kept in {lab.log_dir})")
            lab.down(keep_workdir=True)
            raise
    say(f"lab ready in {time.monotonic() - t0:.1f}s: KUBECONFIG={lab.kubeconfig}")
    return lab


def _prepare(workdir: Path, inst: Installation, die_with_parent: bool) -> Lab:
    from . import components as lab_components

    workdir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(
        ["etcd", "etcd-peer", "apiserver", "scheduler", "controller-manager", "kwok",
         "to-metrics", "to-health", "to-webhook", *lab_components.PORTS]
    )
    lab = Lab(workdir=workdir, home=inst.home, server=f"https://127.0.0.1:{ports['apiserver']}", ports=ports,
              die_with_parent=die_with_parent)
    lab.log_dir.mkdir(exist_ok=True)
    lab.save()
    return lab


def _bring_up(lab: Lab, inst: Installation, say, start_fake_gpu: bool) -> None:
    p = lab.ports
    from . import realnode

    # With a real node, pods reach the API server at the node's gateway address (and the `kubernetes`
    # Service): it listens on all addresses, and its certificate names that one too.
    pki = lab_pki.make_lab_pki(lab.pki_dir, SERVICE_IP, extra_ips=(realnode.GATEWAY,) if lab.real_node else ())
    kubeconfigs = _component_kubeconfigs(lab)

    def launch(name: str, argv: list[str], env: dict | None = None) -> Proc:
        return lab.spawn(name, argv, env=env if env is not None else dict(os.environ))

    etcd = launch("etcd", [
        inst.binary("etcd"),
        "--name=lab",
        f"--data-dir={lab.workdir / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{p['etcd']}",
        f"--advertise-client-urls=http://127.0.0.1:{p['etcd']}",
        f"--listen-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd-peer']}",
        f"--initial-cluster=lab=http://127.0.0.1:{p['etcd-peer']}",
        "--initial-cluster-state=new",
        # A throwaway test store on a shared disk: durability is not worth the fsync latency.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ])
    wait_until("etcd /health", lambda: http_ok(f"http://127.0.0.1:{p['etcd']}/health", expect=b'"health":"true"'), etcd, 60)

    apiserver = launch("kube-apiserver", [
        inst.binary("kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{p['etcd']}",
        f"--bind-address={'0.0.0.0' if lab.real_node else '127.0.0.1'}",
        f"--advertise-address={realnode.GATEWAY if lab.real_node else '127.0.0.1'}",
        f"--secure-port={p['apiserver']}",
        f"--tls-cert-file={pki.apiserver.cert}",
        f"--tls-private-key-file={pki.apiserver.key}",
        f"--client-ca-file={pki.ca.cert}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--api-audiences={SA_ISSUER}",
        f"--service-account-key-file={pki.service_account.cert}",
        f"--service-account-signing-key-file={pki.service_account.key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # The default `kubernetes` Endpoints would point at 127.0.0.1, which Endpoints reject.
        "--endpoint-reconciler-type=none",
        f"--cert-dir={lab.workdir / 'apiserver-certs'}",
        "--allow-privileged=true",
        "--profiling=false",
        "--event-ttl=2h",
        # kwok's nodes report 127.0.0.1 and kwok's port (below): pods/log reaches kwok there.
        # No --kubelet-certificate-authority: kwok serves a self-signed certificate.
        "--kubelet-preferred-address-types=InternalIP",
        # What ServiceAccounts (the operator under test, pods) write, one JSON line per request
        # (audit_events()): which replica wrote what and when the API server got it.
        f"--audit-policy-file={_audit_policy(lab)}",
        f"--audit-log-path={audit_log(lab)}",
        "--audit-log-format=json",
    ])
    ctx = _tls_context(lab)
    wait_until("kube-apiserver /readyz", lambda: http_ok(f"{lab.server}/readyz", ctx), apiserver, 120)
    say("apiserver ready")

    launch("kube-controller-manager", [
        inst.binary("kube-controller-manager"),
        f"--kubeconfig={kubeconfigs['controller-manager']}",
        "--bind-address=127.0.0.1",
        f"--secure-port={p['controller-manager']}",
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS + (JOB_CONTROLLERS if lab.components else ()) + (REAL_NODE_CONTROLLERS if lab.real_node else ()))}",
        f"--root-ca-file={pki.ca.cert}",
        "--use-service-account-credentials=false",
        "--cluster-name=finetune-lab",
    ])
    launch("kube-scheduler", [
        inst.binary("kube-scheduler"),
        f"--kubeconfig={kubeconfigs['scheduler']}",
        "--bind-address=127.0.0.1",
        f"--secure-port={p['scheduler']}",
        "--leader-elect=false",
    ])
    # kwok's Logs CRD: a Logs object names the file that holds a fake pod's container log (e2e/test_progress.py).
    from .build import ensure_kwok_logs_crd

    lab.kubectl("apply", "--server-side", "-f", str(ensure_kwok_logs_crd(inst)))
    wait_crd_established(lab, "logs.kwok.x-k8s.io")
    launch("kwok", [
        inst.binary("kwok"),
        f"--kubeconfig={kubeconfigs['kwok']}",
        f"--config={_kwok_config(lab)}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={lab_nodes.KWOK_ANNOTATION}={lab_nodes.KWOK_ANNOTATION_VALUE}",
        f"--server-address=127.0.0.1:{p['kwok']}",
        "--node-lease-duration-seconds=40",
        # Every fake node's kubelet endpoint is this kwok (pods/log, `kubectl logs`), and kwok reads
        # a pod's log from the file its Logs object names.
        "--node-ip=127.0.0.1",
        f"--node-port={p['kwok']}",
        "--enable-crds=Logs",
        # Fake pod IPs (data only, nothing routes to them); a /16 so a long run cannot exhaust it.
        "--cidr=10.244.0.1/16",
    ])

    from kubernetes import client

    api = lab.api_client()
    core = client.CoreV1Api(api)
    for manifest in lab_nodes.all_node_manifests():
        core.create_node(manifest)

    if lab.pytorchjob:
        training_operator = _start_training_operator(lab, inst, pki, kubeconfigs, core, api, launch)

    if start_fake_gpu:
        launch("fake-gpu", [sys.executable, "-m", "e2e.lab.fakegpu", f"--kubeconfig={kubeconfigs['fake-gpu']}"],
               env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})

    def nodes_ready() -> bool:
        items = core.list_node().items
        ready = [
            n for n in items
            if any(c.type == "Ready" and c.status == "True" for c in (n.status.conditions or []))
            and not any(t.key.startswith("node.kubernetes.io/") for t in (n.spec.taints or []))
        ]
        return len(ready) == len(items) > 0

    wait_until("all fake nodes Ready (kwok) and untainted (node lifecycle controller)", nodes_ready, lab.procs[[q.name for q in lab.procs].index("kwok")], 60)
    say("nodes ready")
    if lab.pytorchjob:
        _wait_training_operator(lab, pki, api, training_operator)
    from . import components as lab_components

    v2_components = tuple(c for c in lab.components if c in lab_components.V2_COMPONENTS)
    if v2_components:
        lab_components.start(lab, Installation(lab.v2_home), pki, kubeconfigs, v2_components, launch, say)
    if lab.real_node:
        _start_real_node(lab, pki, core, launch, say)
    wait_until(
        "scheduler /healthz",
        lambda: http_ok(f"https://127.0.0.1:{p['scheduler']}/healthz", _insecure_context()),
        lab.procs[[q.name for q in lab.procs].index("kube-scheduler")], 60,
    )
    wait_until(
        "ServiceAccount default/default (controller-manager)",
        lambda: bool(core.read_namespaced_service_account("default", "default")),
        lab.procs[[q.name for q in lab.procs].index("kube-controller-manager")], 60,
    )
    for proc in lab.procs:
        if not is_alive(proc):
            raise LabStartError(f"{proc.name} died during start-up:\n{tail(proc.log)}")


def _start_real_node(lab: Lab, pki, core, launch, say) -> None:
    """The real kubelet node (realnode.py) with the images it may run: the pause image always, the
    operator and trainer images when `python -m e2e.lab images` built them."""
    from . import images as lab_images
    from . import realnode

    node = Installation(lab.node_home)
    archives = [lab_images.build_pause(node.bin / "pause", realnode.PAUSE_IMAGE, say=say)]
    for spec in lab_images.specs():
        built = lab_images.find_image(spec)
        if built is None:
            say(f"{spec.name} image not built (`python -m e2e.lab images`): not imported into the real node")
        else:
            archives.append(built.archive)
    from kubernetes import client

    client.DiscoveryV1Api(lab.api_client()).create_namespaced_endpoint_slice(
        "default", realnode.kubernetes_endpoints(lab.ports["apiserver"]))
    realnode.start(lab, node, pki, launch, say, archives)
    _start_gpu_webhook(lab, pki, launch)


def _start_gpu_webhook(lab: Lab, pki, launch) -> None:
    """The lab GPU's variables for the real node's training pods (gpuwebhook.py), behind the API server."""
    import socket

    from kubernetes import client

    from . import gpuwebhook

    port = free_ports(["gpu-webhook"])["gpu-webhook"]
    lab.ports["gpu-webhook"] = port
    lab.save()
    proc = launch("gpu-webhook", [sys.executable, "-m", "e2e.lab.gpuwebhook", f"--kubeconfig={lab.kubeconfig}",
                                  f"--port={port}", f"--cert={pki.webhook_server.cert}", f"--key={pki.webhook_server.key}"])

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until("the lab GPU webhook", listening, proc, 60)
    client.AdmissionregistrationV1Api(lab.api_client()).create_mutating_webhook_configuration(
        gpuwebhook.webhook_configuration(port, pki.webhook_ca.cert_pem()))


def _start_training_operator(lab: Lab, inst: Installation, pki, kubeconfigs, core, api, launch) -> Proc:
    """The training operator: its PyTorchJob CRD, namespace, webhook cert Secret and webhook
    configuration, then the process itself (see e2e/README.md, "Webhooks")."""
    from kubernetes import client

    p = lab.ports
    lab.kubectl("apply", "--server-side", "-f", str(lab.home / "share" / "pytorchjob-crd.yaml"))
    core.create_namespace({"metadata": {"name": TRAINING_OPERATOR_NAMESPACE}})
    core.create_namespaced_secret(TRAINING_OPERATOR_NAMESPACE, {
        "metadata": {"name": WEBHOOK_SECRET},
        "type": "kubernetes.io/tls",
        "data": {
            "ca.crt": base64.b64encode(pki.webhook_ca.cert_pem()).decode(),
            "ca.key": base64.b64encode(pki.webhook_ca.key_pem()).decode(),
            "tls.crt": base64.b64encode(pki.webhook_server.cert_pem()).decode(),
            "tls.key": base64.b64encode(pki.webhook_server.key_pem()).decode(),
        },
    })
    client.AdmissionregistrationV1Api(api).create_validating_webhook_configuration(
        _webhook_configuration(lab, pki.webhook_ca.cert_pem())
    )
    wait_crd_established(lab, "pytorchjobs.kubeflow.org")
    to_tmp = lab.workdir / "training-operator-tmp"
    certs = to_tmp / "k8s-webhook-server" / "serving-certs"
    certs.mkdir(parents=True)
    shutil.copyfile(pki.webhook_server.cert, certs / "tls.crt")
    shutil.copyfile(pki.webhook_server.key, certs / "tls.key")
    _satisfy_rotator_mount_check(pki)
    training_operator = launch("training-operator", [
        inst.binary("training-operator"),
        "--enable-scheme=pytorchjob",
        f"--metrics-bind-address=127.0.0.1:{p['to-metrics']}",
        f"--health-probe-bind-address=127.0.0.1:{p['to-health']}",
        f"--webhook-server-port={p['to-webhook']}",
        "--leader-elect=false",
        f"--kubeconfig={kubeconfigs['training-operator']}",
        *_init_container_flags(lab),
    ], env={**os.environ, "MY_POD_NAMESPACE": TRAINING_OPERATOR_NAMESPACE, "TMPDIR": str(to_tmp)})
    return training_operator


# The training operator's own worker init container (alpine:3.10, no securityContext) can neither be
# pulled on the real nodes nor pass the restricted Pod Security Standard; the template a platform team
# would give it instead (examples/training-operator/) runs in the operator image, which every real
# node has imported. A lab without real nodes keeps the default (kwok's pods never run it).
INIT_CONTAINER_TEMPLATE = REPO_ROOT / "examples" / "training-operator" / "init-pytorch.yaml"


def _init_container_flags(lab: Lab) -> list[str]:
    if not lab.real_node:
        return []
    from . import images as lab_images

    return [f"--pytorch-init-container-template-file={INIT_CONTAINER_TEMPLATE}",
            f"--pytorch-init-container-image={lab_images.image_names()['operator'][0]}"]


def _wait_training_operator(lab: Lab, pki, api, training_operator: Proc) -> None:
    from kubernetes import client

    p = lab.ports
    wait_until(
        "training operator /readyz (webhook certs and server)",
        lambda: http_ok(f"http://127.0.0.1:{p['to-health']}/readyz"),
        training_operator, 90,
    )
    # If the operator's cert rotator had judged the lab's webhook cert unfit, it would have
    # put a CA of its own into the webhook configuration and every PyTorchJob create would
    # fail TLS; say so now rather than in a confusing test failure.
    hook = client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
    if base64.b64decode(hook.webhooks[0].client_config.ca_bundle) != pki.webhook_ca.cert_pem():
        raise LabStartError(
            "the training operator replaced the lab's webhook CA (its cert rotator found the lab's cert unfit); "
            f"see {lab.log_dir / 'training-operator.log'}"
        )


# The cert rotator the training operator embeds checks, before it reports ready, that a file
# exists at this fixed path (in a pod, the Secret is mounted there). The webhook server itself
# reads its certs from $TMPDIR (set per lab), so the file here only has to exist.
ROTATOR_CERT_CHECK = Path("/tmp/k8s-webhook-server/serving-certs/tls.crt")


def _satisfy_rotator_mount_check(pki: lab_pki.LabPKI) -> None:
    if ROTATOR_CERT_CHECK.exists():
        return
    ROTATOR_CERT_CHECK.parent.mkdir(parents=True, exist_ok=True)
    tmp = ROTATOR_CERT_CHECK.with_name(f".tls.crt.{os.getpid()}")
    tmp.write_bytes(pki.webhook_server.cert_pem())
    tmp.replace(ROTATOR_CERT_CHECK)
