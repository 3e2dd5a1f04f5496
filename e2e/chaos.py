"""Fault injection and invariant checks on the lab cluster, for the chaos benchmark
(`bench/chaos.py`) and its CI-sized run (`e2e/test_chaos.py`).

Everything here talks to the lab's real kube-apiserver with the admin credentials and checks
the operator from the outside, by what the API shows:

- `ResourceWatch`: list + watch of one resource in every namespace, resuming a watch the server
  ends and relisting after errors (the kube-apiserver is restarted under it), calling back with
  plain dicts.
- `ChildTracker`: every PyTorchJob of a FineTuneJob, at every event: more than one live
  (not finished, not deleting) training job for one FineTuneJob is a duplicate; a new
  `<job>-aN` after `<job>-aM` with M > N is an attempt number that went backwards.
- `QueueSim`: a queueing system the way Kueue treats a PyTorchJob that carries the
  `kueue.x-k8s.io/queue-name` label: a mutating admission webhook creates it suspended
  (Kueue's job webhook defaults `runPolicy.suspend` to true), the "admission" sets suspend to
  false after a hold, and a child whose suspend flips to false before admission was
  un-suspended by someone else (recorded with the field managers that wrote it, then
  suspended again, as Kueue's reconciler would).
- `ForeignObjects`: ConfigMaps and PyTorchJobs with names that clash with a FineTuneJob's
  attempts (`<job>-a1`, `<job>-a2`), not owned by it, created before the job; any change to
  their spec/data/metadata, a delete, or a replacement is recorded.
- `JobTracker`: every FineTuneJob's phase, attempt and conditions over time.
- status faults (`patch_status_*`), evictions and pod deletes.
- `FreezingProxy`: a TCP proxy between a client and the API server that can stop forwarding
  without closing anything (a half-open connection: a stuck load balancer, a lost route), and
  forward again.
"""

from __future__ import annotations

import base64
import json
import logging
import select
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

log = logging.getLogger("chaos")

JOB_LABEL = "finetune.dev/job"
JOB_NAME_ANNOTATION = "finetune.dev/job-name"
ATTEMPT_LABEL = "finetune.dev/attempt"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
FOREIGN_LABEL = "chaos.finetune.dev/foreign"
FTJ = ("finetune.dev", "v1alpha1", "finetunejobs")
PJ = ("kubeflow.org", "v1", "pytorchjobs")
QUEUE_MANAGER = "chaos-queue-sim"
TERMINAL = ("Succeeded", "Failed")


def now() -> float:
    return time.monotonic()


# ---------------------------------------------------------------------------
# list + watch
# ---------------------------------------------------------------------------


class ResourceWatch(threading.Thread):
    """List, then watch, one resource in all namespaces; a watch the server ends resumes where it
    stopped, any error lists again.

    `on_sync(items)` gets the full list after every (re)list; `on_event(type, obj)` every
    ADDED/MODIFIED/DELETED. Objects are the API's JSON as dicts."""

    def __init__(self, name: str, api_client: client.ApiClient, resource: str, *,
                 on_event: Callable[[str, dict], None], on_sync: Callable[[list[dict]], None] | None = None,
                 label_selector: str | None = None, stop: threading.Event) -> None:
        super().__init__(name=f"watch-{name}", daemon=True)
        self.api_client = api_client
        self.resource = resource
        self.on_event = on_event
        self.on_sync = on_sync
        self.label_selector = label_selector
        self.stop_event = stop
        self.relists = 0
        self.errors = 0
        self.synced = threading.Event()

    def _list_fn(self) -> Callable[..., Any]:
        if self.resource == "pods":
            return client.CoreV1Api(self.api_client).list_pod_for_all_namespaces
        if self.resource == "configmaps":
            return client.CoreV1Api(self.api_client).list_config_map_for_all_namespaces
        group, version, plural = {"pytorchjobs": PJ, "finetunejobs": FTJ}[self.resource]
        custom = client.CustomObjectsApi(self.api_client)

        def list_custom(**kwargs: Any) -> Any:
            return custom.list_cluster_custom_object(group, version, plural, **kwargs)

        return list_custom

    def run(self) -> None:
        fn = self._list_fn()
        selector = {"label_selector": self.label_selector} if self.label_selector else {}
        rv: str | None = None  # None: list first
        while not self.stop_event.is_set():
            try:
                if rv is None:
                    resp = fn(_preload_content=False, _request_timeout=20, **selector)
                    data = json.loads(resp.data)
                    self.relists += 1
                    if self.on_sync is not None:
                        self.on_sync(data.get("items") or [])
                    self.synced.set()
                    rv = data["metadata"]["resourceVersion"]
                # A watch the server ends (timeout_seconds) resumes from the last resourceVersion seen,
                # as client-go's reflector does; only an error lists again. A list of a thousand
                # objects every 30 s stalled this process for seconds, and what it saw meanwhile was
                # timed late.
                w = watch.Watch()
                for event in w.stream(fn, resource_version=rv, timeout_seconds=30, _request_timeout=45,
                                      deserialize=False, **selector):
                    if self.stop_event.is_set():
                        w.stop()
                        break
                    # An ERROR event (410 Gone: rv too old) raises out of the client's stream: relisted below.
                    raw = event["object"]
                    rv = raw["metadata"].get("resourceVersion") or rv
                    if event["type"] != "BOOKMARK":
                        self.on_event(event["type"], raw)
            except Exception as exc:  # the apiserver restarts under us (or 410 Gone): relist
                rv = None
                self.errors += 1
                log.debug("watch %s: %r; relisting", self.resource, exc)
                self.stop_event.wait(0.5)


