"""`Cluster`: the reads and writes of the Kubernetes API that reconciling a job needs, the only
code that talks to the API for a job (reconciler.py decides what to write, and in which order).
It holds what those reads share between reconciles: which training-job kinds the API server
serves (discovery, cached), the pool snapshot (nodes and GPU pods, cached or informed), the pods
that failed (failed_pods.py) and the events posted lately (aggregated_events.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from .. import api, lifecycle, progress
from .aggregated_events import AggregatedEvents
from .failed_pods import FailedPods
from .informer import wait_synced
from .informers import ClusterCache
from ..children import (SUSPENDED_BY_ANNOTATION, SUSPENDED_BY_US, Admission, Child, admission_of, child_of,
                       controlled_by, owned_workload)
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool, discover_pools, merge_pools
from ..profiling.pod import is_profile_pod_of
from ..rendering.names import attempt_name, label_value
from ..rendering.backend import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_SERVED,
    Backend,
    Prerequisite,
    ReportsTrainerStatus,
    Suspendable,
    backend_of_kind,
)
from ..rendering.labels import JOB_LABEL

# Named as when this code was shell/controller.py: log lines (and filters on them) keep their logger name.
log = logging.getLogger("finetune_operator.controller")

# Kueue's API (read only: a queued child's Workload and its LocalQueue).
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
# Which training-job kinds the API server serves, looked up again after this long (and at once when a
# CRD changes: handlers.training_crd_changed calls forget_served_backends).
BACKEND_DISCOVERY_SECONDS = 30.0
# Discovery lists every node and running pod; several jobs planning at once share one look.
DISCOVERY_CACHE_SECONDS = 5.0
# With informers (informers.py) discovery reads memory: it runs again when a node or GPU pod changed,
# at most this often (a burst of plans shares one look; the claim book counts what is in between).
DISCOVERY_REFRESH_SECONDS = 0.5


def _json(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


class Cluster:
    """Reads and writes of the Kubernetes API that reconciling a job needs."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.extensions = client.ApiextensionsV1Api(api_client)  # the training-job CRDs' informers
        self._pool_cache: tuple[float, list[NodePool], Any] | None = None  # (when, pools, what they were made of)
        self._pool_lock = threading.Lock()
        # Nodes, GPU pods, the jobs' pods and training jobs, watched (start_cache); None: lists on every read.
        self.cache: ClusterCache | None = None
        # None: every namespace; a namespaced install names the ones it watches (start_cache).
        self.watched_namespaces: list[str] | None = None
        self._failed_pods = FailedPods()
        self._events = AggregatedEvents()
        self._served: tuple[float, tuple[Backend, ...]] | None = None
        self._prerequisites: dict[Prerequisite, tuple[float, bool]] = {}
        self._served_lock = threading.Lock()

    # -- which backends the cluster serves -----------------------------------
    def served_backends(self) -> tuple[Backend, ...]:
        """The training-job kinds the API server serves now (API discovery, cached a little)."""
        with self._served_lock:
            now = time.monotonic()
            if self._served is None or now - self._served[0] > BACKEND_DISCOVERY_SECONDS:
                served = tuple(b for b in BACKENDS if self._serves(b))
                if self._served is None or served != self._served[1]:
                    log.info("training backends served: %s", ", ".join(b.resource for b in served) or "none")
                self._served = (now, served)
            return self._served[1]

    def may(self, verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
        """Whether this ServiceAccount may `verb` the resource (a SelfSubjectAccessReview, which every
        authenticated user may create); in `namespace`, or in all namespaces."""
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
            resource_attributes=client.V1ResourceAttributes(verb=verb, group=group, resource=resource,
                                                            namespace=namespace)))
        answer = client.AuthorizationV1Api(self.api_client).create_self_subject_access_review(review)
        return bool(answer.status and answer.status.allowed)

    def forget_served_backends(self) -> None:
        """A CRD changed: look again on the next reconcile."""
        with self._served_lock:
            self._served = None
            self._prerequisites.clear()

    def prerequisite_met(self, needed: Prerequisite) -> bool:
        """Whether the cluster object a backend needs (`Preflight`: TrainJob's ClusterTrainingRuntime) exists,
        cached like the served kinds. A read RBAC does not allow counts as existing: the backend's own
        admission (Trainer's webhook) then refuses the job, and the job says so."""
        with self._served_lock:
            seen = self._prerequisites.get(needed)
            now = time.monotonic()
            if seen is not None and now - seen[0] <= BACKEND_DISCOVERY_SECONDS:
                return seen[1]
        try:
            self.custom.get_cluster_custom_object(needed.group, needed.version, needed.plural, needed.name,
                                                  _preload_content=False)
            exists = True
        except ApiException as error:
            if error.status not in (403, 404):
                raise
            exists = error.status == 403
        with self._served_lock:
            self._prerequisites[needed] = (time.monotonic(), exists)
        return exists

    def _serves(self, backend: Backend) -> bool:
        try:
            resources = _json(self.custom.get_api_resources(backend.group, backend.version, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return any(r.get("name") == backend.plural for r in resources.get("resources") or [])

    # -- FineTuneJobs -------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def replace_job_status(self, body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        """Write the whole status (a PUT, not a merge: cleared fields must go), guarded by
        resourceVersion, so a reconcile that read a stale job gets a 409 and runs again.
        Returns the job as stored (its new resourceVersion guards the next write)."""
        meta = body["metadata"]
        updated = dict(body, status=status)
        return _json(self.custom.replace_namespaced_custom_object_status(
            api.GROUP, api.VERSION, meta["namespace"], api.PLURAL, meta["name"], updated, _preload_content=False))

    def patch_job_conditions(self, body: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
        """Replace only status.conditions (a merge patch): for a status the operator cannot
        read, whose other fields it must not touch."""
        meta = body["metadata"]
        self.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, meta["namespace"], api.PLURAL, meta["name"],
            {"metadata": {"resourceVersion": meta.get("resourceVersion")},
             "status": {"conditions": conditions, "reason": "StatusUnreadable"}})

    # -- the attempt's objects ---------------------------------------------
    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _json(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def get_training_job(self, backend: Backend, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return _json(self.custom.get_namespaced_custom_object(
                backend.group, backend.version, namespace, backend.plural, name, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def _get(self, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
        if kind == "ConfigMap":
            return self.get_config_map(namespace, name)
        if kind == "NetworkPolicy":
            try:
                return _json(self.networking.read_namespaced_network_policy(name, namespace, _preload_content=False))
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
        if kind == "Pod":
            try:
                return _json(self.core.read_namespaced_pod(name, namespace, _preload_content=False))
            except ApiException as error:
                if error.status == 404:
                    return None
                raise
        backend = backend_of_kind(kind)
        if backend is None:
            raise ValueError(f"the operator does not manage {kind} objects")
        return self.get_training_job(backend, namespace, name)

    def start_cache(self, namespaces: list[str] | None, on_job: Callable[[str, str], None] | None,
                    sync_timeout: float = 30.0, on_capacity: Callable[[], None] | None = None) -> ClusterCache:
        """Watch nodes, GPU pods and the jobs' pods instead of listing them (informers.py); training-job
        kinds join with `cache.watch_children`. Reads fall back to the API until an informer has listed."""
        self.watched_namespaces = namespaces
        self.cache = ClusterCache(self.core, self.custom, extensions=self.extensions, namespaces=namespaces, on_job=on_job,
                                  on_pod=lambda pod, deleted: self.remember_failed_pod(pod, deleted=deleted),
                                  on_capacity=on_capacity).start()
        if not wait_synced(self.cache.all(), sync_timeout):
            log.warning("informers not listed after %.0f s; reading the API directly until they have", sync_timeout)
        return self.cache

    def trainer_status(self, target: progress.Target) -> Any:
        """(Memory only, for the progress poller.) The status.trainerStatus of the target attempt's
        training job where its backend has one and the informer holds the job; else None."""
        if self.cache is None:
            return None
        name = attempt_name(target.job, target.attempt)
        for backend in BACKENDS:
            if not isinstance(backend, ReportsTrainerStatus):
                continue
            for obj in self.cache.job_children(backend, target.namespace, label_value(target.job)) or ():
                if (obj.get("metadata") or {}).get("name") == name:
                    return backend.trainer_status(obj)
        return None

    def list_children(self, namespace: str, job: str, owner_uid: str | None,
                      backends: tuple[Backend, ...] | list[Backend] = DEFAULT_SERVED) -> list[Child]:
        """The training jobs of every attempt that this FineTuneJob controls (by uid), of each kind in
        `backends` (those the cluster serves: a job may have children of both after a policy change)."""
        selector = f"{JOB_LABEL}={label_value(job)}"
        children = []
        for backend in backends:
            cached = self.cache.job_children(backend, namespace, label_value(job)) if self.cache else None
            try:
                items = cached if cached is not None else _json(self.custom.list_namespaced_custom_object(
                    backend.group, backend.version, namespace, backend.plural, label_selector=selector,
                    _preload_content=False))["items"]
            except ApiException as error:
                if error.status == 404:  # the CRD went away since discovery
                    continue
                if error.status == 403:
                    raise ChildrenUnreadable(backend, namespace, error.reason or "Forbidden") from error
                raise
            for item in items:
                if not controlled_by(item, owner_uid):
                    continue  # carries our label but is not ours: never read as ours
                child = child_of(item, backend)
                if child is not None:
                    children.append(child)
        return children

    def foreign_objects(self, namespace: str, name: str, owner_uid: str | None,
                        backends: tuple[Backend, ...] | list[Backend] = DEFAULT_SERVED) -> list[lifecycle.ObjectRef]:
        """The objects that hold `name` (an attempt's ConfigMap, NetworkPolicy and training job) without being ours."""
        foreign = []
        for ref in (lifecycle.ObjectRef("v1", "ConfigMap", name), lifecycle.network_policy_ref(name),
                    *(lifecycle.ObjectRef(b.api_version, b.kind, name) for b in backends)):
            existing = self._get(namespace, ref.kind, ref.name)
            if existing is not None and not controlled_by(existing, owner_uid):
                foreign.append(ref)
        return foreign

    def list_job_pods(self, namespace: str, job: str, *, fresh: bool = False) -> list[dict[str, Any]]:
        """The job's pods of every attempt, plus failed ones seen in watch events that are gone since.
        `fresh`: as the API server has them now, not the informer's memory."""
        selector = f"{JOB_LABEL}={label_value(job)}"
        pods = self.cache.job_pods(namespace, label_value(job)) if self.cache and not fresh else None
        if pods is None:
            pods = _json(self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False))["items"]
        present = {p["metadata"]["name"] for p in pods}
        return pods + self._failed_pods.gone(namespace, label_value(job), present)

    def remember_failed_pod(self, pod: dict[str, Any], *, deleted: bool = False) -> None:
        """Keep the last state of a training pod that failed, was disrupted or was deleted before
        it ended, until the next reconcile has written it into status: whoever deletes it (an
        eviction, a cleanup policy, a person) must not take the reason for the failure with it."""
        self._failed_pods.remember(pod, deleted=deleted)

    def create(self, namespace: str, obj: dict[str, Any], owner_uid: str | None) -> dict[str, Any]:
        """`_create`, and the informer holds the object at once: the next reconcile sees it."""
        created = self._create(namespace, obj, owner_uid)
        if self.cache is not None:
            self.cache.note_written(obj["kind"], created)
        return created

    def create_new(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """POST `obj`: the object created, or None when its name is taken (whose it is, and
        whether it holds what `obj` does, is `create`'s to sort out)."""
        try:
            created = self._post(namespace, obj)
        except ApiException as error:
            if error.status == 409:
                return None
            raise
        if self.cache is not None:
            self.cache.note_written(obj["kind"], created)
        return created

    def _post(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
        kind = obj["kind"]
        if kind == "ConfigMap":
            return _json(self.core.create_namespaced_config_map(namespace, obj, _preload_content=False))
        if kind == "Pod":  # the pre-flight profile pod (profiling/pod.py)
            return _json(self.core.create_namespaced_pod(namespace, obj, _preload_content=False))
        if kind == "NetworkPolicy":
            return _json(self.networking.create_namespaced_network_policy(namespace, obj, _preload_content=False))
        backend = backend_of_kind(kind)
        if backend is None:
            raise ValueError(f"cannot create a {kind}")
        return _json(self.custom.create_namespaced_custom_object(
            backend.group, backend.version, namespace, backend.plural, obj, _preload_content=False))

    def _create(self, namespace: str, obj: dict[str, Any], owner_uid: str | None) -> dict[str, Any]:
        """Create `obj`. If it exists already and is ours (a retry after a crash), return it;
        if it is someone else's, raise ForeignObject: never adopted, never changed."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            return self._post(namespace, obj)
        except ApiException as error:
            if error.status != 409:
                raise
            existing = self._get(namespace, kind, name)
            if existing is None:
                raise  # deleted since: the next reconcile creates it
            if not _ours(kind, existing, owner_uid):
                raise ForeignObject(kind, name) from None
            if kind == "ConfigMap" and (existing.get("data") or {}) != (obj.get("data") or {}):
                return self._update_config_map(namespace, existing, obj)
            return existing

    def _update_config_map(self, namespace: str, existing: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
        """Our attempt's ConfigMap left by an earlier try whose training job was never created (a
        crash between the two creates), holding another config: the plan or the policy changed
        since. The training job about to be created must read this try's config, not that one's.
        Guarded by the resourceVersion read: a 409 sends the reconcile round again."""
        data = obj.get("data") or {}
        patch = {"metadata": {"resourceVersion": existing["metadata"]["resourceVersion"]},
                 "data": {key: data.get(key) for key in {*(existing.get("data") or {}), *data}}}
        log.info("ConfigMap %s/%s holds an earlier try's config; updating it", namespace, obj["metadata"]["name"])
        return _json(self.core.patch_namespaced_config_map(obj["metadata"]["name"], namespace, patch,
                                                           _preload_content=False))

    def delete(self, namespace: str, ref: lifecycle.ObjectRef, owner_uid: str | None) -> bool:
        """`_delete`, and the informer forgets the object at once."""
        deleted = self._delete(namespace, ref, owner_uid)
        if deleted and self.cache is not None:
            self.cache.note_deleted(ref.kind, namespace, ref.name)
        return deleted

    def _delete(self, namespace: str, ref: lifecycle.ObjectRef, owner_uid: str | None) -> bool:
        """Delete an attempt's object if, and only if, this job controls it. Returns whether a
        delete was sent. The uid precondition makes a delete of a same-named replacement fail."""
        existing = self._get(namespace, ref.kind, ref.name)
        if existing is None:
            return False
        if not _ours(ref.kind, existing, owner_uid):
            log.warning("not deleting %s %s/%s: it is not controlled by this FineTuneJob", ref.kind, namespace, ref.name)
            return False
        options = client.V1DeleteOptions(
            # Background: the training job goes at once; the garbage collector removes its pods.
            propagation_policy="Background",
            preconditions=client.V1Preconditions(uid=existing["metadata"]["uid"]))
        try:
            if ref.kind == "ConfigMap":
                self.core.delete_namespaced_config_map(ref.name, namespace, body=options)
            elif ref.kind == "Pod":
                self.core.delete_namespaced_pod(ref.name, namespace, body=options)
            elif ref.kind == "NetworkPolicy":
                self.networking.delete_namespaced_network_policy(ref.name, namespace, body=options)
            else:
                backend = backend_of_kind(ref.kind)
                assert backend is not None  # _get refused other kinds
                self.custom.delete_namespaced_custom_object(
                    backend.group, backend.version, namespace, backend.plural, ref.name, body=options)
        except ApiException as error:
            if error.status in (404, 409):  # gone, or replaced by another object since the read
                return False
            raise
        return True

    def set_suspend(self, namespace: str, name: str, suspend: bool, kind: str = DEFAULT_BACKEND.kind) -> None:
        """Suspend or resume the training job for spec.suspend, marking it as suspended by us
        (the mark is what allows resuming it; a child suspended by a queue has none)."""
        backend = backend_of_kind(kind)
        if backend is None:
            raise ValueError(f"the operator does not manage {kind} objects")
        if not isinstance(backend, Suspendable):
            raise ValueError(f"a {kind} has no suspend switch")
        mark = SUSPENDED_BY_US if suspend else None
        self.custom.patch_namespaced_custom_object(
            backend.group, backend.version, namespace, backend.plural, name,
            {"metadata": {"annotations": {SUSPENDED_BY_ANNOTATION: mark}}, **backend.suspend_patch(suspend)})

    # -- Kueue (read only) --------------------------------------------------
    def admission(self, namespace: str, child: Child) -> Admission | None:
        """Kueue's word on a queued child: its Workload (controller-owned by the child) and whether its
        LocalQueue exists. None when Kueue's API cannot be read (not installed, or the chart's
        `kueue.enabled` RBAC is off): the job then says only that the queue holds it."""
        uid = (child.body.get("metadata") or {}).get("uid")
        try:
            workloads = _json(self.custom.list_namespaced_custom_object(
                KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", _preload_content=False))["items"]
            workload = owned_workload(workloads, uid)
            missing = False
            if child.queue and (workload is None or not admission_of(workload).admitted):
                missing = not self.local_queue_exists(namespace, child.queue)
        except ApiException as error:
            if error.status in (403, 404):
                return None
            raise
        return admission_of(workload, queue_missing=missing)

    def local_queue_exists(self, namespace: str, name: str) -> bool:
        try:
            self.custom.get_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", name,
                                                     _preload_content=False)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True

    def read_config_map_key(self, namespace: str, name: str, key: str) -> str | None:
        try:
            cm = _json(self.core.read_namespaced_config_map(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return (cm.get("data") or {}).get(key)

    # -- pools --------------------------------------------------------------
    def pools(self, policy: ClusterPolicy) -> list[NodePool]:
        """Catalog pools merged with what the Node objects show now (cached a few seconds)."""
        return self.pool_snapshot(policy)[0]

    def gpu_pods_counted(self, pods: list[dict[str, Any]]) -> bool:
        """Whether discovery's inputs hold these (bound) pods, so a snapshot made from now on counts
        their GPUs. Without informers the next list sees them."""
        if self.cache is None:
            return True
        for pod in pods:
            meta = pod.get("metadata") or {}
            if self.cache.holds_gpu_pod(meta.get("namespace") or "", meta.get("name") or "") is False:
                return False
        return True

    def pool_snapshot(self, policy: ClusterPolicy) -> tuple[list[NodePool], float]:
        """The pools and when (time.monotonic()) the look they come from was taken."""
        with self._pool_lock:
            now = time.monotonic()
            informed = self.cache.discovery_inputs() if self.cache is not None else None
            if informed is not None:
                versions, nodes, pods = informed
                seen = self._pool_cache
                if seen is None or (seen[2] != (versions, id(policy)) and now - seen[0] > DISCOVERY_REFRESH_SECONDS):
                    self._pool_cache = (now, merge_pools(policy.catalog, discover_pools(nodes, pods, policy)),
                                        (versions, id(policy)))
                return list(self._pool_cache[1]), self._pool_cache[0]
            if self._pool_cache is None or now - self._pool_cache[0] > DISCOVERY_CACHE_SECONDS:
                nodes = _json(self.core.list_node(_preload_content=False))["items"]
                active = "status.phase!=Succeeded,status.phase!=Failed"
                if self.watched_namespaces is None:
                    pods = _json(self.core.list_pod_for_all_namespaces(
                        field_selector=active, _preload_content=False))["items"]
                else:  # a namespaced install reads pods only where it watches (informers.py)
                    pods = [pod for ns in self.watched_namespaces for pod in _json(self.core.list_namespaced_pod(
                        ns, field_selector=active, _preload_content=False))["items"]]
                discovered = discover_pools(nodes, pods, policy)
                self._pool_cache = (now, merge_pools(policy.catalog, discovered), None)
            return list(self._pool_cache[1]), self._pool_cache[0]

    # -- events -------------------------------------------------------------
    def post_event(self, job_body: dict[str, Any], event: lifecycle.Event) -> None:
        """Post an Event about the job, aggregated as client-go's recorder does (aggregated_events.py)."""
        self._events.post(self.core, job_body, event)


class ChildrenUnreadable(Exception):
    """The API forbids listing a kind of training job the cluster serves (403): the operator cannot
    know whether an attempt of that kind still runs, so it must not start another."""

    def __init__(self, backend: Backend, namespace: str, reason: str) -> None:
        super().__init__(f"the operator may not list {backend.resource} in namespace {namespace} ({reason}): it "
                         f"cannot tell whether an attempt of that kind runs, so it creates and deletes nothing for "
                         f"this job until it may (the chart grants reading both kinds under every trainingBackend)")
        self.backend, self.namespace = backend, namespace


class ForeignObject(Exception):
    """An object the operator needs to create exists and is not controlled by the FineTuneJob."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind} {name} exists and is not controlled by this FineTuneJob "
                         "(delete or rename it; the operator never adopts or deletes it)")
        self.kind, self.name = kind, name


def _ours(kind: str, obj: dict[str, Any], owner_uid: str | None) -> bool:
    """Whether the job with `owner_uid` owns `obj`: its controller ownerReference, or for the one pod
    the operator creates, the profile pod (in the operator's namespace, where no ownerReference can
    reach the job), its uid label."""
    return is_profile_pod_of(obj, owner_uid) if kind == "Pod" else controlled_by(obj, owner_uid)
