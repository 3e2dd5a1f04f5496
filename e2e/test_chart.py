"""The Helm chart on the lab cluster: every rendered object passes the API server's validation
(server-side dry run), the operator's pod passes the `restricted` Pod Security Standard, and the chart
installs, upgrades (a policy change reloads without a restart) and uninstalls cleanly. The chart's
ServiceAccount can do exactly what the operator needs (tests/chart/operator_access.yaml), asked of
the API server as that ServiceAccount, and nothing it must not.

The lab runs no deployment controller, so the Deployment makes no pods here; the operator itself runs
as a local process with the chart's ServiceAccount in the operator scenarios (e2e/operator_harness.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.lab.versions import load_versions
from e2e.lab.waiting import wait_crd_established, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "finetune-operator"
ACCESS = yaml.safe_load((REPO / "tests" / "chart" / "operator_access.yaml").read_text())
SA_GROUPS = ("system:serviceaccounts", "system:authenticated")


# ---- helpers -------------------------------------------------------------------------------------


class Helm:
    """helm against the lab, with its own cache and config directories."""

    def __init__(self, lab, home: Path) -> None:
        self.lab = lab
        self.env = lab.env()
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            self.env[var] = str(home / var.lower())

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.lab.binary("helm"), *args], capture_output=True, text=True,
                              env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    def template(self, release: str, namespace: str, *args: str) -> list[dict[str, Any]]:
        """helm template for the lab's Kubernetes version (helm built from source defaults to v1.20)."""
        proc = self("template", release, str(CHART), "--namespace", namespace,
                    "--kube-version", load_versions().kubernetes, *args)
        return _objects(proc.stdout)

    def values_file(self, tmp: Path, values: dict[str, Any]) -> str:
        path = tmp / f"values-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(values))
        return str(path)


def _objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _kubectl_json(lab, *args: str) -> dict[str, Any]:
    return json.loads(lab.kubectl(*args, "-o", "json").stdout)


def _exists(lab, *args: str) -> bool:
    proc = lab.kubectl("get", *args, "--ignore-not-found", "-o", "name", check=False)
    assert proc.returncode == 0, proc.stderr
    return bool(proc.stdout.strip())


def _make_namespace(lab, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:5]}"
    lab.kubectl("create", "namespace", name)
    return name


def _review(lab, user: str, groups: tuple[str, ...], verb: str, resource: str, namespace: str | None,
            subresource: str | None) -> bool:
    from kubernetes import client

    kind, _, obj_name = resource.partition("/")
    plural, _, group = kind.partition(".")
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, groups=list(groups), resource_attributes=client.V1ResourceAttributes(
            verb=verb, group=group, resource=plural, subresource=subresource, name=obj_name or None,
            namespace=namespace)))
    answer = client.AuthorizationV1Api(lab.api_client()).create_subject_access_review(review)
    return bool(answer.status.allowed)


def can_i(lab, sa: str, verb: str, resource: str, namespace: str | None, subresource: str | None = None) -> bool:
    """`kubectl auth can-i` as the ServiceAccount (with the groups a ServiceAccount token carries);
    namespace None asks cluster-wide (all namespaces, or a cluster-scoped resource)."""
    ns, name = sa.split(":")
    args = ["auth", "can-i", verb, resource]
    if subresource:
        args.append(f"--subresource={subresource}")
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    groups = (*SA_GROUPS, f"system:serviceaccounts:{ns}")
    proc = lab.kubectl(*args, check=False, as_user=f"system:serviceaccount:{ns}:{name}", as_groups=groups)
    if "doesn't have a resource type" in proc.stderr:
        # A kind whose CRD this lab does not serve (TrainJob, Kueue's): kubectl cannot map it and answers
        # no whatever RBAC says; the API server's authorizer answers for it (a SubjectAccessReview).
        return _review(lab, f"system:serviceaccount:{ns}:{name}", groups, verb, resource, namespace, subresource)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"kubectl auth can-i {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return answer == "yes"


def _resource_arg(group: str, resource: str) -> tuple[str, str | None]:
    """operator_access.yaml's (group, resource[/subresource]) as kubectl's RESOURCE and --subresource."""
    base, _, sub = resource.partition("/")
    return (f"{base}.{group}" if group else base), (sub or None)