# ---------------------------------------------------------------------------
# helpers on plain objects
# ---------------------------------------------------------------------------


def meta(obj: dict) -> dict:
    return obj.get("metadata") or {}


def key_of(obj: dict) -> tuple[str, str]:
    return meta(obj).get("namespace", ""), meta(obj).get("name", "")


def ftj_name_of(obj: dict) -> str | None:
    m = meta(obj)
    return (m.get("annotations") or {}).get(JOB_NAME_ANNOTATION) or (m.get("labels") or {}).get(JOB_LABEL)


def attempt_number(name: str) -> int | None:
    head, sep, tail = name.rpartition("-a")
    return int(tail) if sep and tail.isdigit() else None


def pj_finished(pj: dict) -> bool:
    conditions = ((pj.get("status") or {}).get("conditions")) or []
    return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True" for c in conditions)


def pj_suspended(pj: dict) -> bool:
    return bool((((pj.get("spec") or {}).get("runPolicy")) or {}).get("suspend"))


def managers_of(obj: dict, *path: str) -> list[dict]:
    """The managedFields entries that own `path` (e.g. "spec", "runPolicy", "suspend")."""
    out = []
    for entry in meta(obj).get("managedFields") or []:
        node = entry.get("fieldsV1") or {}
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            out.append({k: entry.get(k) for k in ("manager", "operation", "time", "subresource") if entry.get(k)})
    return out


# ---------------------------------------------------------------------------
# training jobs: duplicates and attempt order
# ---------------------------------------------------------------------------


@dataclass
class Incident:
    kind: str
    namespace: str
    job: str
    at: float
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self, t0: float) -> dict[str, Any]:
        return {"kind": self.kind, "namespace": self.namespace, "job": self.job, "at_s": round(self.at - t0, 2),
                **self.detail}


