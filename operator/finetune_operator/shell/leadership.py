"""One active replica: leader election through a coordination.k8s.io Lease.

Every replica watches (cheap, and a standby is then warm); only the holder of the Lease
reconciles. The Lease is the one Kubernetes controllers use, through the client library's
`leaderelection` (optimistic updates of the Lease's holder and renew time):

- the leader renews every `retry_period` seconds; when it cannot renew for `renew_deadline`
  seconds it stops reconciling at once and becomes a candidate again. Its Lease requests are
  bounded (apiclient.LEASE_TIMEOUT, no retries), so it has stopped `deposed_within()` seconds after
  its last renew, before any standby may take over (a request that got no answer is a failed try,
  like an API error);
- a standby takes over `lease_duration` seconds after the last renew it saw, so a leader
  that dies is replaced within about `lease_duration + retry_period` seconds;
- the identity is the pod's name: a replica restarted in the same pod (a crash, an OOM kill)
  finds the Lease held by itself and leads again at once, without waiting for it to expire.

Correctness does not rest on the Lease alone: every write of a reconcile is guarded (status
by resourceVersion, creates by deterministic names, deletes by uid), and the children are the
truth of what runs, so two replicas overlapping for a moment cannot start a second run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

import urllib3
from kubernetes import client
from kubernetes.leaderelection import electionconfig, leaderelection
from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

from .apiclient import LEASE_TIMEOUT

log = logging.getLogger("finetune_operator.leadership")
# The library logs every renew attempt at info level; its failures are reported here instead.
logging.getLogger("leaderelection").setLevel(logging.WARNING)

# client-go's defaults (15/10/2 s), which a loaded, GIL-bound process holds: a leader is deposed
# only after 10 s without a renew, where the earlier 2/1.5/1 s deposed one that stalled for 1.5 s
# (a burst of reconciles holding the GIL, a slow API server). The price is the failover after a
# crash: a standby takes the Lease 15 to 17 s after the leader's last renew (a leader that stops,
# SIGTERM, hands the Lease back and the standby takes it on its next try, within 2 s).
LEASE_DURATION_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10
RETRY_PERIOD_SECONDS = 2


def deposed_within(lease_duration: float = LEASE_DURATION_SECONDS, renew_deadline: float = RENEW_DEADLINE_SECONDS,
                   retry_period: float = RETRY_PERIOD_SECONDS, request_bound: float = LEASE_TIMEOUT.worst_case) -> float:
    """Seconds after its last successful renew by which a leader that can no longer renew has stopped
    reconciling: it sleeps a retry period, tries for the renew deadline, and its last try (a get and
    an update, each bounded by the Lease client's timeout, no retries) may start just before the
    deadline. It must be under the lease duration, after which a standby may take over."""
    return retry_period + renew_deadline + 2 * request_bound


def default_identity() -> str:
    """The pod's name (stable across container restarts), else the host name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


@dataclass
class LeaseSettings:
    namespace: str
    name: str = "finetune-operator"
    identity: str = ""
    lease_duration: float = LEASE_DURATION_SECONDS
    renew_deadline: float = RENEW_DEADLINE_SECONDS
    retry_period: float = RETRY_PERIOD_SECONDS


# What a Lease request that got no answer raises (a timeout, a refused or reset connection).
UNANSWERED = (urllib3.exceptions.HTTPError, OSError)


@dataclass(frozen=True)
class NoAnswer:
    """What `get` returns for a read that got no answer, in the shape the library reads an API error
    in (`body`, `reason`): it tries again next period."""

    reason: str
    body: None = None


class BoundedLeaseLock(LeaseLock):
    """The client library's LeaseLock, where a request that got no answer is a failed try, as an API
    error is: the renew loop tries again until its deadline, instead of the leader stepping down (and
    every job being looked at again when it leads again) on the first slow request."""

    def get(self, name, namespace):  # noqa: ANN001, ANN201 - the library's signature
        return self._answered("read", lambda error: (False, NoAnswer(repr(error))), super().get, name, namespace)

    def create(self, name, namespace, election_record):  # noqa: ANN001, ANN201
        return self._answered("create", lambda error: False, super().create, name, namespace, election_record)

    def update(self, name, namespace, updated_record):  # noqa: ANN001, ANN201
        return self._answered("renew", lambda error: False, super().update, name, namespace, updated_record)

    def _answered(self, what: str, failed: Callable[[BaseException], Any], call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except UNANSWERED as error:
            log.info("lease %s/%s: no answer to a %s: %r", self.namespace, self.name, what, error)
            return failed(error)


class Leadership:
    """Runs the election in a thread; calls `on_started` when this replica leads and
    `on_stopped` as soon as it must stop (then it is a candidate again)."""

    def __init__(self, api_client: client.ApiClient, settings: LeaseSettings,
                 on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        self.settings = settings
        self.identity = settings.identity or default_identity()
        self._api_client = api_client
        self._on_started = on_started
        self._on_stopped = on_stopped
        self._stop = threading.Event()
        self.leading = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def dead(self) -> bool:
        """The election thread ended while electing: this replica would never lead, or never notice
        it lost the Lease (the liveness probe fails on it)."""
        return self._thread.ident is not None and not self._stop.is_set() and not self._thread.is_alive()

    def stop(self) -> None:
        """Stop electing; a leader hands the Lease back at once (a rolling update or a drain
        then waits for no expiry: the standby takes it on its next try)."""
        self._stop.set()
        if self.leading.is_set():
            self.leading.clear()
            self._release()

    def _release(self) -> None:
        api_ = client.CoordinationV1Api(self._api_client)
        try:
            lease = api_.read_namespaced_lease(self.settings.name, self.settings.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            api_.replace_namespaced_lease(self.settings.name, self.settings.namespace, lease)
            log.info("%s handed the lease %s/%s back", self.identity, self.settings.namespace, self.settings.name)
        except Exception as error:  # best effort: the Lease expires anyway
            log.warning("could not hand the lease back: %s", error)

    def _lock(self) -> LeaseLock:
        lock = BoundedLeaseLock(self.settings.name, self.settings.namespace, self.identity)
        # The library builds its client from the default configuration; use ours (kubeconfig,
        # ServiceAccount) so the Lease is written with the operator's own identity.
        lock.api_instance = client.CoordinationV1Api(self._api_client)
        return lock

    def _run(self) -> None:
        while not self._stop.is_set():
            config = electionconfig.Config(
                self._lock(),
                lease_duration=self.settings.lease_duration,
                renew_deadline=self.settings.renew_deadline,
                retry_period=self.settings.retry_period,
                onstarted_leading=self._started,
                onstopped_leading=self._stopped,
            )
            try:
                leaderelection.LeaderElection(config).run()
            except Exception as error:  # the API may be away; stay a candidate
                log.warning("leader election: %s; trying again", error)
                if self.leading.is_set():
                    self._stopped()
            self._stop.wait(self.settings.retry_period)

    def _started(self) -> None:
        log.info("%s leads (lease %s/%s)", self.identity, self.settings.namespace, self.settings.name)
        self.leading.set()
        self._on_started()

    def _stopped(self) -> None:
        if not self.leading.is_set():
            return
        self.leading.clear()
        log.warning("%s lost the lease %s/%s: reconciling stops until it leads again",
                    self.identity, self.settings.namespace, self.settings.name)
        self._on_stopped()