def expected_access(lease: str, *, kueue: bool = True) -> list[tuple[str, str, str | None, str]]:
    """(verb, kubectl resource[/name], subresource, scope) for every need of operator_access.yaml
    that applies to a release with trainingBackend auto and `kueue` as its kueue.enabled (whichever
    namespaces it watches); scopes "lease", "state" and "profile" are asked in the release namespace."""
    out = []
    for need in ACCESS["needs"]:
        when = need.get("when") or {}
        if "auto" not in when.get("backends", ["auto"]):
            continue  # the `installed` release runs trainingBackend auto (both backends) with kueue.enabled
        if when.get("kueue") and not kueue:
            continue
        arg, sub = _resource_arg(need["group"], need["resource"])
        if need.get("resourceName") == "LEASE":
            arg = f"{arg}/{lease}"
        elif need.get("resourceName"):
            arg = f"{arg}/{need['resourceName']}"
        for verb in need["verbs"]:
            out.append((verb, arg, sub, need["scope"]))
    return out


def forbidden_access(lease: str) -> list[tuple[str, str, str | None, str]]:
    """(verb, kubectl resource[/name], subresource, where) for every forbidden line; where is
    "watched" (a watched namespace) or "release" (the release namespace)."""
    out = []
    for item in ACCESS["forbidden"]:
        base, _, sub = item["resource"].partition("/")
        name = {"LEASE": lease, "OTHER": "kube-scheduler", None: None}[item.get("name")]
        out.append((item["verb"], f"{base}/{name}" if name else base, sub or None, item.get("where", "watched")))
    return out


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def helm(lab, tmp_path_factory) -> Helm:
    return Helm(lab, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="module")
def chart_crds(lab):
    """The chart's CRDs, applied the way helm would leave them (create if missing)."""
    for path in sorted((CHART / "crds").glob("*.yaml")):
        lab.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=chart-e2e", "-f", str(path))
    wait_crd_established(lab, "finetunejobs.finetune.dev")


@pytest.fixture(scope="module")
def installed(lab, helm, tmp_path_factory):
    """The chart installed watching all namespaces, in its own namespace with its own lease name
    (the operator scenarios install another release)."""
    tmp = tmp_path_factory.mktemp("chart-install")
    ns = _make_namespace(lab, "chart-e2e")
    release = f"fto-{uuid.uuid4().hex[:5]}"
    lease = f"chart-e2e-{uuid.uuid4().hex[:5]}"
    proc = helm("install", release, str(CHART), "--namespace", ns, "--set", f"leaderElection.leaseName={lease}",
                "--set", "trainingOperator.requireCRD=true", "--set", "kueue.enabled=true")
    info = {"namespace": ns, "release": release, "lease": lease, "notes": proc.stdout, "tmp": tmp,
            "fullname": f"{release}-finetune-operator", "sa": f"{ns}:{release}-finetune-operator"}
    yield info
    helm("uninstall", release, "--namespace", ns, "--wait", check=False)
    lab.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# ---- server-side validation ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["all-namespaces", "namespaced"])
def test_every_rendered_object_passes_server_side_dry_run(lab, helm, chart_crds, namespace, tmp_path, mode):
    args = ["--set", "leaderElection.leaseName=chart-dry-run"]
    if mode == "namespaced":
        team_a, team_b = _make_namespace(lab, "chart-team-a"), _make_namespace(lab, "chart-team-b")
        args += ["--set", "watch.allNamespaces=false", "--set", f"watch.namespaces={{{team_a},{team_b}}}"]
    try:
        objects = helm.template("dry", namespace, *args)
        assert len(objects) >= 8
        manifest = yaml.safe_dump_all(objects)
        proc = lab.kubectl("apply", "--dry-run=server", "--server-side", "--field-manager=chart-e2e", "-f", "-",
                           input=manifest, check=False)
        assert proc.returncode == 0, proc.stderr
        applied = [line for line in proc.stdout.splitlines() if "(server dry run)" in line]
        assert len(applied) == len(objects), proc.stdout
    finally:
        if mode == "namespaced":
            lab.kubectl("delete", "namespace", team_a, team_b, "--wait=false", check=False)