class ChildTracker:
    """The PyTorchJobs of every FineTuneJob, checked at every event."""

    def __init__(self, foreign_uids: Callable[[], set[str]]) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, dict] = {}  # uid -> last seen object
        self.seen: dict[tuple[str, str], list[tuple[float, str, str]]] = {}  # job -> [(t, name, uid)] creations
        self.max_attempt: dict[tuple[str, str], int] = {}
        self.incidents: list[Incident] = []
        self._dup_open: dict[tuple[str, str], frozenset[str]] = {}
        self.foreign_uids = foreign_uids
        self.listeners: list[Callable[[str, dict], None]] = []

    def _job_key(self, pj: dict) -> tuple[str, str] | None:
        name = ftj_name_of(pj)
        return (meta(pj).get("namespace", ""), name) if name else None

    def on_sync(self, items: list[dict]) -> None:
        """A (re)list: what vanished while the watch was down was deleted."""
        gone = []
        with self.lock:
            present = {meta(i).get("uid") for i in items}
            for uid in [u for u in self.objects if u not in present]:
                gone.append(self.objects.pop(uid))
                self._check(self._job_key(gone[-1]))
        for obj in gone:
            for listener in self.listeners:
                listener("DELETED", obj)
        for item in items:
            self.on_event("ADDED", item)

    def on_event(self, kind: str, pj: dict) -> None:
        uid = meta(pj).get("uid")
        if not uid or uid in self.foreign_uids():
            return
        job = self._job_key(pj)
        with self.lock:
            if kind == "DELETED":
                self.objects.pop(uid, None)
            else:
                if uid not in self.objects and job is not None:
                    self._created(job, pj, uid)
                self.objects[uid] = pj
            self._check(job)
        for listener in self.listeners:
            listener(kind, pj)

    def _created(self, job: tuple[str, str], pj: dict, uid: str) -> None:
        name = meta(pj).get("name", "")
        number = attempt_number(name)
        history = self.seen.setdefault(job, [])
        if any(u == uid for _, _, u in history):
            return
        history.append((now(), name, uid))
        highest = self.max_attempt.get(job, 0)
        if number is not None and number < highest:
            self.incidents.append(Incident("attempt-went-backwards", job[0], job[1], now(), {
                "created": name, "after_attempt": highest, "history": [n for _, n, _ in history]}))
        if number is not None:
            self.max_attempt[job] = max(highest, number)

    def live(self, job: tuple[str, str]) -> list[dict]:
        return [o for o in self.objects.values()
                if self._job_key(o) == job and not meta(o).get("deletionTimestamp") and not pj_finished(o)]

    def _check(self, job: tuple[str, str] | None) -> None:
        if job is None:
            return
        live = self.live(job)
        names = frozenset(meta(o).get("name", "") for o in live)
        if len(live) > 1:
            if self._dup_open.get(job) != names:
                self._dup_open[job] = names
                self.incidents.append(Incident("duplicate-training-jobs", job[0], job[1], now(), {
                    "live": sorted(names),
                    "suspended": sorted(meta(o).get("name", "") for o in live if pj_suspended(o))}))
        else:
            self._dup_open.pop(job, None)

    def names_created(self, job: tuple[str, str]) -> list[str]:
        with self.lock:
            return [n for _, n, _ in self.seen.get(job, [])]

    def live_attempts(self, job: tuple[str, str]) -> list[int]:
        with self.lock:
            return [n for n in (attempt_number(meta(o).get("name", "")) for o in self.live(job)) if n is not None]

    def live_count(self, job: tuple[str, str]) -> int:
        with self.lock:
            return len(self.live(job))

    def duplicates(self) -> list[Incident]:
        return [i for i in self.incidents if i.kind == "duplicate-training-jobs"]

    def regressions(self) -> list[Incident]:
        return [i for i in self.incidents if i.kind == "attempt-went-backwards"]


# ---------------------------------------------------------------------------
# a queueing system, the way Kueue treats a labelled PyTorchJob
# ---------------------------------------------------------------------------


