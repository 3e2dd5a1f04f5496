"""The operator's startup and shutdown, and the handlers that turn watch events into queued reconciles.

Every change of a FineTuneJob, of a job's pods or training jobs (the informers of `informers.py`,
which also keep what the reconciler reads in memory) puts the job's key on the work queue
(`workqueue.WorkQueue`); the queue runs `Reconciler.reconcile`, which reads the world, calls the
pure lifecycle and writes the result. No handler writes the object and none needs a finalizer:
children go by ownerReference. A change of a training-job CRD makes the operator look up the served
kinds again. `runner.py` runs the process: `start`, then `shutdown` on SIGTERM.

Replicas elect one leader through a coordination Lease (`leadership.py`): every replica
watches and queues, only the leader's work queue reconciles. A standby takes over a few
seconds after the leader dies; a replica restarted in the same pod leads again at once.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes import client

from . import metrics
from .apiclient import LEASE_TIMEOUT, bounded_client, client_configuration
from .calibration_store import CalibrationStore
from .profiling import ProfileShell
from .cluster import Cluster
from .reconciler import PolicyHolder, Reconciler
from .job_bodies import JobBodies
from .events import EventRecorder
from .workqueue import WorkQueue
from .leadership import LEASE_DURATION_SECONDS, Leadership, LeaseSettings, default_identity
from ..planning.policy import ClusterPolicy, PolicyError, load_policy
from .progress_poller import (DEFAULT_INTERVAL_SECONDS, PollerSettings, ProgressOnlyChanges, ProgressPoller,
                              patch_progress, read_pod_log)
from ..rendering.backend import BACKENDS

log = logging.getLogger("finetune_operator")

POLICY_KEY = "policy.yaml"
POLICY_POLL_SECONDS = 10.0


@dataclass
class Options:
    """What `finetune-operator run` was told (set before `start`)."""

    policy_configmap: str | None = None
    policy_namespace: str = "default"
    policy_file: str | None = None  # for running outside a cluster
    metrics_port: int | None = 9090
    workers: int = 64
    lease: str | None = "finetune-operator"  # the Lease of the leader election; None: act alone, no election
    identity: str | None = None  # this replica's name in the election (default: $POD_NAME, else the host name)
    clusterwide: bool = True
    namespaces: tuple[str, ...] = ()  # the watched namespaces when not clusterwide
    kubeconfig: str | None = None
    progress_interval: float = DEFAULT_INTERVAL_SECONDS  # seconds between reads of a job's log; 0: off


@dataclass
class Runtime:
    options: Options = field(default_factory=Options)
    queue: WorkQueue | None = None
    reconciler: Reconciler | None = None
    policy: PolicyHolder = field(default_factory=lambda: PolicyHolder(ClusterPolicy()))
    stop: threading.Event = field(default_factory=threading.Event)
    leadership: Leadership | None = None
    progress: ProgressPoller | None = None
    progress_only: ProgressOnlyChanges = field(default_factory=ProgressOnlyChanges)
    # Set by the node and GPU-pod informers: GPUs may have freed up (see _wake_waiting).
    capacity_changed: threading.Event = field(default_factory=threading.Event)


RUNTIME = Runtime()


def kube_api_client(options: Options) -> client.ApiClient:
    """An API client from the kubeconfig (lab, laptop) or the pod's ServiceAccount, with two
    connections for every reconcile worker (its own, and the ConfigMap it posts alongside a status
    write), one per informer's watch, which holds it, and one per background thread (the client's
    default, 5 per CPU, made the workers beyond it open and close a TLS connection per request).
    Every request is bounded (apiclient.py)."""
    cfg = _client_configuration(options)
    wanted = 2 * options.workers + watch_connections(options) + EXTRA_CONNECTIONS
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, wanted)
    return bounded_client(cfg, identity=replica_identity(options))


def watch_connections(options: Options) -> int:
    """The informers' watches (informers.py): nodes and each training CRD once; GPU pods, the jobs'
    pods, the FineTuneJobs and each training-job kind cluster-wide or once per watched namespace."""
    scopes = 1 if options.clusterwide else len(options.namespaces)
    return 1 + len(BACKENDS) + scopes * (3 + len(BACKENDS))


def lease_api_client(options: Options) -> client.ApiClient:
    """The leader election's own client: its requests bounded by LEASE_TIMEOUT, one attempt each, on
    connections of their own (a reconcile burst never makes a renew wait for a pooled connection)."""
    return bounded_client(_client_configuration(options), LEASE_TIMEOUT, retries=False,
                          identity=replica_identity(options))


def replica_identity(options: Options) -> str:
    """This replica's name: in the leader election, and in every request's User-Agent."""
    return options.identity or default_identity()


# Connections beyond the workers and the watches: the progress poller, the wake-ups, the policy poll, events.
EXTRA_CONNECTIONS = 8


def _client_configuration(options: Options) -> client.Configuration:
    return client_configuration(options.kubeconfig)


def _read_policy(cluster: Cluster, options: Options) -> ClusterPolicy:
    if options.policy_file:
        with open(options.policy_file, encoding="utf-8") as handle:
            return load_policy(handle.read())
    if options.policy_configmap:
        text = cluster.read_config_map_key(options.policy_namespace, options.policy_configmap, POLICY_KEY)
        if text is None:
            raise PolicyError(
                f"policy ConfigMap {options.policy_namespace}/{options.policy_configmap} has no {POLICY_KEY!r}")
        return load_policy(text)
    log.warning("no policy given: no region is allowed, so no job can be placed")
    return ClusterPolicy()


def start() -> None:
    """Start the operator: read the policy, inform, and start the reconcile workers, the election and
    the background loops. The FineTuneJobs and the training-job CRDs are informed last, once the work
    queue can take what their first list brings."""
    options = RUNTIME.options
    cluster = Cluster(kube_api_client(options))
    RUNTIME.policy.set(_read_policy(cluster, options))
    # Nodes, GPU pods, our pods and training jobs are informed (informers.py): reads come from memory
    # and every change queues its job. Every replica informs, so a standby takes over with a warm cache.
    cluster.start_cache(None if options.clusterwide else list(options.namespaces), on_job=_enqueue,
                        on_capacity=RUNTIME.capacity_changed.set)
    watch_training_jobs(cluster, options)
    if options.progress_interval > 0:
        RUNTIME.progress = ProgressPoller(read_pod_log(cluster.core), patch_progress(cluster.custom),
                                          PollerSettings(interval=options.progress_interval),
                                          trainer_status=cluster.trainer_status)
        RUNTIME.progress.start()
    RUNTIME.reconciler = Reconciler(cluster=cluster, policy=RUNTIME.policy, progress=RUNTIME.progress,
                                    bodies=JobBodies(), events=EventRecorder(cluster.post_event).start(),
                                    profiles=ProfileShell(cluster, options.policy_namespace),
                                    calibration=CalibrationStore(cluster, options.policy_namespace),
                                    alongside=ThreadPoolExecutor(options.workers, "alongside").submit)
    RUNTIME.queue = WorkQueue(lambda key: RUNTIME.reconciler.reconcile(*key), workers=options.workers)
    metrics.LEADING.set(0 if options.lease else 1)
    if options.lease:
        RUNTIME.queue.set_active(False)  # until this replica leads
        RUNTIME.leadership = Leadership(
            lease_api_client(options), LeaseSettings(namespace=options.policy_namespace, name=options.lease,
                                              identity=replica_identity(options)),
            on_started=_lead, on_stopped=_follow)
        RUNTIME.leadership.start()
    RUNTIME.queue.start()
    assert cluster.cache is not None
    cluster.cache.watch_crds([backend.resource for backend in BACKENDS], training_crd_changed)
    cluster.cache.watch_jobs(job_changed)
    threading.Thread(target=_wake_waiting, args=(RUNTIME.stop,), name="wake-waiting", daemon=True).start()
    threading.Thread(target=_sweep_profiles, args=(RUNTIME.stop,), name="profile-sweep", daemon=True).start()
    if options.policy_configmap:
        threading.Thread(target=_poll_policy, args=(cluster, options, RUNTIME.stop), name="policy", daemon=True).start()
    if options.metrics_port:
        metrics.serve(options.metrics_port)
    log.info("started: %d allowed regions, %d catalog pools", len(RUNTIME.policy.get().allowed_regions), len(RUNTIME.policy.get().catalog))


def known_jobs() -> list[tuple[str, str]]:
    """Every FineTuneJob the informers hold (all of them once they have listed)."""
    reconciler = RUNTIME.reconciler
    cache = reconciler.cluster.cache if reconciler is not None else None
    return cache.job_keys() if cache is not None else []


def _lead() -> None:
    """This replica leads: reconcile everything it has seen, now."""
    if RUNTIME.queue is None:
        return
    RUNTIME.queue.set_active(True)
    metrics.LEADING.set(1)
    # Every known job once, behind whatever happens now: a job applied while the leader was away
    # (queued urgent by its event) gets its child first, not after hundreds of look-agains.
    for key in known_jobs():
        RUNTIME.queue.add(key, urgent=False)


def _follow() -> None:
    """Another replica may lead soon: stop handing out work and let running reconciles end."""
    if RUNTIME.queue is None:
        return
    RUNTIME.queue.set_active(False)
    metrics.LEADING.set(0)
    if RUNTIME.progress is not None:
        RUNTIME.progress.clear()  # the next leader writes progress
    if not RUNTIME.queue.wait_idle(timeout=LEASE_DURATION_SECONDS):
        log.warning("a reconcile still runs after losing the lease; its writes stay guarded by resourceVersion and uid")


def dead_threads() -> list[str]:
    """The threads the operator cannot work without that have died: a reconcile worker, an informer,
    the leader election. The liveness probe (/healthz, runner.py) fails while any is named, and the
    kubelet restarts the container."""
    dead: list[str] = []
    if RUNTIME.queue is not None:
        dead += RUNTIME.queue.dead()
    if RUNTIME.reconciler is not None and RUNTIME.reconciler.cluster.cache is not None:
        dead += RUNTIME.reconciler.cluster.cache.dead()
    if RUNTIME.leadership is not None and RUNTIME.leadership.dead():
        dead.append("leader-election")
    return dead


def shutdown() -> None:
    """Stop (SIGTERM): the informers, then the running reconciles, the last Events, the Lease, the rest."""
    RUNTIME.stop.set()
    if RUNTIME.reconciler is not None and RUNTIME.reconciler.cluster.cache is not None:
        RUNTIME.reconciler.cluster.cache.stop()
    if RUNTIME.queue is not None:
        # Let running reconciles end before the Lease goes to a standby.
        RUNTIME.queue.set_active(False)
        RUNTIME.queue.wait_idle(timeout=10)
    if RUNTIME.reconciler is not None and RUNTIME.reconciler.events is not None:
        RUNTIME.reconciler.events.stop()  # what the last reconciles said goes out before the Lease does
    if RUNTIME.leadership is not None:
        RUNTIME.leadership.stop()
    if RUNTIME.queue is not None:
        RUNTIME.queue.stop()
    if RUNTIME.progress is not None:
        RUNTIME.progress.stop()


def _enqueue(namespace: str | None, name: str | None, *, first: bool = False) -> None:
    if namespace and name and RUNTIME.queue is not None:
        RUNTIME.queue.add((namespace, name), first=first)


def job_changed(kind: str, body: dict[str, Any]) -> None:
    """A FineTuneJob was listed, added, changed or deleted (its informer, informers.py)."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace") or "", meta.get("name") or ""
    key = (namespace, name)
    if RUNTIME.reconciler is not None and RUNTIME.reconciler.bodies is not None:
        RUNTIME.reconciler.bodies.seen(key, None if kind == "DELETED" else body)
    if kind == "DELETED":
        RUNTIME.progress_only.forget(key)
        metrics.track_phase(namespace, name, None)
        return
    status = body.get("status") or {}
    metrics.track_phase(namespace, name, status.get("phase") or "Pending", status=status)
    # A progress write (progress_poller.py) changes only status.progress, and our own status write
    # shows what its reconcile left: nothing to reconcile.
    only_progress = RUNTIME.progress_only.only_progress(key, body)
    if only_progress or (RUNTIME.reconciler is not None and RUNTIME.reconciler.own_writes.is_own(key, body)):
        return
    # A job with no status was never looked at: its first look (the plan) goes ahead of the rest.
    _enqueue(namespace, name, first=not status)