def test_operator_pod_passes_the_restricted_pod_security_standard(lab, helm, namespace):
    """The Deployment's pod, created (dry run) in a namespace that enforces `restricted`: PodSecurity
    admission rejects any pod that could escalate, run as root, keep capabilities or skip seccomp."""
    lab.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
                "pod-security.kubernetes.io/enforce-version=latest", "--overwrite")
    objects = helm.template("psa", namespace)
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "operator-psa", "namespace": namespace, **deploy["spec"]["template"]["metadata"]},
           "spec": deploy["spec"]["template"]["spec"]}
    pod["spec"]["serviceAccountName"] = "default"  # the chart's SA is not installed in this namespace
    proc = lab.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert proc.returncode == 0, proc.stderr
    # The check bites: the same pod with privilege escalation allowed is refused.
    pod["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    proc = lab.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert proc.returncode != 0 and "allowPrivilegeEscalation" in proc.stderr, proc.stderr


# ---- install, access, upgrade --------------------------------------------------------------------


def test_install_creates_the_objects_and_notes(lab, installed):
    ns, full = installed["namespace"], installed["fullname"]
    for kind, name in (("deployment", full), ("serviceaccount", full), ("configmap", f"{full}-policy"),
                       ("service", f"{full}-metrics"), ("poddisruptionbudget", full)):
        assert _exists(lab, kind, name, "-n", ns), f"{kind}/{name} missing"
    assert _exists(lab, "clusterrole", f"{ns}-{full}") and _exists(lab, "clusterrolebinding", f"{ns}-{full}")
    assert _exists(lab, "role", f"{full}-leader-election", "-n", ns)
    assert _exists(lab, "rolebinding", f"{full}-leader-election", "-n", ns)
    wait_crd_established(lab, "finetunejobs.finetune.dev")
    assert not _exists(lab, "crd", "clusterkopfpeerings.kopf.dev"), "kopf peering CRDs are no longer the chart's"
    notes = installed["notes"]
    assert "NOTES:" in notes and "kubectl get finetunejobs -w" in notes
    # NOTES say how to see the leader.
    assert f"kubectl -n {ns} get lease {installed['lease']} -o jsonpath='{{.spec.holderIdentity}}'" in notes, notes
    # The lab has the training operator: the lookup finds its CRD, so no warning (and requireCRD passed).
    assert "pytorchjobs.kubeflow.org is missing" not in notes and "Could not check" not in notes, notes


def test_the_first_job_in_notes_is_accepted_by_the_api_server(lab, installed, ftj_crd, namespace):
    """The FineTuneJob NOTES tell the user to apply is valid against the installed CRD."""
    notes = installed["notes"]
    body = notes.split("<<'YAML'\n", 1)[1].split("\nYAML\n", 1)[0]
    job = yaml.safe_load(body)
    assert job["kind"] == "FineTuneJob"
    assert job["spec"]["placement"]["regions"] == ["eu-de-berlin"]
    proc = lab.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=body, check=False)
    assert proc.returncode == 0, proc.stderr


def test_service_account_can_do_what_the_operator_needs(lab, installed, namespace):
    """Every rule the operator needs, asked of the API server as the chart's ServiceAccount:
    cluster-wide, and in a namespace the release knows nothing about (all namespaces are watched);
    the Lease in the release namespace."""
    sa = installed["sa"]
    missing = []
    for verb, resource, sub, scope in expected_access(installed["lease"]):
        wheres = {"namespaced": (namespace, None), "cluster": (None,), "lease": (installed["namespace"],),
                  "state": (installed["namespace"],), "profile": (installed["namespace"],)}[scope]
        for where in wheres:
            if not can_i(lab, sa, verb, resource, where, sub):
                missing.append(f"{verb} {resource}{'/' + sub if sub else ''} in {where or 'cluster'}")
    assert not missing, f"the chart's RBAC does not allow: {missing}"


def test_service_account_cannot_do_what_it_must_not(lab, installed, namespace):
    sa = installed["sa"]
    allowed = []
    for verb, resource, sub, scope in forbidden_access(installed["lease"]):
        for where in ((installed["namespace"] if scope == "release" else namespace), None):
            if can_i(lab, sa, verb, resource, where, sub):
                allowed.append(f"{verb} {resource}{'/' + sub if sub else ''} in {where or 'cluster'}")
    # The release's Lease name is not writable anywhere else: not another controller's in kube-system.
    for name in (installed["lease"], "kube-scheduler", "kube-controller-manager"):
        if can_i(lab, sa, "update", f"leases.coordination.k8s.io/{name}", "kube-system"):
            allowed.append(f"update lease {name} in kube-system")
    assert not allowed, f"the chart's RBAC allows too much: {allowed}"