class _Hook(BaseHTTPRequestHandler):
    sim: "QueueSim"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        review = json.loads(self.rfile.read(length) or b"{}")
        request = review.get("request") or {}
        response: dict[str, Any] = {"uid": request.get("uid"), "allowed": True}
        obj = request.get("object") or {}
        if request.get("operation") == "CREATE" and (meta(obj).get("labels") or {}).get(QUEUE_LABEL):
            spec = obj.get("spec") or {}
            if not (spec.get("runPolicy") or {}).get("suspend"):
                if "runPolicy" in spec:
                    patch = [{"op": "add", "path": "/spec/runPolicy/suspend", "value": True}]
                else:
                    patch = [{"op": "add", "path": "/spec/runPolicy", "value": {"suspend": True}}]
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
                self.sim.mutated += 1
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class QueueSim:
    """Kueue's part, played by the benchmark: suspend on create (webhook), admit after a hold."""

    WEBHOOK_NAME = "chaos-queue-sim.finetune.dev"

    def __init__(self, api_client: client.ApiClient, hold: Callable[[str, str], float], stop: threading.Event) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)
        self.hold = hold  # (namespace, name) -> seconds to keep the child suspended
        self.stop_event = stop
        self.lock = threading.Lock()
        self.first_seen: dict[str, float] = {}
        self.due: dict[str, tuple[float, str, str]] = {}  # uid -> (when, ns, name)
        self.admitted: set[str] = set()
        self.last_suspend: dict[str, bool] = {}
        self.queued: set[str] = set()
        self.incidents: list[Incident] = []
        self.created_unsuspended: list[Incident] = []
        self.admissions = 0
        self.resuspends = 0
        self.mutated = 0
        self.server: ThreadingHTTPServer | None = None
        self._workdir = Path(tempfile.mkdtemp(prefix="chaos-queue-sim-"))

    # -- the webhook ----------------------------------------------------------
    def start_webhook(self) -> None:
        from e2e.lab import pki

        ca = pki.make_ca(self._workdir, "ca", "chaos-queue-sim-ca")
        leaf = pki.make_leaf(self._workdir, ca, "server", "chaos-queue-sim", ip_addresses=("127.0.0.1",), server=True)
        handler = type("Hook", (_Hook,), {"sim": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(leaf.cert), str(leaf.key))
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="queue-sim-webhook", daemon=True).start()
        body = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": self.WEBHOOK_NAME},
            "webhooks": [{
                "name": self.WEBHOOK_NAME,
                "clientConfig": {"url": f"https://127.0.0.1:{port}/mutate-pytorchjob",
                                 "caBundle": base64.b64encode(ca.cert_pem()).decode()},
                "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"], "operations": ["CREATE"],
                           "resources": ["pytorchjobs"], "scope": "Namespaced"}],
                "objectSelector": {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]},
                "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            }],
        }
        try:
            self.admission.delete_mutating_webhook_configuration(self.WEBHOOK_NAME)
        except ApiException:
            pass
        self.admission.create_mutating_webhook_configuration(body)
        threading.Thread(target=self._admit_loop, name="queue-sim-admit", daemon=True).start()

    def stop_webhook(self) -> None:
        try:
            self.admission.delete_mutating_webhook_configuration(self.WEBHOOK_NAME)
        except Exception:
            pass
        if self.server is not None:
            self.server.shutdown()

    # -- watching the children ---------------------------------------------------
    def on_event(self, kind: str, pj: dict) -> None:
        m = meta(pj)
        if not (m.get("labels") or {}).get(QUEUE_LABEL):
            return
        uid, ns, name = m.get("uid", ""), m.get("namespace", ""), m.get("name", "")
        if kind == "DELETED":
            with self.lock:
                self.due.pop(uid, None)
            return
        suspended = pj_suspended(pj)
        resuspend = False
        with self.lock:
            self.queued.add(uid)
            if uid not in self.first_seen:
                self.first_seen[uid] = now()
                if not suspended and uid not in self.admitted:
                    self.created_unsuspended.append(Incident("created-unsuspended", ns, name, now(), {
                        "managers": managers_of(pj, "spec", "runPolicy", "suspend")}))
                self.due[uid] = (now() + self.hold(ns, name), ns, name)
                self.last_suspend[uid] = suspended  # a first sight is no flip
            was = self.last_suspend.get(uid, True)
            self.last_suspend[uid] = suspended
            if was and not suspended and uid not in self.admitted and not pj_finished(pj):
                self.incidents.append(Incident("unsuspended-before-admission", ns, ftj_name_of(pj) or name, now(), {
                    "pytorchjob": name, "managers": managers_of(pj, "spec", "runPolicy", "suspend"),
                    "resourceVersion": m.get("resourceVersion")}))
                resuspend = True
        if resuspend:  # Kueue's reconciler stops a job that runs without admission
            self._patch(ns, name, True)
            self.resuspends += 1

    def _patch(self, ns: str, name: str, suspend: bool) -> bool:
        try:
            self.custom.patch_namespaced_custom_object(*PJ[:2], ns, PJ[2], name,
                                                       {"spec": {"runPolicy": {"suspend": suspend}}},
                                                       field_manager=QUEUE_MANAGER)
            return True
        except ApiException as exc:
            return exc.status == 404
        except Exception:
            return False

    def _admit_loop(self) -> None:
        while not self.stop_event.wait(0.2):
            with self.lock:
                ready = [(uid, ns, name) for uid, (when, ns, name) in self.due.items() if when <= now()]
            for uid, ns, name in ready:
                with self.lock:
                    self.admitted.add(uid)  # before the patch: our own event is not a violation
                if self._patch(ns, name, False):
                    with self.lock:
                        self.due.pop(uid, None)
                        self.admissions += 1
                else:
                    with self.lock:
                        self.admitted.discard(uid)  # the apiserver is away: try again

    def pending(self) -> int:
        with self.lock:
            return len(self.due)