# The training-job kinds this ServiceAccount may list and watch (watch_training_jobs).
_INFORMABLE: list[Any] = []


def watch_training_jobs(cluster: Cluster, options: Options) -> list[str]:
    """Inform on the training-job kinds the operator may list and watch (the chart grants each backend's
    RBAC only when the policy can use it): a watch it is forbidden would retry and log forever. A kind
    whose CRD is not served (yet) is informed once training_crd_changed sees it installed: an informer
    on it would only log 404s. The served kinds themselves are looked up by API discovery."""
    watched = []
    _INFORMABLE.clear()
    assert cluster.cache is not None
    for backend in BACKENDS:
        namespaces = [None] if options.clusterwide else list(options.namespaces)
        if namespaces and all(cluster.may(verb, backend.group, backend.plural, ns)
                              for ns in namespaces for verb in ("list", "watch")):
            _INFORMABLE.append(backend)
            if backend in cluster.served_backends():
                cluster.cache.watch_children(backend)
            watched.append(backend.resource)
        else:
            log.info("not watching %s: this ServiceAccount may not list and watch them", backend.resource)
    return watched


def training_crd_changed(kind: str, crd: dict[str, Any]) -> None:
    """A training-job CRD was listed, installed, changed or removed (its informer): look up the served
    kinds again, inform on those now served, and look at every job (one waiting with NoTrainingBackend
    starts now)."""
    if RUNTIME.reconciler is None:
        return
    cluster = RUNTIME.reconciler.cluster
    cluster.forget_served_backends()
    log.info("CRD %s %s: looking up the training backends again", (crd.get("metadata") or {}).get("name"),
             kind.lower())
    if cluster.cache is not None:
        served = cluster.served_backends()
        for backend in _INFORMABLE:
            if backend in served:
                cluster.cache.watch_children(backend)  # no-op when already informed
    if RUNTIME.queue is not None:
        for key in known_jobs():
            RUNTIME.queue.add(key, urgent=False)


