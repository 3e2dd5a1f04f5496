"""Fixtures for the end-to-end scenarios (pytest -m e2e).

- `lab` (session): a running lab cluster; see e2e/lab/cluster.py for what it offers
  (kubeconfig, kubectl(), api_client(), service_account_kubeconfig(), impersonating_client()).
  Skips with a clear message when the lab's binaries are not built, unless
  FINETUNE_LAB_REQUIRED=1, which turns that into a failure (CI sets it so e2e cannot be
  skipped silently). FINETUNE_LAB_REUSE=current|DIR uses a lab started by `python -m e2e.lab up`
  instead of starting one (and leaves it running).
- `namespace` (per test): a fresh namespace whose `default` ServiceAccount exists; deleted after.
- `ftj_crd` (session): the FineTuneJob CRD from crds/finetunejob.yaml, installed and Established.
- `operators_stop_cleanly` (module, autouse): the module fails when an operator it ran through
  e2e/operator_harness.py did not exit 0 within its grace after SIGTERM.
- `real_node_lab` (session): a lab of its own with the two real kubelet nodes and Trainer v2 (root,
  FINETUNE_LAB_REAL_NODE=1), shared by e2e/test_real_node.py and e2e/test_real_node_training.py;
  its teardown fails the session when `down` left the host other than it was.

`make test` runs the real nodes' two modules in one pytest process and the other lab scenarios in
another, at the same time (the Makefile says why); each process has its own session labs.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from e2e.lab.build import find_installation
from e2e.lab.versions import cache_root
from e2e.lab.waiting import wait_crd_established

REPO_ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = REPO_ROOT / "crds" / "finetunejob.yaml"


def _required() -> bool:
    return os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no")


def real_node_wanted() -> bool:
    return os.environ.get("FINETUNE_LAB_REAL_NODE", "") not in ("", "0")


@pytest.fixture(scope="session")
def real_node_lab():
    """The real nodes' lab: built (binaries, both images) and started once for both modules."""
    if not real_node_wanted():
        pytest.skip("the real nodes are opt-in: FINETUNE_LAB_REAL_NODE=1 (root, containerd, runc, CNI plugins, "
                    "mmdebstrap, umoci)")
    from e2e.lab.realnode import HostState
    from e2e.real_node_jobs import start_lab

    before = HostState.capture()
    lab = start_lab(components=("kubelet", "trainer-v2"))
    try:
        yield lab
    finally:
        if lab.procs:
            lab.down()
        left = lab.host_left + before.differences(HostState.capture())
        if left:
            pytest.fail("`down` did not put the host back as it was:\n  " + "\n  ".join(left), pytrace=False)


@pytest.fixture(scope="session")
def lab():
    from e2e.lab.cluster import Lab, up

    reuse = os.environ.get("FINETUNE_LAB_REUSE")
    if reuse:
        workdir = Path((cache_root() / "current-lab").read_text().strip()) if reuse == "current" else Path(reuse)
        yield Lab.load(workdir)
        return
    if find_installation() is None:
        msg = (
            "lab binaries are not built for e2e/lab/versions.env: run `e2e/lab/build.sh` "
            "(a cold build takes tens of minutes; later runs reuse ~/.cache/finetune-operator/lab)"
        )
        if _required():
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    lab = up(die_with_parent=True)
    try:
        yield lab
    finally:
        killed = lab.down(keep_workdir=bool(os.environ.get("FINETUNE_LAB_KEEP")))
        if killed:
            print(f"lab processes that needed SIGKILL: {killed}")


@pytest.fixture
def namespace(lab, request):
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from e2e.lab.waiting import wait_for

    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    core = client.CoreV1Api(lab.api_client())
    core.create_namespace({"metadata": {"name": name, "labels": {"finetune.dev/e2e": "true"}}})

    def default_sa() -> bool:
        try:
            return bool(core.read_namespaced_service_account("default", name))
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    # Pods are rejected until the controller-manager has made the namespace's default SA.
    wait_for(default_sa, 30, f"ServiceAccount {name}/default")
    yield name
    try:
        core.delete_namespace(name)
    except ApiException:
        pass


@pytest.fixture(scope="module", autouse=True)
def operators_stop_cleanly():
    """Fails the module when an operator it ran (e2e/operator_harness.py) did not exit 0 soon after
    SIGTERM: a hung shutdown keeps the Lease and its informers after a pod is told to stop."""
    from e2e import operator_harness as h

    seen = len(h.unclean_stops)
    yield
    unclean = h.unclean_stops[seen:]
    if unclean:
        pytest.fail("an operator did not stop cleanly on SIGTERM:\n" + "\n".join(unclean), pytrace=False)


@pytest.fixture(scope="session")
def ftj_crd(lab):
    if not CRD_FILE.exists():
        pytest.skip(f"{CRD_FILE.relative_to(REPO_ROOT)} does not exist yet (generated by `finetune-operator crd`)")
    lab.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_crd_established(lab, "finetunejobs.finetune.dev")
    return CRD_FILE
