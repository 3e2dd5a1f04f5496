"""The shell around the lifecycle: read the world, call `lifecycle.step`, write the result.

`Cluster` is the only code that talks to the Kubernetes API for a job; `Reconciler` runs
one reconcile of one job; `WorkQueue` serialises reconciles per job and schedules the
"look again in N seconds" that the lifecycle asks for. kopf (in `handlers.py`) feeds the
queue from watch events, so a pod that dies wakes its job at once.

Order of writes, chosen so that a kill at any point is harmless: status first (it names
the attempt and its plan), then the attempt's objects (deterministic names: a second
create is answered AlreadyExists and the existing object is adopted), then events.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Protocol

from kubernetes import client
from kubernetes.client.rest import ApiException

from pydantic import ValidationError

from .. import api, lifecycle, progress
from . import metrics
from .progress_poller import ProgressPoller
from ..children import (SUSPENDED_BY_ANNOTATION, SUSPENDED_BY_US, Admission, Child, admission_of, child_of,
                       controlled_by, owned_workload)
from ..planning.capacity import Waiting, movers, with_claims
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool, discover_pools, merge_pools
from .informers import ClusterCache, wait_synced
from .claim_book import ClaimBook, Held, still_fits
from .aggregated_events import AggregatedEvents
from .failed_pods import FailedPods
from .job_bodies import JobBodies, OwnWrites
from .job_status import read_status, status_json
from ..profiling.pod import is_profile_pod_of
from ..rendering.names import attempt_name, label_value
from ..rendering.backend import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_SERVED,
    Backend,
    Preflight,
    Prerequisite,
    ReportsTrainerStatus,
    Suspendable,
    backend_of_kind,
    may_choose,
)
from ..rendering.renderer import ATTEMPT_LABEL, JOB_LABEL

log = logging.getLogger("finetune_operator.controller")

# Kueue's API (read only: a queued child's Workload and its LocalQueue).
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
# Which training-job kinds the API server serves, looked up again after this long (and at once when a
# CRD changes: handlers.py calls forget_served_backends).
BACKEND_DISCOVERY_SECONDS = 30.0
# Discovery lists every node and running pod; several jobs planning at once share one look.
DISCOVERY_CACHE_SECONDS = 5.0
# With informers (informers.py) discovery reads memory: it runs again when a node or GPU pod changed,
# at most this often (a burst of plans shares one look; the claim book counts what is in between).
DISCOVERY_REFRESH_SECONDS = 0.5
# A waiting job woken because another pool has room is not woken again for this long (it may stay).
WAKE_REPEAT_SECONDS = 10.0
WOKEN_MEMORY = 4096


def _json(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


class Cluster:
    """Reads and writes of the Kubernetes API that reconciling a job needs."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)
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
        self.cache = ClusterCache(self.core, self.custom, namespaces=namespaces, on_job=on_job,
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


class PolicyHolder:
    """The current cluster policy; swapped in whole when its ConfigMap changes."""

    def __init__(self, policy: ClusterPolicy) -> None:
        self._policy = policy
        self._lock = threading.Lock()

    def get(self) -> ClusterPolicy:
        with self._lock:
            return self._policy

    def set(self, policy: ClusterPolicy) -> None:
        with self._lock:
            self._policy = policy


class Pending(Protocol):
    """A write under way beside the reconcile (concurrent.futures.Future has this shape)."""

    def result(self) -> Any: ...

    def cancel(self) -> bool: ...


class Later:
    """`Reconciler.alongside` without threads: the call runs when its result is asked for, so the
    writes go one after another (status, ConfigMap, training job), and a cancelled one never runs."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call: Callable[[], Any] | None = call

    def result(self) -> Any:
        assert self._call is not None, "cancelled"
        return self._call()

    def cancel(self) -> bool:
        self._call = None
        return True


@dataclass
class Reconciler:
    cluster: Cluster
    policy: PolicyHolder
    clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)
    claims: ClaimBook = field(default_factory=lambda: ClaimBook())
    # Reads training progress from pod logs off the reconcile path (progress_poller.py); None: off.
    progress: ProgressPoller | None = None
    # The pre-flight profile's cache and pods (shell/profiling.py); None: models of unknown families are Invalid.
    profiles: Any = None
    # The learned memory calibration (calibration_store.py); None: plans use the built-in model only.
    calibration: Any = None
    # Posts Events off the reconcile path (events.py); None: posted before the reconcile ends.
    events: Any = None
    # The jobs as the watch last showed them (handlers.py feeds it); None: a GET per reconcile.
    bodies: JobBodies | None = None
    # The resourceVersions of our own status writes (handlers.py skips their watch events).
    own_writes: OwnWrites = field(default_factory=lambda: OwnWrites())
    # How a write runs beside the status write (the attempt's ConfigMap): a thread pool's submit in
    # the operator, which makes the path to the training job two API round trips long, not three.
    alongside: Callable[[Callable[[], Any]], Pending] = Later
    # Held only to check and note the claim of a decision that planned (`_commit`), never while planning.
    _placement: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Decisions made again under the placement lock because another job claimed their GPUs first.
    replans: int = field(default=0, repr=False)
    _woken: dict[tuple[str, str], float] = field(default_factory=dict, repr=False)  # waiting_to_wake's memory

    def reconcile(self, namespace: str, name: str) -> float | None:
        """One look at one job. Returns seconds until the next look, or None (wait for events)."""
        key = (namespace, name)
        body = self.bodies.get(key) if self.bodies is not None else None
        if body is None:
            body = self.cluster.get_job(namespace, name)
            if self.bodies is not None:
                self.bodies.must_read(key, False)
        if body is None:
            self.claims.forget((namespace, name))
            self.own_writes.forget((namespace, name))
            if self.progress is not None:
                self.progress.forget((namespace, name))
            return None
        started = time.monotonic()
        policy = self.policy.get()
        now = self.clock()
        status, unreadable = read_status(body.get("status") or {})
        if status is None:
            self._status_unreadable(body, unreadable or "", now)
            return None
        if status.phase in ("Succeeded", "Failed"):
            return None
        try:
            job = api.parse_job(_without_status(body))
            job = job.model_copy(update={"status": status})
            model_config, problems, waiting_for = self._read_model_config(job)
        except api.JobValidationError as error:
            decision = lifecycle.invalid(status, error.problems, now, body["metadata"].get("generation"))
            self._apply(body, job=None, decision=decision, policy=policy)
            metrics.observe_reconcile(decision, time.monotonic() - started, planned=False)
            return None
        uid = body["metadata"].get("uid")
        backends = self.cluster.served_backends()
        children = self.cluster.list_children(namespace, name, uid, backends)
        pods = self.cluster.list_job_pods(namespace, name)
        current = next((c for c in children if c.attempt == status.current_attempt), None)
        if current is not None and current.state == "Failed" and self.cluster.cache is not None \
                and _alive_pods_of(pods, current.attempt):
            # The training jobs' watch and the pods' are two streams: the job's Failed condition can
            # arrive before its pod's failure (the training operator wrote the pod first). Judged on
            # the remembered pods, the attempt would look "gone without a trace" (Evicted) instead of,
            # say, out of memory: read the pods as the API server has them now.
            pods = self.cluster.list_job_pods(namespace, name, fresh=True)
        if current is not None and current.queue and current.live:
            # Kueue's Workload says why a queued child waits (quota, flavor, a missing LocalQueue).
            admitted = self.cluster.admission(namespace, current)
            if admitted is not None:
                current = dataclasses.replace(current, admission=admitted)
                children = [current if c.attempt == current.attempt else c for c in children]
        foreign: list[lifecycle.ObjectRef] = []
        if status.current_attempt is not None and current is None:
            foreign = self.cluster.foreign_objects(namespace, attempt_name(name, status.current_attempt), uid, backends)
        # Planning reads every node (cached); a running attempt does not need it.
        needs_plan = current is None or current.state in ("Failed", "Pending")
        unusable: dict[str, str] = {}
        for backend in backends if needs_plan else ():
            # A backend the next attempt may use, which needs a cluster object besides its CRD.
            needed = backend.prerequisite(policy) if isinstance(backend, Preflight) and may_choose(policy, backend) else None
            if needed is not None and not self.cluster.prerequisite_met(needed):
                unusable[backend.name] = needed.missing
        default_queue = None
        if needs_plan and job.spec.queue_name is None and policy.default_queue_name is not None:
            try:
                if self.cluster.local_queue_exists(namespace, policy.default_queue_name):
                    default_queue = policy.default_queue_name
            except ApiException as error:
                if error.status not in (403, 404):  # Kueue not installed (or not readable): run unqueued
                    raise
        profile = self.profiles.observe(job, model_config, policy.trainer_image) if self.profiles else None
        learned = self.calibration.read() if self.calibration is not None else {}
        regions = frozenset(job.spec.placement.regions) & frozenset(policy.allowed_regions)
        held_before = self.claims.get(key)
        # Planning reads the free GPUs of one pool snapshot, net of the claims noted so far, and runs
        # outside the placement lock: the plans of several jobs are made at once (`_commit` checks them).
        snapshot, as_of = self.cluster.pool_snapshot(policy) if needs_plan else ([], math.inf)
        observed = lifecycle.Observed(job=job, now=now, policy=policy,
                                      pools=with_claims(snapshot, self.claims.others(key, as_of)) if needs_plan else [],
                                      children=children, pods=pods, foreign=foreign, invalid=problems,
                                      model_config=model_config, waiting_for=waiting_for, backends=backends,
                                      default_queue=default_queue, unusable=unusable, profile=profile, learned=learned)
        decision = lifecycle.step(observed)
        if needs_plan:
            decision = self._commit(key, observed, decision, snapshot, as_of, held_before, current, regions)
        else:
            self.claims.note(key, decision, current, pods, regions, self.cluster.gpu_pods_counted)
        try:
            self._apply(body, job=job, decision=decision, policy=policy, current=current)
        except BaseException:
            self.claims.restore(key, held_before)  # the decision did not happen
            raise
        if self.calibration is not None and decision.learned:
            self.calibration.write(decision.learned)  # after the status: a run is learned at most once
        if self.progress is not None:  # memory only: which log to follow now
            self.progress.track((namespace, name), progress.target_of(namespace, name, decision.status, pods))
        metrics.observe_reconcile(decision, time.monotonic() - started, planned=needs_plan)
        return decision.requeue_after

    def _commit(self, key: tuple[str, str], observed: lifecycle.Observed, decision: lifecycle.Decision,
                snapshot: list[NodePool], as_of: float, held: Held | None, current: Child | None,
                regions: frozenset[str]) -> lifecycle.Decision:
        """Note the claim of a decision that planned, as the Kubernetes scheduler "assumes" a pod on
        its node before the bind: under the placement lock, the GPUs the decision newly claims are
        checked against the claim book as it is now (the same snapshot, net of every claim noted
        since the plan read it). Two plans made at once may both have counted the same free GPUs;
        the one that comes second finds them claimed and is made again, here, under the lock, on
        the books as they are: nothing changes them before its note, so one step more is enough,
        and the job neither over-commits a pool nor waits for another look. Returns the decision
        noted."""
        with self._placement:
            pools_now = with_claims(snapshot, self.claims.others(key, as_of))
            if not still_fits(decision, held, observed.pools, pools_now):
                self.replans += 1
                log.debug("%s/%s: the GPUs its plan counted were claimed meanwhile; planning again", *key)
                decision = lifecycle.step(dataclasses.replace(observed, pools=pools_now))
            self.claims.note(key, decision, current, list(observed.pods), regions, self.cluster.gpu_pods_counted)
        return decision

    def waiting_to_wake(self) -> list[tuple[str, str]]:
        """Jobs whose attempts wait for a node while another pool in their regions has room now
        (capacity.movers): their reconcile may move them there. Each is named at most once every
        WAKE_REPEAT_SECONDS: one that stays (its plan prefers to wait) is not woken on every change."""
        policy = self.policy.get()
        now = time.monotonic()
        snapshot, as_of = self.cluster.pool_snapshot(policy)  # outside the lock: it may list the API
        with self._placement:  # the claims and the waiting jobs as one look: no decision noted in between
            pools = with_claims(snapshot, self.claims.others(None, as_of))
            waiting = [Waiting(key, held.claim, held.regions, now - held.waiting_since)
                       for key, held in self.claims.waiting()
                       if now - self._woken.get(key, -math.inf) >= WAKE_REPEAT_SECONDS]
        woken = movers(pools, waiting, min_wait_seconds=policy.unschedulable_timeout_seconds)
        for key in woken:
            self._woken[key] = now
        if len(self._woken) > WOKEN_MEMORY:
            for key in [k for k, at in self._woken.items() if now - at >= WAKE_REPEAT_SECONDS]:
                del self._woken[key]
        return woken

    def _status_unreadable(self, body: dict[str, Any], problem: str, now: datetime) -> None:
        """A status the operator cannot understand: say so on a condition and touch nothing else,
        no create, no delete (acting on a misread status could start a second run)."""
        message = (f"the operator cannot read this job's status ({problem}); it creates and deletes nothing "
                   "until the status is fixed or removed")
        salvaged = api.FineTuneJobStatus()
        for raw in ((body.get("status") or {}).get("conditions") or []) if isinstance(body.get("status"), dict) else []:
            try:
                salvaged.conditions.append(api.Condition.model_validate(raw))
            except ValidationError:
                continue
        previous = lifecycle.condition(salvaged, api.COND_BLOCKED)
        if previous is not None and previous.status == "True" and previous.message == message:
            return
        lifecycle.set_condition(salvaged, api.COND_BLOCKED, "True", "StatusUnreadable", message, now,
                                body["metadata"].get("generation"))
        self.cluster.patch_job_conditions(
            body, [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in salvaged.conditions])
        self.cluster.post_event(body, lifecycle.Event("Warning", "StatusUnreadable", message))
        log.warning("%s/%s: %s", body["metadata"].get("namespace"), body["metadata"].get("name"), message)

    def _read_model_config(self, job: api.FineTuneJob) -> tuple[dict[str, Any] | None, list[api.FieldProblem], str | None]:
        """The config.json a configMapRef architecture points at (reading is I/O; parsing it is the
        core's): (config, problems, what is still missing). A ConfigMap or key that does not exist
        yet is waited for, not an error: GitOps tools apply objects in any order."""
        ref = job.spec.model.architecture.config_map_ref
        if ref is None:
            return None, [], None
        path = "spec.model.architecture.configMapRef"
        namespace = job.metadata.namespace or "default"
        config_map = self.cluster.get_config_map(namespace, ref.name)
        if config_map is None:
            return None, [], f"ConfigMap {namespace}/{ref.name} ({path}) does not exist yet"
        text = (config_map.get("data") or {}).get(ref.key)
        if text is None:
            return None, [], f"ConfigMap {namespace}/{ref.name} ({path}) has no key {ref.key!r} yet"
        try:
            config = json.loads(text)
        except ValueError as error:
            return None, [api.FieldProblem(path=path, message=f"{ref.name}/{ref.key} is not JSON: {error}")], None
        return config, [], None

    def _apply(self, body: dict[str, Any], *, job: api.FineTuneJob | None, decision: lifecycle.Decision,
               policy: ClusterPolicy, current: Child | None = None) -> None:
        """Status first (it names the attempt and its plan), then deletes, creates and the
        suspend switch, then events: a kill between any two leaves a state the next reconcile
        reads correctly (see children.py). The attempt's ConfigMap is posted alongside the status
        write (`alongside`): the training job, whose pods mount it, still goes only after both."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        uid = body["metadata"].get("uid")
        written = status_json(decision.status)
        early, later = _early_creates(decision)
        posted: list[Pending] = []
        if written == body.get("status") and not (decision.create or decision.delete or decision.set_suspend is not None):
            # Nothing changed and nothing to do (a job waiting in line, looked at again): a PUT would be
            # a no-op the API server still has to serve, a thousand times per resync at scale. Any
            # create or delete still goes after a write: its resourceVersion guard proves the read current.
            stored = body
        else:
            posted = [self.alongside(functools.partial(self.cluster.create_new, namespace, obj)) for obj in early]
            try:
                stored = self.cluster.replace_job_status(body, written)
            except BaseException as error:
                self._take_back(namespace, early, posted, uid)
                if isinstance(error, ApiException) and error.status in (404, 409) and self.bodies is not None:
                    # The body was stale (409) or the job is gone (404): read it from the API next time.
                    self.bodies.must_read((namespace, name))
                raise
            self.own_writes.note((namespace, name), stored)
            if self.bodies is not None:
                self.bodies.seen((namespace, name), stored)
        for ref in decision.delete:
            self.cluster.delete(ref.namespace or namespace, ref, uid)
        creating: dict[str, Any] = {"kind": "?", "metadata": {"name": "?"}}
        try:
            for obj, result in zip(early, posted):
                creating = obj
                if result.result() is None:  # the name is taken: ours from an earlier try, or someone else's
                    self.cluster.create(namespace, obj, uid)
            for obj in later:
                creating = obj
                # A profile pod names the operator's namespace; everything else is in the job's.
                self.cluster.create(obj["metadata"].get("namespace") or namespace, obj, uid)
        except ForeignObject as clash:
            assert job is not None
            decision = self._after_refused_create(stored, job, decision, policy, clash.kind, clash.name, str(clash), foreign=True)
        except ApiException as error:
            if error.status is None or not 400 <= error.status < 500 or error.status in (409, 429):
                raise  # transient (or a conflict): the work queue retries
            assert job is not None
            decision = self._after_refused_create(stored, job, decision, policy, creating["kind"],
                                                  creating["metadata"]["name"], _api_message(error), foreign=False)
        if decision.set_suspend is not None and decision.status.current_attempt is not None:
            kind = current.kind if current is not None and current.attempt == decision.status.current_attempt \
                else DEFAULT_BACKEND.kind
            self.cluster.set_suspend(namespace, attempt_name(name, decision.status.current_attempt), decision.set_suspend,
                                     kind)
        for event in decision.events:
            if self.events is not None:
                self.events.record(body, event)
            else:
                self.cluster.post_event(body, event)
            log.info("%s/%s %s: %s", namespace, name, event.reason, event.message)

    def _take_back(self, namespace: str, early: list[dict[str, Any]], posted: list[Pending], uid: str | None) -> None:
        """The status write failed, so the decision did not happen: the ConfigMaps meant to go
        alongside it are not posted, or deleted when this call created them (a name already taken
        is left as it was). Best effort: what stays is ours, named for the attempt and brought up
        to date by the create that uses it."""
        for obj, result in zip(early, posted):
            if result.cancel():
                continue
            try:
                if result.result() is not None:
                    self.cluster.delete(namespace, lifecycle.ObjectRef("v1", obj["kind"], obj["metadata"]["name"]), uid)
            except Exception as error:  # noqa: BLE001 - the status write's error is the one to raise
                log.info("%s/%s: %s left after a failed status write: %r", namespace, obj["metadata"]["name"],
                         obj["kind"], error)

    def _after_refused_create(self, stored: dict[str, Any], job: api.FineTuneJob, decision: lifecycle.Decision,
                              policy: ClusterPolicy, kind: str, name: str, message: str, *, foreign: bool) -> lifecycle.Decision:
        """Write why the attempt's objects could not be created; the events of the first write still go out."""
        now = self.clock()
        if foreign:
            observed = lifecycle.Observed(job=job, now=now, policy=policy)
            refused = lifecycle.blocked(lifecycle.Decision(status=decision.status.model_copy(deep=True)), observed,
                                        "NameConflict", message)
        else:
            refused = lifecycle.create_refused(job, decision.status, policy, now, kind, name, message)
        rewritten = self.cluster.replace_job_status(stored, status_json(refused.status))
        self.own_writes.note((job.metadata.namespace or "", job.metadata.name), rewritten)
        if self.bodies is not None:
            self.bodies.seen((job.metadata.namespace or "", job.metadata.name), rewritten)
        refused.events = decision.events + refused.events
        return refused


class ForeignObject(Exception):
    """An object the operator needs to create exists and is not controlled by the FineTuneJob."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind} {name} exists and is not controlled by this FineTuneJob "
                         "(delete or rename it; the operator never adopts or deletes it)")
        self.kind, self.name = kind, name


def _alive_pods_of(pods: list[dict[str, Any]], attempt: int) -> bool:
    """Whether a pod of the attempt looks neither finished nor going."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(ATTEMPT_LABEL) != str(attempt) or meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            return True
    return False


def _ours(kind: str, obj: dict[str, Any], owner_uid: str | None) -> bool:
    """Whether the job with `owner_uid` owns `obj`: its controller ownerReference, or for the one pod
    the operator creates, the profile pod (in the operator's namespace, where no ownerReference can
    reach the job), its uid label."""
    return is_profile_pod_of(obj, owner_uid) if kind == "Pod" else controlled_by(obj, owner_uid)


def _early_creates(decision: lifecycle.Decision) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The creates that may go alongside the status write, and the rest. A ConfigMap may: it runs
    nothing, is named for the attempt and owned by the job, and a failed status write takes it back.
    The training job and a profile pod may not: they start work, so only a decision whose status
    landed may create them, after the ConfigMaps their pods mount. A ConfigMap this decision also
    deletes (an earlier attempt's) waits for the delete."""
    deleted = {(ref.kind, ref.name) for ref in decision.delete}
    early: list[dict[str, Any]] = []
    later: list[dict[str, Any]] = []
    for obj in decision.create:
        alongside = obj["kind"] == "ConfigMap" and (obj["kind"], obj["metadata"]["name"]) not in deleted
        (early if alongside else later).append(obj)
    return early, later


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body or "{}").get("message") or str(error.reason)
    except (ValueError, AttributeError):
        return str(error.reason)


def _without_status(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != "status"}

