"""The operator's informers: every watch it has, each an `informer.Informer` on the one bounded client.

Cluster-wide: nodes and the pods that hold GPUs (free GPUs), and each training-job CRD by name (a CRD
installed, changed or removed makes the operator look up the served kinds again). Cluster-wide or
per watched namespace: the FineTuneJobs, and the pods and training jobs that carry the job label.
`ClusterCache` holds them; `cluster.Cluster` reads the pods, training jobs, nodes and GPU pods from it,
`handlers.py` turns the changes of FineTuneJobs and CRDs into work.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any, Callable

from .. import api
from .informer import Informer, Obj, key_of, slim
from ..planning.discovery import _pod_gpu_request as pod_gpu_request
from ..rendering.backend import backend_named
from ..rendering.labels import JOB_LABEL
from ..rendering.renderer import JOB_NAME_ANNOTATION

# Pods that hold GPUs are those bound to a node and not finished (as discovery counts them).
ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


def node_facts(node: Obj) -> Obj:
    """What discovery reads of a Node (planning/discovery.py): labels, taints, cordon, readiness,
    allocatable. Node objects carry images and much else: kept whole, a thousand nodes would cost
    the operator tens of MiB."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "labels", "resourceVersion") if k in meta},
        "spec": {k: spec[k] for k in ("unschedulable", "taints") if k in spec},
        "status": {"allocatable": status.get("allocatable") or {},
                   "conditions": [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]},
    }


def gpu_pod_facts(pod: Obj) -> Obj | None:
    """What discovery reads of a pod that holds GPUs on a node; None for any other pod (not kept)."""
    spec = pod.get("spec") or {}
    if not spec.get("nodeName"):
        return None

    if pod_gpu_request(pod) <= 0:
        return None
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    meta = pod.get("metadata") or {}

    def resources_only(items: list[Obj]) -> list[Obj]:
        return [{"resources": c.get("resources") or {}} for c in items]

    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "resourceVersion") if k in meta},
        "spec": {"nodeName": spec["nodeName"], "containers": resources_only(containers),
                 "initContainers": resources_only(inits)},
        "status": {"phase": (pod.get("status") or {}).get("phase")},
    }


def job_of(obj: Obj) -> str | None:
    """The FineTuneJob a pod or training job belongs to (its name; the label may be shortened)."""
    meta = obj.get("metadata") or {}
    return (meta.get("annotations") or {}).get(JOB_NAME_ANNOTATION) or (meta.get("labels") or {}).get(JOB_LABEL)


def crd_facts(crd: Obj) -> Obj:
    """What a change of a training-job CRD is about: its name, generation, the versions it serves and
    whether it is Established (a CRD carries its whole schema, hundreds of KiB for TrainJob's: not kept)."""
    meta, spec, status = crd.get("metadata") or {}, crd.get("spec") or {}, crd.get("status") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "generation") if k in meta},
        "spec": {"versions": [{"name": v.get("name"), "served": v.get("served")} for v in spec.get("versions") or []]},
        "status": {"conditions": [c for c in status.get("conditions") or [] if c.get("type") == "Established"]},
    }


def job_bucket(obj: Obj) -> tuple[str, str] | None:
    """Index of pods and training jobs: (namespace, the job label's value), as the reconciler asks."""
    meta = obj.get("metadata") or {}
    label = (meta.get("labels") or {}).get(JOB_LABEL)
    return (meta.get("namespace") or "", label) if label is not None else None