def test_service_account_token_does_the_work(lab, installed, namespace, tmp_path):
    """Real requests with a bound token of the ServiceAccount (not impersonation): what the operator
    does first, and what it must be refused."""
    ns, full = installed["namespace"], installed["fullname"]
    kubeconfig = lab.service_account_kubeconfig(ns, full, path=tmp_path / "sa.kubeconfig")

    def as_sa(*args: str, input: str | None = None, check: bool = True):
        return lab.kubectl(*args, input=input, check=check, kubeconfig=kubeconfig)

    as_sa("get", "finetunejobs.finetune.dev", "--all-namespaces")
    as_sa("get", "nodes", "-l", "nvidia.com/gpu.present=true")
    # A training-job CRD is listed by name (its informer's field selector), no other CRD and not all of them.
    as_sa("get", "customresourcedefinitions", "--field-selector", "metadata.name=pytorchjobs.kubeflow.org")
    for attempt in (("get", "customresourcedefinitions"),
                    ("get", "customresourcedefinitions", "--field-selector", "metadata.name=finetunejobs.finetune.dev")):
        refused = as_sa(*attempt, check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), (attempt, refused.stderr)
    as_sa("get", "pytorchjobs.kubeflow.org", "-n", namespace)
    as_sa("get", "configmap", f"{full}-policy", "-n", ns)
    as_sa("create", "configmap", "attempt-1-trainer", "-n", namespace, "--from-literal=trainer.json={}")
    as_sa("delete", "configmap", "attempt-1-trainer", "-n", namespace)
    # The leader election: create the release's Lease, read it, take it over (an update, as the client
    # library's LeaseLock does); another Lease may be created (RBAC cannot restrict create) but not updated.
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": installed["lease"], "namespace": ns},
             "spec": {"holderIdentity": "chart-e2e-a", "leaseDurationSeconds": 3}}
    as_sa("create", "-f", "-", input=json.dumps(lease))
    current = json.loads(as_sa("get", "lease", installed["lease"], "-n", ns, "-o", "json").stdout)
    current["spec"]["holderIdentity"] = "chart-e2e-b"
    as_sa("replace", "-f", "-", input=json.dumps(current))
    assert as_sa("get", "lease", installed["lease"], "-n", ns, "-o", "jsonpath={.spec.holderIdentity}").stdout == "chart-e2e-b"
    other = {**lease, "metadata": {"name": f"{installed['lease']}-other", "namespace": ns}}
    as_sa("create", "-f", "-", input=json.dumps(other))
    refused = as_sa("get", "lease", other["metadata"]["name"], "-n", ns, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    refused = as_sa("replace", "-f", "-", input=json.dumps(other), check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    refused = as_sa("create", "-f", "-", input=json.dumps({**lease, "metadata": {"name": "x", "namespace": namespace}}),
                    check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr
    lab.kubectl("delete", "lease", installed["lease"], other["metadata"]["name"], "-n", ns)
    # The escalation paths, tried for real with the token: a pod in a tenant's namespace (it could mount
    # any Secret there), a Secret, a ServiceAccount token, a RoleBinding to admin.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "escalate", "namespace": namespace},
           "spec": {"containers": [{"name": "c", "image": "registry.eu.example/anything:1"}]}}
    lab.kubectl("create", "secret", "generic", "tenant-secret", "-n", namespace, "--from-literal=k=v")
    for attempt in (("create", "-f", "-"), ("get", "secret", "tenant-secret", "-n", namespace),
                    ("create", "token", "default", "-n", namespace),
                    ("create", "rolebinding", "escalate", "--clusterrole=admin",
                     f"--serviceaccount={ns}:{full}", "-n", namespace)):
        refused = as_sa(*attempt, input=json.dumps(pod) if attempt[0] == "create" and "-f" in attempt else None,
                        check=False)
        assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), (attempt, refused.stderr)
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "chart-e2e-", "namespace": namespace},
             "involvedObject": {"kind": "FineTuneJob", "apiVersion": "finetune.dev/v1alpha1", "name": "x",
                                "namespace": namespace},
             "reason": "Planned", "message": "from the chart e2e test", "type": "Normal"}
    as_sa("create", "-f", "-", input=json.dumps(event))
    refused = as_sa("get", "secrets", "-n", namespace, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr


def test_upgrade_with_a_new_policy_does_not_restart_the_operator(lab, helm, installed):
    ns, release, full = installed["namespace"], installed["release"], installed["fullname"]
    before = _kubectl_json(lab, "get", "deployment", full, "-n", ns)
    helm("upgrade", release, str(CHART), "--namespace", ns, "--reuse-values",
         "--set", "policy.allowedRegions={eu-de-berlin}", "--set", "policy.defaultMaxAttempts=2")
    cm = _kubectl_json(lab, "get", "configmap", f"{full}-policy", "-n", ns)
    policy = yaml.safe_load(cm["data"]["policy.yaml"])
    assert policy["allowedRegions"] == ["eu-de-berlin"] and policy["defaultMaxAttempts"] == 2
    after = _kubectl_json(lab, "get", "deployment", full, "-n", ns)
    assert after["metadata"]["generation"] == before["metadata"]["generation"], "a policy change rolled the pods"
    assert after["spec"]["template"] == before["spec"]["template"]
    # A change to the operator's command line does roll it.
    helm("upgrade", release, str(CHART), "--namespace", ns, "--reuse-values", "--set", "logLevel=debug")
    rolled = _kubectl_json(lab, "get", "deployment", full, "-n", ns)
    assert rolled["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert "debug" in rolled["spec"]["template"]["spec"]["containers"][0]["args"]


def test_upgrade_with_bad_values_is_rejected_and_changes_nothing(lab, helm, installed):
    ns, release = installed["namespace"], installed["release"]
    history = json.loads(helm("history", release, "--namespace", ns, "-o", "json").stdout)
    proc = helm("upgrade", release, str(CHART), "--namespace", ns, "--reuse-values",
                "--set", "policy.defaultMemoryHeadroom=0.9", check=False)
    assert proc.returncode != 0 and "/policy/defaultMemoryHeadroom" in proc.stderr, proc.stderr
    assert json.loads(helm("history", release, "--namespace", ns, "-o", "json").stdout) == history


# ---- the operator, run the way the chart's Deployment runs it ---------------------------------------


def _flag_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthz(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


class Replica:
    """One replica of the Deployment as a local process: the container's args (ports made free),
    authenticated with a bound token of the chart's ServiceAccount."""

    def __init__(self, args: list[str], kubeconfig: Path, namespace: str, log: Path, pod_name: str) -> None:
        args = list(args)
        self.health_port = _free_port()
        args[args.index("--health-port") + 1] = str(self.health_port)
        args[args.index("--metrics-port") + 1] = str(_free_port())
        # The Deployment gives each pod its name as POD_NAME: the replica's identity in the election.
        self.pod_name = pod_name
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), POD_NAMESPACE=namespace, POD_NAME=pod_name,
                   PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "finetune_operator.cli", *args, "--kubeconfig", str(kubeconfig)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text()

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"the operator exited with {self.proc.returncode}:\n{self.text()[-3000:]}"
        return _healthz(self.health_port)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> str | None:
        """After terminate(): wait until `deadline` (time.monotonic()) for its exit, then SIGKILL.
        Returns what was wrong (still running at the deadline, or an exit code other than 0), or None."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            return f"{self.pod_name} still ran at the deadline after SIGTERM:\n{self.text()[-2000:]}"
        if self.proc.returncode != 0:
            return f"{self.pod_name} exited {self.proc.returncode} after SIGTERM:\n{self.text()[-2000:]}"
        return None


def stop_replicas(replicas: list[Replica], grace: float = 30) -> list[str]:
    """SIGTERM every replica at once, as a Deployment's pods are stopped, then give them `grace`
    together; returns what went wrong (see Replica.wait_stopped). Replicas already stopped are skipped."""
    running = [r for r in replicas if r.proc.poll() is None]
    for replica in running:
        replica.terminate()
    deadline = time.monotonic() + grace
    return [problem for replica in running if (problem := replica.wait_stopped(deadline))]


@pytest.mark.parametrize("mode", ["all-namespaces", "namespaced"])
def test_two_replicas_elect_one_and_reload_the_policy_as_the_chart_service_account(
        lab, helm, chart_crds, tmp_path, mode):
    """The Deployment's command line, twice, as the chart's ServiceAccount: both serve /healthz, one
    holds the chart's Lease (in the release namespace) and says it leads, the other does not, no request
    is forbidden, and a policy-only `helm upgrade` reaches the running operator without a restart."""
    ns = _make_namespace(lab, "chart-run")
    watched = [_make_namespace(lab, p) for p in ("chart-run-a", "chart-run-b")] if mode == "namespaced" else []
    release = f"ftr-{uuid.uuid4().hex[:5]}"
    full = f"{release}-finetune-operator"
    lease = f"chart-e2e-{uuid.uuid4().hex[:5]}"
    values = {"leaderElection": {"enabled": True, "leaseName": lease}, "logFormat": "plain"}
    if watched:
        values["watch"] = {"allNamespaces": False, "namespaces": watched}
    replicas: list[Replica] = []
    try:
        helm("install", release, str(CHART), "--namespace", ns, "--values", helm.values_file(tmp_path, values))
        deploy = _kubectl_json(lab, "get", "deployment", full, "-n", ns)
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        kubeconfig = lab.service_account_kubeconfig(ns, full, path=tmp_path / "sa.kubeconfig")
        assert _flag_value(args, "--lease") == lease
        for i in range(deploy["spec"]["replicas"]):
            replicas.append(Replica(args, kubeconfig, ns, tmp_path / f"replica-{i}.log", f"{full}-pod{i}"))
            wait_for(replicas[-1].healthy, 90, f"replica {i}'s /healthz")

        def holder() -> str:
            return lab.kubectl("get", "lease", lease, "-n", ns, "--ignore-not-found",
                               "-o", "jsonpath={.spec.holderIdentity}").stdout

        names = {r.pod_name for r in replicas}
        wait_for(lambda: holder() in names, 30, f"one replica to hold the Lease {ns}/{lease}")
        wait_for(lambda: sum(f"{r.pod_name} leads (lease {ns}/{lease})" in r.text() for r in replicas) == 1, 30,
                 "the holder to say it leads")
        (leader,) = [r for r in replicas if f"{r.pod_name} leads" in r.text()]
        assert holder() == leader.pod_name

        helm("upgrade", release, str(CHART), "--namespace", ns, "--reuse-values",
             "--set", "policy.allowedRegions={eu-fr-paris}")
        after = _kubectl_json(lab, "get", "deployment", full, "-n", ns)
        assert after["metadata"]["generation"] == deploy["metadata"]["generation"]
        for replica in replicas:
            assert replica.proc.poll() is None, replica.text()[-3000:]
            text = replica.text()
            assert "forbidden" not in text.lower() and " 403" not in text, text[-3000:]

        def reloaded() -> bool:
            return any("policy reloaded" in r.text() and "eu-fr-paris" in r.text() for r in replicas)

        # Still one leader, the same one: the standby never took the Lease.
        assert holder() == leader.pod_name
        assert all(" leads (lease" not in r.text() for r in replicas if r is not leader)

        # Whatever namespaces are watched, the operator polls the policy ConfigMap itself.
        wait_for(reloaded, 60, "the active replica to reload the policy")
        # Stopped as a Deployment's pods are: each exits 0 within the grace (its cleanup hands the
        # leader's Lease back; a hung shutdown held it and its watches for the whole grace).
        unclean = stop_replicas(replicas, grace=20)
        assert not unclean, "\n".join(unclean)
    finally:
        stop_replicas(replicas)
        helm("uninstall", release, "--namespace", ns, check=False)
        lab.kubectl("delete", "namespace", ns, *watched, "--wait=false", check=False)


# ---- a namespaced install, and uninstall ---------------------------------------------------------


def test_namespaced_install_is_scoped_and_uninstalls_cleanly(lab, helm, chart_crds, tmp_path):
    release_ns = _make_namespace(lab, "chart-ops")
    team_a, team_b, other = (_make_namespace(lab, p) for p in ("chart-team-a", "chart-team-b", "chart-other"))
    release = f"ftn-{uuid.uuid4().hex[:5]}"
    full = f"{release}-finetune-operator"
    lease = f"chart-e2e-{uuid.uuid4().hex[:5]}"
    sa = f"{release_ns}:{full}"
    values = {"watch": {"allNamespaces": False, "namespaces": [team_a, team_b]},
              "leaderElection": {"enabled": True, "leaseName": lease}}
    try:
        helm("install", release, str(CHART), "--namespace", release_ns, "--values", helm.values_file(tmp_path, values))
        for ns in (team_a, team_b):
            assert _exists(lab, "role", full, "-n", ns) and _exists(lab, "rolebinding", full, "-n", ns)

        where = {"namespaced": lambda ns: ns, "cluster": lambda ns: None, "lease": lambda ns: release_ns,
                 "state": lambda ns: release_ns, "profile": lambda ns: release_ns}
        missing = [
            f"{verb} {resource} in {where[scope](ns) or 'cluster'}"
            for verb, resource, sub, scope in expected_access(lease, kueue=False)  # no kueue here
            for ns in (team_a, team_b)
            if not can_i(lab, sa, verb, resource, where[scope](ns), sub)
        ]
        assert not missing, f"the chart's RBAC does not allow: {missing}"
        # The Lease only in the release namespace.
        for ns in (team_a, other, None):
            for verb in ("get", "update", "create"):
                assert not can_i(lab, sa, verb, f"leases.coordination.k8s.io/{lease}", ns), f"{verb} lease in {ns}"
        # Nothing namespaced outside the watched namespaces, except reading the policy at home.
        for verb, resource in (("list", "finetunejobs.finetune.dev"), ("create", "pytorchjobs.kubeflow.org"),
                               ("create", "configmaps"), ("list", "pods")):
            assert not can_i(lab, sa, verb, resource, other), f"{verb} {resource} in an unwatched namespace"
            assert not can_i(lab, sa, verb, resource, None), f"{verb} {resource} cluster-wide"
        # At home it reads its policy by name (a poll: no list, no watch), creates only its own state
        # ConfigMaps (the profile cache and the learned calibration, Role <fullname>-state), and runs
        # the profile pods (Role <fullname>-profile), the only pods it may create anywhere.
        assert can_i(lab, sa, "get", f"configmaps/{full}-policy", release_ns)
        assert not can_i(lab, sa, "watch", "configmaps", release_ns)
        assert not can_i(lab, sa, "list", "configmaps", release_ns)
        assert can_i(lab, sa, "create", "configmaps", release_ns)
        assert can_i(lab, sa, "create", "pods", release_ns)
        for ns in (team_a, other, None):
            assert not can_i(lab, sa, "create", "pods", ns), f"create pods in {ns or 'all namespaces'}"
        assert can_i(lab, sa, "list", "nodes", None)

        helm("uninstall", release, "--namespace", release_ns, "--wait")
        leftovers = []
        for ns in (team_a, team_b):
            for kind, name in (("role", full), ("rolebinding", full)):
                if _exists(lab, kind, name, "-n", ns):
                    leftovers.append(f"{ns}/{kind}/{name}")
        for kind, name in (("deployment", full), ("serviceaccount", full), ("configmap", f"{full}-policy"),
                           ("service", f"{full}-metrics"), ("role", f"{full}-policy-reader"),
                           ("role", f"{full}-leader-election"), ("rolebinding", f"{full}-leader-election"),
                           ("role", f"{full}-state"), ("rolebinding", f"{full}-state"),
                           ("role", f"{full}-profile"), ("rolebinding", f"{full}-profile")):
            if _exists(lab, kind, name, "-n", release_ns):
                leftovers.append(f"{release_ns}/{kind}/{name}")
        for kind in ("clusterrole", "clusterrolebinding"):
            if _exists(lab, kind, f"{release_ns}-{full}"):
                leftovers.append(f"{kind}/{release_ns}-{full}")
        assert not leftovers, f"helm uninstall left: {leftovers}"
        # CRDs stay (helm never deletes crds/): FineTuneJobs of other releases survive an uninstall.
        assert _exists(lab, "crd", "finetunejobs.finetune.dev")
        wait_for(lambda: not can_i(lab, sa, "list", "nodes", None), 10, "the ClusterRoleBinding to be gone")
    finally:
        helm("uninstall", release, "--namespace", release_ns, check=False)
        lab.kubectl("delete", "namespace", release_ns, team_a, team_b, other, "--wait=false", check=False)
