"""FineTuneJobs on the lab's real kubelet node: the pieces the demo (e2e/demo.py) and the real-node
scenarios (e2e/test_real_node_training.py) share.

The node, the images and the lab start from their caches (built on first use); the operator is the
chart's Deployment on the node; a job's namespace enforces the restricted Pod Security Standard and
its claims are `local` volumes of the nodes. Root only: the node changes host-wide state while it runs
(e2e/lab/realnode.py records it and `down` puts it back).
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

from e2e import operator_harness as h
from e2e import real_processes as rp

POOL = "lab-real"  # the real node's pool in e2e/lab/pools.yaml
CLAIMS = ("models", "data", "checkpoints")


def start_lab(*, die_with_parent: bool = True, components: tuple[str, ...] = ("kubelet",), say=None):
    """Build (or reuse) the node's binaries and both images, then start a lab with the real node."""
    from e2e.lab import images
    from e2e.lab.build import build_node
    from e2e.lab.cluster import up

    build_node(say=say)
    t0 = time.monotonic()
    images.build_all(say=say)
    print(f"images (operator, trainer): {time.monotonic() - t0:.1f}s", flush=True)
    return up(die_with_parent=die_with_parent, components=components, say=say)


def install_operator(lab, *chart_values: str) -> float:
    """The CRD, then `helm install` of the chart with the operator Deployment on the real node, its
    policy allowing the node's pool; seconds until its pods were Ready."""
    lab.kubectl("apply", "--server-side", "-f", str(h.REPO_ROOT / "crds" / "finetunejob.yaml"))
    t0 = time.monotonic()
    h.install_chart_on_real_node(lab, *(chart_values or rp.chart_args(POOL)))
    return time.monotonic() - t0


def restricted_namespace(lab, name: str) -> int:
    """A namespace that enforces the restricted Pod Security Standard, with the tiny model and the
    dataset in its claims (local volumes of the node); the tiny model's vocabulary size."""
    from kubernetes import client

    from e2e.lab.realnode import NODE_NAMES
    from e2e.lab.waiting import wait_for

    core = client.CoreV1Api(lab.api_client())
    # Enforced by the API server (issue 26 item 4): the pods are admitted as the renderer writes
    # them and then run, read-only root filesystem and all.
    core.create_namespace({"metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), 30, "the default ServiceAccount")
    vocab = rp.write_assets(name)
    h.local_volumes(lab, name, list(CLAIMS), NODE_NAMES)
    return vocab


def job(name: str, namespace: str, vocab: int, **kw: Any) -> dict[str, Any]:
    """The tiny-Llama job of real_processes.tiny_job, placed in the real nodes' region."""
    return rp.tiny_job(name, namespace, vocab, region=rp.load_pools().pool(POOL).region, **kw)


def trainer_events(lab, namespace: str, pod: str, kind: str | None = None,
                   container: str = "pytorch") -> list[dict[str, Any]]:
    """The trainer's JSON log lines, through the kubelet's log endpoint (`kubectl logs`)."""
    out = lab.kubectl("logs", "-n", namespace, pod, "-c", container, check=False).stdout
    return rp.events(out.splitlines(), kind)


def crictl_containers(lab) -> list[dict[str, Any]]:
    """Every container of every real node's runtime, as `crictl ps -a` lists them."""
    from e2e.lab.build import Installation
    from e2e.lab.realnode import NODE_NAMES, node_paths

    found = []
    for name in NODE_NAMES:
        endpoint = node_paths(lab.workdir, name).endpoint
        out = subprocess.run([Installation(lab.node_home).binary("crictl"), f"--runtime-endpoint={endpoint}",
                              "ps", "-a", "-o", "json"], capture_output=True, text=True, check=True).stdout
        found += json.loads(out)["containers"]
    return found