# ---------------------------------------------------------------------------
# foreign objects with clashing names
# ---------------------------------------------------------------------------


def _fingerprint(obj: dict) -> str:
    m = meta(obj)
    return json.dumps({
        "spec": obj.get("spec"), "data": obj.get("data"), "labels": m.get("labels"),
        "annotations": m.get("annotations"), "ownerReferences": m.get("ownerReferences"),
        "finalizers": m.get("finalizers"), "deletionTimestamp": m.get("deletionTimestamp"),
    }, sort_keys=True)


@dataclass
class Foreign:
    kind: str  # ConfigMap | PyTorchJob
    namespace: str
    name: str
    job: str  # the FineTuneJob whose attempt name it takes
    uid: str = ""
    fingerprint: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)  # what was done to it


def foreign_pytorchjob(namespace: str, name: str) -> dict:
    """A valid PyTorchJob of someone else: suspended (it never takes GPUs), no finetune labels."""
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace, "labels": {FOREIGN_LABEL: "true", "team": "someone-else"}},
        "spec": {
            "runPolicy": {"suspend": True},
            "pytorchReplicaSpecs": {"Master": {"replicas": 1, "restartPolicy": "Never", "template": {"spec": {
                "containers": [{"name": "pytorch", "image": "registry.example/someone-else/train:1",
                                "command": ["python", "train.py"]}]}}}},
        },
    }


def foreign_configmap(namespace: str, name: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": {FOREIGN_LABEL: "true", "team": "someone-else"}},
            "data": {"config.json": json.dumps({"owner": "someone-else", "note": "not a FineTuneJob's"})}}


class ForeignObjects:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.lock = threading.Lock()
        self.items: dict[tuple[str, str, str], Foreign] = {}

    def uids(self) -> set[str]:
        with self.lock:
            return {f.uid for f in self.items.values() if f.uid}

    def create(self, kind: str, namespace: str, name: str, job: str) -> Foreign:
        if kind == "ConfigMap":
            obj = json.loads(self.core.create_namespaced_config_map(
                namespace, foreign_configmap(namespace, name), _preload_content=False).data)
        else:
            obj = json.loads(self.custom.create_namespaced_custom_object(
                *PJ[:2], namespace, PJ[2], foreign_pytorchjob(namespace, name), _preload_content=False).data)
        item = Foreign(kind, namespace, name, job, meta(obj)["uid"], _fingerprint(obj))
        with self.lock:
            self.items[(kind, namespace, name)] = item
        return item

    def on_event(self, kind_of_object: str) -> Callable[[str, dict], None]:
        def handle(event: str, obj: dict) -> None:
            ns, name = key_of(obj)
            with self.lock:
                item = self.items.get((kind_of_object, ns, name))
                if item is None:
                    return
                if meta(obj).get("uid") != item.uid:
                    if event != "DELETED":
                        item.events.append({"what": "replaced", "at": now(), "uid": meta(obj).get("uid"),
                                            "managers": managers_of(obj)})
                    return
                if event == "DELETED":
                    item.events.append({"what": "deleted", "at": now()})
                elif _fingerprint(obj) != item.fingerprint:
                    item.events.append({"what": "modified", "at": now(), "resourceVersion": meta(obj).get("resourceVersion"),
                                        "now": json.loads(_fingerprint(obj)),
                                        "managers": [e.get("manager") for e in meta(obj).get("managedFields") or []]})
                    item.fingerprint = _fingerprint(obj)
        return handle

    def final_check(self) -> None:
        """Read each foreign object once more (a change while a watch was down is caught here)."""
        for item in list(self.items.values()):
            try:
                obj = self._read_with_retries(item)
            except ApiException as exc:
                if exc.status == 404:
                    if not any(e["what"] == "deleted" for e in item.events):
                        item.events.append({"what": "deleted", "at": now(), "seen": "final check"})
                    continue
                raise
            if meta(obj).get("uid") == item.uid:
                # A label-selector watch reports an object that stopped matching as DELETED.
                item.events = [e for e in item.events if e["what"] != "deleted"]
            if meta(obj).get("uid") != item.uid:
                if not any(e["what"] in ("deleted", "replaced") for e in item.events):
                    item.events.append({"what": "replaced", "at": now(), "seen": "final check"})
            elif _fingerprint(obj) != item.fingerprint:
                item.events.append({"what": "modified", "at": now(), "seen": "final check",
                                    "now": json.loads(_fingerprint(obj))})

    def _read_with_retries(self, item: Foreign, tries: int = 30) -> dict:
        for attempt in range(tries):
            try:
                if item.kind == "ConfigMap":
                    return json.loads(self.core.read_namespaced_config_map(item.name, item.namespace, _preload_content=False).data)
                return json.loads(self.custom.get_namespaced_custom_object(
                    *PJ[:2], item.namespace, PJ[2], item.name, _preload_content=False).data)
            except ApiException:
                raise
            except Exception:  # the apiserver is away: it comes back, or the run says so
                if attempt == tries - 1:
                    raise
                time.sleep(1)
        raise AssertionError("unreachable")

    def touched(self) -> list[Foreign]:
        return [f for f in self.items.values() if f.events]