def apply_policy_text(text: str | None) -> None:
    """Use a new policy if it is valid and different; jobs waiting for a fit are looked at again."""
    if text is None:
        return
    try:
        policy = load_policy(text)
    except (PolicyError, yaml.YAMLError, ValueError) as error:
        log.error("the new policy is invalid, keeping the last one: %s", error)
        return
    if policy == RUNTIME.policy.get():
        return
    RUNTIME.policy.set(policy)
    log.info("policy reloaded: regions %s, %d catalog pools", policy.allowed_regions, len(policy.catalog))
    if RUNTIME.queue is not None:
        for key in known_jobs():
            RUNTIME.queue.add(key, urgent=False)


# A burst of node and pod changes (a wave of pods ending) is looked at once, this long after the first.
WAKE_DEBOUNCE_SECONDS = 0.2
# Looked at this often anyway: a waiting attempt passes the policy's bound without any change.
WAKE_INTERVAL_SECONDS = 5.0


def _wake_waiting(stop: threading.Event) -> None:
    """Wake the jobs whose attempts wait for a node when another pool in their regions has room
    (Reconciler.waiting_to_wake): GPUs freed in one region must not idle while another region's
    line waits for its next resync. Only the leader looks; the reconcile decides the move."""
    while not stop.is_set():
        RUNTIME.capacity_changed.wait(WAKE_INTERVAL_SECONDS)
        if stop.wait(WAKE_DEBOUNCE_SECONDS):
            return
        RUNTIME.capacity_changed.clear()
        queue, reconciler = RUNTIME.queue, RUNTIME.reconciler
        if queue is None or reconciler is None or not queue.active:
            continue
        try:
            for key in reconciler.waiting_to_wake():
                queue.add(key)
        except Exception as error:  # memory only, but never let the thread die
            log.warning("could not look for waiting jobs to move: %r", error)