class ClusterCache:
    """The informers of the operator's shell (cluster.Cluster reads them once they have listed).

    Cluster-wide: nodes and pods that hold GPUs (for free GPUs). Cluster-wide or per watched
    namespace: the pods and training jobs that carry the job label (label-selected by the API
    server). `on_job(namespace, name)` is called for every change of a job's pod or training job
    (after the store holds it); `on_pod(pod, deleted)` first, for every change of a job's pod;
    `on_capacity()` for every change of a node or of a pod that holds GPUs. The FineTuneJobs
    (`watch_jobs`) and the training-job CRDs (`watch_crds`) join once there is work to feed.
    """

    def __init__(self, core: Any, custom: Any, *, extensions: Any = None, namespaces: list[str] | None = None,
                 on_job: Callable[[str, str], None] | None = None,
                 on_pod: Callable[[Obj, bool], None] | None = None,
                 on_capacity: Callable[[], None] | None = None) -> None:
        self.core, self.custom, self.extensions = core, custom, extensions  # extensions: ApiextensionsV1Api
        self.namespaces = namespaces  # None: cluster-wide
        self.on_job, self.on_pod, self.on_capacity = on_job, on_pod, on_capacity
        self.nodes = Informer("nodes", core.list_node, project=node_facts, on_change=self._capacity_changed)
        # GPUs held by pods count against free capacity. A namespaced install may read pods only in
        # its watched namespaces (its RBAC says so): there it counts those, and other tenants'
        # pods stay unseen (the scheduler still decides; the plan's "free now" may be optimistic).
        if namespaces is None:
            self.gpu_pods = {None: Informer("gpu-pods", core.list_pod_for_all_namespaces,
                                            selectors={"field_selector": ACTIVE_PODS}, project=gpu_pod_facts,
                                            on_change=self._capacity_changed)}
        else:
            self.gpu_pods = {ns: Informer(f"gpu-pods[{ns}]", partial(core.list_namespaced_pod, ns),
                                          selectors={"field_selector": ACTIVE_PODS}, project=gpu_pod_facts,
                                          on_change=self._capacity_changed)
                             for ns in namespaces}
        self.pods = self._scoped("pods", lambda ns: partial(core.list_namespaced_pod, ns),
                                 core.list_pod_for_all_namespaces, self._pod_changed)
        self.children: dict[str, dict[str | None, Informer]] = {}
        self.jobs: dict[str | None, Informer] = {}
        self.crds: list[Informer] = []
        self._lock = threading.Lock()

    def _scoped(self, name: str, namespaced: Callable[[str], Callable[..., Any]], clusterwide: Callable[..., Any],
                on_change: Callable[[str, Obj], None], project: Callable[[Obj], Obj | None] = slim, *,
                labelled: bool = True) -> dict[str | None, Informer]:
        """One informer cluster-wide, or one per watched namespace; `labelled`: only the objects that carry
        the job label (the API server selects them), indexed by job."""
        selectors, index = ({"label_selector": JOB_LABEL}, job_bucket) if labelled else ({}, None)
        if self.namespaces is None:
            return {None: Informer(name, clusterwide, selectors=selectors, index=index, on_change=on_change,
                                   project=project)}
        return {ns: Informer(f"{name}[{ns}]", namespaced(ns), selectors=selectors, index=index,
                             on_change=on_change, project=project) for ns in self.namespaces}

    def start(self) -> "ClusterCache":
        for informer in (self.nodes, *self.gpu_pods.values(), *self.pods.values()):
            informer.start()
        return self

    def stop(self) -> None:
        for informer in self.all():
            informer.stop()

    def dead(self) -> list[str]:
        """The informers whose thread died (the liveness probe fails on them)."""
        return [informer.name for informer in self.all() if informer.dead()]

    def all(self) -> list[Informer]:
        with self._lock:
            children = [i for scoped in self.children.values() for i in scoped.values()]
            later = [*self.jobs.values(), *self.crds]
        return [self.nodes, *self.gpu_pods.values(), *self.pods.values(), *children, *later]

    def watch_jobs(self, on_change: Callable[[str, Obj], None], *, start: bool = True) -> None:
        """Inform on the FineTuneJobs: `on_change(type, job)` for each one listed and every change after
        (the store holds it first, without managedFields). Called once the work queue can take work."""
        with self._lock:
            if self.jobs:
                return
            self.jobs = self._scoped(
                api.PLURAL,
                lambda ns: partial(self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION, ns, api.PLURAL),
                partial(self.custom.list_cluster_custom_object, api.GROUP, api.VERSION, api.PLURAL),
                on_change, labelled=False)
            informers = list(self.jobs.values())
        if start:
            for informer in informers:
                informer.start()

    def job_keys(self) -> list[tuple[str, str]]:
        """(namespace, name) of every FineTuneJob the informers hold."""
        with self._lock:
            informers = list(self.jobs.values())
        return [key_of(job) for informer in informers for job in informer.items()]

    def watch_crds(self, names: list[str], on_change: Callable[[str, Obj], None], *, start: bool = True) -> None:
        """Inform on each of the named CustomResourceDefinitions, through a field selector on its name:
        the API server then authorizes the list and the watch against the RBAC rule's resourceNames, so
        the operator may watch these CRDs and no other. `on_change(type, crd)` for each change."""
        with self._lock:
            if self.crds:
                return
            self.crds = [Informer(f"crd[{name}]", self.extensions.list_custom_resource_definition,
                                  selectors={"field_selector": f"metadata.name={name}"}, project=crd_facts,
                                  on_change=on_change) for name in names]
            informers = list(self.crds)
        if start:
            for informer in informers:
                informer.start()

    def watch_children(self, backend: Any, *, start: bool = True) -> None:
        """Inform on a training-job kind (one the operator may list and watch)."""
        with self._lock:
            if backend.name in self.children:
                return
            scoped = self._scoped(
                backend.plural,
                lambda ns: partial(self.custom.list_namespaced_custom_object, backend.group, backend.version, ns,
                                   backend.plural),
                partial(self.custom.list_cluster_custom_object, backend.group, backend.version, backend.plural),
                self._child_changed, project=backend.summary)
            self.children[backend.name] = scoped
        if start:
            for informer in scoped.values():
                informer.start()

    # -- reading (None: not informed, or not listed yet: ask the API) ----------------
    def _scope(self, scoped: dict[str | None, Informer], namespace: str) -> Informer | None:
        informer = _pick(scoped, namespace)
        return informer if informer is not None and informer.synced.is_set() else None

    def job_pods(self, namespace: str, label: str) -> list[Obj] | None:
        informer = self._scope(self.pods, namespace)
        return None if informer is None else informer.indexed((namespace, label))

    def job_children(self, backend: Any, namespace: str, label: str) -> list[Obj] | None:
        with self._lock:
            scoped = self.children.get(backend.name)
        informer = None if scoped is None else self._scope(scoped, namespace)
        return None if informer is None else informer.indexed((namespace, label))

    def discovery_inputs(self) -> tuple[tuple[int, ...], list[Obj], list[Obj]] | None:
        """(versions, nodes, GPU pods) once both have listed: the versions change with every change."""
        gpu_pods = list(self.gpu_pods.values())
        if not (self.nodes.synced.is_set() and all(i.synced.is_set() for i in gpu_pods)):
            return None
        versions = (self.nodes.version, *(i.version for i in gpu_pods))
        return versions, self.nodes.items(), [pod for i in gpu_pods for pod in i.items()]

    def holds_gpu_pod(self, namespace: str, name: str) -> bool | None:
        """Whether discovery's store counts the pod (bound to a node and not finished); None: the GPU
        pods are not informed (yet)."""
        informer = _pick(self.gpu_pods, namespace)
        if informer is None or not informer.synced.is_set():
            return None
        return informer.get(namespace, name) is not None

    # -- the operator's own writes -------------------------------------------------
    def _informer_of(self, kind: str, namespace: str) -> Informer | None:
        if kind == "Pod":
            scoped: dict[str | None, Informer] | None = self.pods
        else:
            with self._lock:
                scoped = next((s for name, s in self.children.items() if _kind_of(name) == kind), None)
        return None if scoped is None else _pick(scoped, namespace)

    def note_written(self, kind: str, obj: Obj) -> None:
        informer = self._informer_of(kind, key_of(obj)[0])
        if informer is not None and (obj.get("metadata") or {}).get("labels", {}).get(JOB_LABEL) is not None:
            informer.note_written(obj)

    def note_deleted(self, kind: str, namespace: str, name: str) -> None:
        informer = self._informer_of(kind, namespace)
        if informer is not None:
            informer.note_deleted(namespace, name)

    # -- changes -------------------------------------------------------------------
    def _capacity_changed(self, kind: str, obj: Obj) -> None:
        """A node or a pod holding GPUs changed (GPUs may have freed up)."""
        if self.on_capacity is not None:
            self.on_capacity()

    def _pod_changed(self, kind: str, pod: Obj) -> None:
        if self.on_pod is not None:
            self.on_pod(pod, kind == "DELETED")
        self._job_changed(pod)

    def _child_changed(self, kind: str, child: Obj) -> None:
        self._job_changed(child)

    def _job_changed(self, obj: Obj) -> None:
        job = job_of(obj)
        namespace = (obj.get("metadata") or {}).get("namespace")
        if self.on_job is not None and job and namespace:
            self.on_job(namespace, job)


def _pick(scoped: dict[str | None, Informer], namespace: str) -> Informer | None:
    """The cluster-wide informer, or the one of `namespace` (not `or`: an empty informer is falsy)."""
    return scoped[None] if None in scoped else scoped.get(namespace)


def _kind_of(backend_name: str) -> str | None:
    backend = backend_named(backend_name)
    return None if backend is None else backend.kind
