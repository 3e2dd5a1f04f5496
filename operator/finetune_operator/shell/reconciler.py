"""One reconcile of one FineTuneJob: read the world (through `Cluster`), call `lifecycle.step`,
write the result. `WorkQueue` serialises reconciles per job and schedules the "look again in N
seconds" that the lifecycle asks for; the informers (through `handlers.py`) feed the queue from
watch events, so a pod that dies wakes its job at once.

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

from kubernetes.client.rest import ApiException

from pydantic import ValidationError

from .. import api, lifecycle, progress
from . import metrics
from .claim_book import ClaimBook, Held, still_fits
from .cluster import ChildrenUnreadable, Cluster, ForeignObject
from .job_bodies import JobBodies, OwnWrites
from .job_status import read_status, status_json
from .progress_poller import ProgressPoller
from ..children import Child
from ..planning.capacity import Waiting, movers, with_claims
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..rendering.backend import DEFAULT_BACKEND, Preflight, may_choose
from ..rendering.names import attempt_name
from ..rendering.labels import ATTEMPT_LABEL

# Named as when this code was shell/controller.py: log lines (and filters on them) keep their logger name.
log = logging.getLogger("finetune_operator.controller")

# A waiting job woken because another pool has room is not woken again for this long (it may stay).
WAKE_REPEAT_SECONDS = 10.0
WOKEN_MEMORY = 4096
# A job whose training jobs the operator may not list (ChildrenUnreadable): when to look again.
CHILDREN_UNREADABLE_RETRY_SECONDS = 30.0


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
    # The jobs as their informer last showed them (handlers.job_changed feeds it); None: a GET per reconcile.
    bodies: JobBodies | None = None
    # The resourceVersions of our own status writes (handlers.job_changed skips their watch events).
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
        try:
            children = self.cluster.list_children(namespace, name, uid, backends)
        except ChildrenUnreadable as forbidden:
            # Not a retry in the work queue (it would loop on the 403 for good): a condition that says
            # what the operator lacks, and a look again later.
            self._blocked(body, "ChildrenUnreadable", str(forbidden), now)
            return CHILDREN_UNREADABLE_RETRY_SECONDS
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
        self._blocked(body, "StatusUnreadable", f"the operator cannot read this job's status ({problem}); it creates "
                      "and deletes nothing until the status is fixed or removed", now)

    def _blocked(self, body: dict[str, Any], reason: str, message: str, now: datetime) -> None:
        """Blocked=True with `reason` and `message` on the conditions as stored (only they are patched:
        the rest of the status may be what the operator cannot read), an event once per message."""
        salvaged = api.FineTuneJobStatus()
        for raw in ((body.get("status") or {}).get("conditions") or []) if isinstance(body.get("status"), dict) else []:
            try:
                salvaged.conditions.append(api.Condition.model_validate(raw))
            except ValidationError:
                continue
        previous = lifecycle.condition(salvaged, api.COND_BLOCKED)
        if previous is not None and previous.status == "True" and previous.message == message:
            return
        lifecycle.set_condition(salvaged, api.COND_BLOCKED, "True", reason, message, now,
                                body["metadata"].get("generation"))
        self.cluster.patch_job_conditions(
            body, [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in salvaged.conditions])
        self.cluster.post_event(body, lifecycle.Event("Warning", reason, message))
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


def _alive_pods_of(pods: list[dict[str, Any]], attempt: int) -> bool:
    """Whether a pod of the attempt looks neither finished nor going."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(ATTEMPT_LABEL) != str(attempt) or meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            return True
    return False


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