# The leader looks this often for profile pods whose job is gone (no garbage collector removes them).
PROFILE_SWEEP_SECONDS = 60.0


def _sweep_profiles(stop: threading.Event) -> None:
    """Delete the profile pods of deleted jobs (profiling.ProfileShell.sweep); only the leader."""
    while not stop.wait(PROFILE_SWEEP_SECONDS):
        queue, reconciler = RUNTIME.queue, RUNTIME.reconciler
        if queue is None or reconciler is None or reconciler.profiles is None or not queue.active:
            continue
        try:
            reconciler.profiles.sweep()
        except Exception as error:  # the API may be briefly away; the next sweep tries again
            log.warning("could not sweep profile pods: %r", error)


def _poll_policy(cluster: Cluster, options: Options, stop: threading.Event) -> None:
    """Read the policy ConfigMap every few seconds, whatever namespaces are watched: one GET by name,
    so the operator needs no list or watch of ConfigMaps anywhere (a reload within POLICY_POLL_SECONDS
    is soon enough for a policy; a watch would need both verbs, if only on this one name)."""
    while not stop.wait(POLICY_POLL_SECONDS):
        try:
            apply_policy_text(cluster.read_config_map_key(options.policy_namespace, options.policy_configmap, POLICY_KEY))
        except Exception as error:  # the API may be briefly away; the next poll tries again
            log.warning("could not read the policy ConfigMap: %s", error)