# ---------------------------------------------------------------------------
# FineTuneJobs over time
# ---------------------------------------------------------------------------


@dataclass
class JobHistory:
    namespace: str
    name: str
    phases: list[tuple[float, str]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    terminal_at: float | None = None
    messages: set[str] = field(default_factory=set)  # every condition message ever seen
    deleted: bool = False


class JobTracker:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[tuple[str, str], JobHistory] = {}

    def on_sync(self, items: list[dict]) -> None:
        for item in items:
            self.on_event("ADDED", item)

    def on_event(self, kind: str, obj: dict) -> None:
        key = key_of(obj)
        status = obj.get("status") or {}
        with self.lock:
            hist = self.jobs.setdefault(key, JobHistory(*key))
            if kind == "DELETED":
                hist.deleted = True
                return
            hist.last = status
            phase = status.get("phase") or ""
            if not hist.phases or hist.phases[-1][1] != phase:
                hist.phases.append((now(), phase))
            if phase in TERMINAL and hist.terminal_at is None:
                hist.terminal_at = now()
            for cond in status.get("conditions") or []:
                hist.messages.add(f"{cond.get('type')}={cond.get('status')} {cond.get('reason')}: {cond.get('message', '')}")

    def get(self, namespace: str, name: str) -> JobHistory | None:
        with self.lock:
            return self.jobs.get((namespace, name))


# ---------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------


def patch_status(custom: client.CustomObjectsApi, namespace: str, name: str, status: dict) -> dict:
    """A merge patch of the status subresource, as `kubectl patch --subresource=status --type=merge`."""
    return custom.patch_namespaced_custom_object_status(*FTJ[:2], namespace, FTJ[2], name, {"status": status})


def patch_status_current_attempt_null(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    before = custom.get_namespaced_custom_object(*FTJ[:2], namespace, FTJ[2], name).get("status") or {}
    after = patch_status(custom, namespace, name, {"currentAttempt": None}).get("status") or {}
    return {"before_currentAttempt": before.get("currentAttempt"), "after_currentAttempt": after.get("currentAttempt"),
            "phase": before.get("phase")}


def patch_status_attempt_extra_key(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    """Every attempts[] entry gets a key this operator does not know (a newer version's field)."""
    before = custom.get_namespaced_custom_object(*FTJ[:2], namespace, FTJ[2], name).get("status") or {}
    attempts = [dict(a, preemptionCount=0, annotatedBy="chaos") for a in before.get("attempts") or []]
    if not attempts:
        return {"applied": False, "why": "no attempts yet"}
    after = patch_status(custom, namespace, name, {"attempts": attempts}).get("status") or {}
    kept = all("annotatedBy" in a for a in after.get("attempts") or [])
    return {"applied": True, "unknown_key_kept_by_apiserver": kept, "attempts": len(attempts),
            "currentAttempt": before.get("currentAttempt"), "phase": before.get("phase")}


def patch_status_unknown_top_key(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict:
    after = patch_status(custom, namespace, name, {"externalTool": {"owner": "someone-else", "lastSync": "2026-01-01T00:00:00Z"}})
    status = after.get("status") or {}
    return {"unknown_key_kept_by_apiserver": "externalTool" in status, "phase": status.get("phase"),
            "currentAttempt": status.get("currentAttempt")}


def running_training_pods(core: client.CoreV1Api, namespace: str, job_label: str) -> list[dict]:
    pods = json.loads(core.list_namespaced_pod(namespace, label_selector=f"{JOB_LABEL}={job_label}",
                                               _preload_content=False).data)["items"]
    return [p for p in pods if (p.get("status") or {}).get("phase") == "Running" and not meta(p).get("deletionTimestamp")]


def evict_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """The Eviction API, as `kubectl drain` or a descheduler uses it."""
    core.create_namespaced_pod_eviction(name, namespace, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name, namespace=namespace)))


def delete_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    core.delete_namespaced_pod(name, namespace)


def preserve_unknown_status_fields(lab: Any, crd: str = "finetunejobs.finetune.dev") -> None:
    """Make the installed CRD keep unknown fields in status and in status.attempts[] (what a newer
    CRD with fields this operator does not know looks like to it); without this the apiserver
    prunes them and an unknown-field patch never reaches the operator."""
    base = "/spec/versions/0/schema/openAPIV3Schema/properties/status"
    ops = [{"op": "add", "path": f"{base}/x-kubernetes-preserve-unknown-fields", "value": True},
           {"op": "add", "path": f"{base}/properties/attempts/items/x-kubernetes-preserve-unknown-fields", "value": True}]
    lab.kubectl("patch", "crd", crd, "--type=json", "-p", json.dumps(ops))


# ---------------------------------------------------------------------------
# A TCP proxy that stops forwarding without closing


class FreezingProxy:
    """Listens on 127.0.0.1 and forwards each connection to `target` (host, port), byte for byte
    (TLS passes through untouched). `freeze()` stops forwarding in both directions and leaves every
    connection open, new ones accepted and never answered: what a client sees of a half-open
    connection. `thaw()` forwards again (bytes held meanwhile go through)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def freeze(self) -> None:
        self._forwarding.clear()

    def thaw(self) -> None:
        self._forwarding.set()

    def close(self) -> None:
        self._stop.set()
        self._forwarding.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                try:
                    sock.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(downstream,), name="proxy-pipe", daemon=True).start()

    def _pipe(self, downstream: socket.socket) -> None:
        self._forwarding.wait()  # frozen: accepted, never connected upstream, never answered
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            downstream.close()
            return
        with self._lock:
            self._sockets += [downstream, upstream]
        peers = {downstream: upstream, upstream: downstream}
        try:
            while not self._stop.is_set():
                readable, _, _ = select.select(list(peers), [], [], 0.2)
                for sock in readable:
                    self._forwarding.wait()  # frozen: hold the bytes, close nothing
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            for sock in peers:
                try:
                    sock.close()
                except OSError:
                    pass


class LeaseEndpoint(BaseHTTPRequestHandler):
    """A stand-in for the API server's one Lease (GET it, 404 before the first create; POST or PUT
    it), for checks of the leader election without a lab (tests/operator/test_bounded_api.py,
    bench/lease_renew.py). `written` holds when it was last written (time.monotonic)."""

    protocol_version = "HTTP/1.1"
    lease: dict = {}
    written: list[float] = []

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.lease:
            self._send(200, self.lease)
        else:
            self._send(404, {"kind": "Status", "apiVersion": "v1", "code": 404, "reason": "NotFound"})

    def _store(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body.setdefault("metadata", {})["resourceVersion"] = str(time.time_ns())
        self.lease.clear()
        self.lease.update(body)
        self.written.append(time.monotonic())
        self._send(200, self.lease)

    do_POST = do_PUT = _store  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    """A threading HTTP server that does not print a traceback for a connection closed under it."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass
