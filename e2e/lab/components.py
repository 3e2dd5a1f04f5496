"""Optional lab components: JobSet + Kubeflow Trainer v2 (`trainer-v2`) and Kueue (`kueue`).

Started by `up(components=...)` (`python -m e2e.lab up --with trainer-v2,kueue`) after the control
plane and the nodes, each as a local process like the training operator:

- their CRDs, from the Go module cache of the pinned releases (copied into the build's share/ by
  build.build_v2), applied server-side and waited for until Established;
- their webhooks, from the releases' own webhook manifests, with `clientConfig.service` replaced by
  `url: https://127.0.0.1:<port><path>` and the lab's webhook CA as caBundle (the serving certificate
  is the lab's, valid for 127.0.0.1); each configuration is renamed `<component>-<name>` (all three
  releases call theirs `mutating-webhook-configuration` / `validating-webhook-configuration`);
  `failurePolicy` stays as released;
- their own certificate management is turned off (`certManagement.enable: false`,
  `internalCertManagement.enable: false`): the lab provides the certificates, as for the training
  operator;
- webhook and health ports chosen free per lab and bound on 127.0.0.1; metrics off.

Kueue gets only the integrations the lab can run (batch/job, JobSet, TrainJob) and only the webhooks
of those and of its own kinds; like a release install, its job webhooks skip kube-system and its own
namespace. The object selector JobSet's release puts on its pod webhooks (pods of a JobSet only)
is applied from the release's own kustomize patches.
"""

from __future__ import annotations

import base64
import copy
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import yaml

from .build import Installation
from .processes import LabStartError, Proc, http_ok, wait_until
from .waiting import wait_crd_established

TRAINER_V2 = "trainer-v2"
KUEUE = "kueue"
# A real kubelet node (containerd, CNI bridge, kube-proxy, CoreDNS): e2e/lab/realnode.py.
REAL_NODE = "kubelet"
COMPONENTS = (TRAINER_V2, KUEUE, REAL_NODE)
# The components built and started from the v2 build (JobSet, Trainer v2, Kueue).
V2_COMPONENTS = (TRAINER_V2, KUEUE)
PORTS = ("jobset-webhook", "jobset-health", "trainer-webhook", "trainer-health", "kueue-webhook", "kueue-health")
KUEUE_NAMESPACE = "kueue-system"
TRAINER_NAMESPACE = "kubeflow-system"
# The Kueue integrations the lab starts (frameworks the lab has controllers for).
KUEUE_FRAMEWORKS = ("batch/job", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob")
# Kueue webhooks kept: its own kinds, and the workload kinds of those integrations.
KUEUE_WEBHOOK_GROUPS = {"kueue.x-k8s.io", "batch", "jobset.x-k8s.io", "trainer.kubeflow.org"}


def parse_components(text: str | Iterable[str] | None) -> tuple[str, ...]:
    """`trainer-v2,kueue` -> ("trainer-v2", "kueue"); unknown names are an error naming the known ones."""
    if text is None:
        return ()
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text)]
    items = [t for t in items if t]
    unknown = [t for t in items if t not in COMPONENTS]
    if unknown:
        raise ValueError(f"unknown lab component(s) {unknown}; known: {list(COMPONENTS)}")
    return tuple(c for c in COMPONENTS if c in items)


def local_webhooks(manifest: Path, prefix: str, port: int, ca_pem: bytes,
                   keep: Callable[[dict], bool] = lambda hook: True,
                   patches: dict[str, list[dict]] | None = None) -> list[dict]:
    """The webhook configurations of a release manifest, pointed at a local process on `port`.

    `patches` maps a configuration kind to JSON-patch `replace /webhooks/<i>` operations (the
    release's kustomize patches), applied before the webhooks are filtered by `keep`."""
    out = []
    for doc in yaml.safe_load_all(manifest.read_text()):
        if not doc:
            continue
        doc = copy.deepcopy(doc)
        hooks = doc["webhooks"]
        for op in (patches or {}).get(doc["kind"], []):
            parts = op["path"].strip("/").split("/")
            if op.get("op") != "replace" or len(parts) != 2 or parts[0] != "webhooks":
                raise LabStartError(f"unsupported webhook patch {op!r} for {manifest.name}")
            hooks[int(parts[1])] = copy.deepcopy(op["value"])
        kept = []
        for hook in hooks:
            if not keep(hook):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca_pem).decode()}
            kept.append(hook)
        if kept:
            out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": doc["kind"],
                        "metadata": {"name": f"{prefix}-{doc['metadata']['name']}"}, "webhooks": kept})
    return out


def _kueue_keeps(hook: dict) -> bool:
    return all(set(rule.get("apiGroups", [])) <= KUEUE_WEBHOOK_GROUPS for rule in hook.get("rules", []))


def _kueue_scoped(hook: dict) -> dict:
    if not any("kueue.x-k8s.io" in rule.get("apiGroups", []) for rule in hook.get("rules", [])):
        hook["namespaceSelector"] = {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", KUEUE_NAMESPACE]}]}
    return hook


def _patch_ops(directory: Path) -> dict[str, list[dict]]:
    """JobSet's kustomize patches: mutating-patch.yaml / validating-patch.yaml, JSON-patch lists."""
    kinds = {"mutating": "MutatingWebhookConfiguration", "validating": "ValidatingWebhookConfiguration"}
    out: dict[str, list[dict]] = {}
    for f in sorted(directory.glob("*-patch.yaml")) if directory.is_dir() else []:
        kind = kinds.get(f.name.split("-", 1)[0])
        if kind:
            out[kind] = yaml.safe_load(f.read_text()) or []
    return out


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _cert_dir(lab, pki, name: str) -> Path:
    certs = lab.workdir / f"{name}-certs"
    certs.mkdir(exist_ok=True)
    (certs / "tls.crt").write_bytes(pki.webhook_server.cert_pem())
    (certs / "tls.key").write_bytes(pki.webhook_server.key_pem())
    (certs / "tls.key").chmod(0o600)
    return certs


def start(lab, v2: Installation, pki, kubeconfigs: dict[str, Path], components: tuple[str, ...],
          launch: Callable[..., Proc], say) -> None:
    """Install and start the optional components; returns when each serves /readyz."""
    from kubernetes import client

    api = lab.api_client()
    core = client.CoreV1Api(api)
    adm = client.AdmissionregistrationV1Api(api)
    p = lab.ports
    ca_pem = pki.webhook_ca.cert_pem()
    share = v2.share
    waits: list[tuple[str, str, Proc]] = []

    def env_for(name: str, **extra: str) -> dict:
        return {**os.environ, "KUBECONFIG": str(kubeconfigs[name]), **extra}

    def install_webhooks(configs: list[dict]) -> None:
        for cfg in configs:
            if cfg["kind"] == "MutatingWebhookConfiguration":
                adm.create_mutating_webhook_configuration(cfg)
            else:
                adm.create_validating_webhook_configuration(cfg)

    if TRAINER_V2 in components:
        crds = [share / "jobset-crds", share / "trainer-crds"]
        for d in crds:
            lab.kubectl("apply", "--server-side", "-f", str(d))
        wait_crd_established(lab, "jobsets.jobset.x-k8s.io", "trainjobs.trainer.kubeflow.org",
                             "clustertrainingruntimes.trainer.kubeflow.org", "trainingruntimes.trainer.kubeflow.org")
        install_webhooks(local_webhooks(share / "jobset-webhooks.yaml", "jobset", p["jobset-webhook"], ca_pem,
                                        patches=_patch_ops(share / "jobset-webhook-patches")))
        install_webhooks(local_webhooks(share / "trainer-webhooks.yaml", "trainer", p["trainer-webhook"], ca_pem))
        jobset_cfg = _write(lab.workdir / "jobset-config.yaml", {
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": p["jobset-webhook"], "host": "127.0.0.1",
                        "certDir": str(_cert_dir(lab, pki, "jobset"))},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{p['jobset-health']}"},
            "metrics": {"bindAddress": "0"},
        })
        jobset = launch("jobset", [v2.binary("jobset"), f"--config={jobset_cfg}", "--metrics-bind-address=0",
                                   f"--health-probe-bind-address=127.0.0.1:{p['jobset-health']}"],
                        env=env_for("jobset"))
        waits.append(("jobset", f"http://127.0.0.1:{p['jobset-health']}/readyz", jobset))
        core.create_namespace({"metadata": {"name": TRAINER_NAMESPACE}})
        trainer_tmp = lab.workdir / "trainer-tmp"
        serving = trainer_tmp / "k8s-webhook-server" / "serving-certs"
        serving.mkdir(parents=True)
        for f in ("tls.crt", "tls.key"):
            (serving / f).write_bytes((_cert_dir(lab, pki, "trainer") / f).read_bytes())
        trainer_cfg = _write(lab.workdir / "trainer-config.yaml", {
            "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{p['trainer-health']}",
                       "readinessEndpointName": "readyz", "livenessEndpointName": "healthz"},
            "metrics": {"bindAddress": "0", "secureServing": False},
            "webhook": {"port": p["trainer-webhook"], "host": "127.0.0.1"},
            "leaderElection": {"leaderElect": False},
            "certManagement": {"enable": False},
        })
        trainer = launch("trainer", [v2.binary("trainer-controller-manager"), f"--config={trainer_cfg}"],
                         env=env_for("trainer", TMPDIR=str(trainer_tmp), POD_NAMESPACE=TRAINER_NAMESPACE))
        waits.append(("Kubeflow Trainer", f"http://127.0.0.1:{p['trainer-health']}/readyz", trainer))

    if KUEUE in components:
        lab.kubectl("apply", "--server-side", "-f", str(share / "kueue-crds"))
        wait_crd_established(lab, "clusterqueues.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io",
                             "resourceflavors.kueue.x-k8s.io", "workloads.kueue.x-k8s.io")
        core.create_namespace({"metadata": {"name": KUEUE_NAMESPACE}})
        configs = local_webhooks(share / "kueue-webhooks.yaml", "kueue", p["kueue-webhook"], ca_pem, keep=_kueue_keeps)
        for cfg in configs:
            cfg["webhooks"] = [_kueue_scoped(h) for h in cfg["webhooks"]]
        install_webhooks(configs)
        kueue_cfg = _write(lab.workdir / "kueue-config.yaml", {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
            "namespace": KUEUE_NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{p['kueue-health']}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"port": p["kueue-webhook"], "host": "127.0.0.1",
                        "certDir": str(_cert_dir(lab, pki, "kueue"))},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            # The visibility API server would bind a fixed port on all interfaces; the lab does not use it.
            "featureGates": {"VisibilityOnDemand": False},
            "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
        })
        _satisfy_kueue_metrics_certs(pki)
        kueue = launch("kueue", [v2.binary("kueue"), f"--config={kueue_cfg}"], env=env_for("kueue"))
        waits.append(("Kueue", f"http://127.0.0.1:{p['kueue-health']}/readyz", kueue))

    for what, url, proc in waits:
        wait_until(f"{what} /readyz (webhook certs and server)", lambda url=url: http_ok(url), proc, 120)
        say(f"{what} ready")


# With its internal cert management off, Kueue v0.19 loads a metrics serving certificate from this
# fixed path at start (in a pod, a mounted Secret) and exits if it is missing, even with metrics off.
# The lab writes its webhook certificate there when nothing is: like the training operator's
# ROTATOR_CERT_CHECK (cluster.py), the one thing outside the lab's directory; concurrent labs share it.
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")


def _satisfy_kueue_metrics_certs(pki) -> None:
    if (KUEUE_METRICS_CERTS / "tls.crt").exists() and (KUEUE_METRICS_CERTS / "tls.key").exists():
        return
    try:
        KUEUE_METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name, data in (("tls.key", pki.webhook_server.key_pem()), ("tls.crt", pki.webhook_server.cert_pem())):
            tmp = KUEUE_METRICS_CERTS / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            tmp.replace(KUEUE_METRICS_CERTS / name)
    except OSError as exc:
        raise LabStartError(
            f"Kueue needs a certificate at {KUEUE_METRICS_CERTS}/tls.crt and tls.key (its metrics server loads it"
            f" at start) and the lab could not write one: {exc}"
        ) from None
