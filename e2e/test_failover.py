"""Failover of the operator on the lab (issue 17 item 4): replicas elect one leader through the
coordination Lease of the release namespace (operator/finetune_operator/shell/leadership.py), only the
leader reconciles, and when it dies (SIGKILL, no cleanup) the standby takes over and acts within
the lease duration plus two retry periods and a second (TAKEOVER_LIMIT_S), without ever giving a FineTuneJob a second live PyTorchJob. A single replica killed and
restarted with its identity (a container restart keeps the pod's name) leads again at once, not
after the Lease expires.

Both scenarios run the operator as the chart's ServiceAccount (e2e/operator_harness.py), so the
chart's lease RBAC is exercised too. No other operator may run against the lab meanwhile: the
fixture fails early when the Lease is held by a replica that is not this module's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from finetune_operator.shell.leadership import LEASE_DURATION_SECONDS, RETRY_PERIOD_SECONDS, deposed_within

from e2e import operator_harness as h
from e2e.chaos import FreezingProxy
from e2e.lab.cluster import audit_events
from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e

LEASE = "finetune-operator"  # the chart's default leaderElection.leaseName, the operator's default --lease
# A standby sees the last renew up to a retry period late and tries every retry period.
TAKEOVER_LIMIT_S = LEASE_DURATION_SECONDS + 2 * RETRY_PERIOD_SECONDS + 1.0
RESTART_LIMIT_S = 2.0
EXAMPLE = "llama-8b-lora.yaml"


# ---- helpers -------------------------------------------------------------------------------------


_CLIENTS: dict[int, client.CoordinationV1Api] = {}


def _lease(lab) -> client.V1Lease | None:
    api = _CLIENTS.get(id(lab)) or _CLIENTS.setdefault(id(lab), client.CoordinationV1Api(lab.api_client()))
    try:
        return api.read_namespaced_lease(LEASE, h.RELEASE_NAMESPACE)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _holder(lab) -> str | None:
    lease = _lease(lab)
    return lease.spec.holder_identity if lease is not None and lease.spec is not None else None


def _lease_is_free_of_strangers(lab, ours: set[str]) -> None:
    """Fail early when a replica that is not this module's holds the Lease and renews it (another
    operator on the lab would reconcile the same jobs and make the timings meaningless)."""
    lease = _lease(lab)
    if lease is None or lease.spec.holder_identity in ours or not lease.spec.holder_identity:
        return
    first = lease.spec.renew_time
    time.sleep(lease.spec.lease_duration_seconds or 3)
    again = _lease(lab)
    if again is not None and again.spec.renew_time != first and again.spec.holder_identity not in ours:
        pytest.fail(f"another operator ({again.spec.holder_identity}) leads the lab's Lease "
                    f"{h.RELEASE_NAMESPACE}/{LEASE}: run the failover scenarios on their own, or before "
                    "e2e/test_operator.py (whose operator lives for the whole session)", pytrace=False)


def _job(namespace: str, name: str, run: str) -> dict[str, Any]:
    job = h.job_from_example(EXAMPLE, name, namespace, rule={"true-peak-factor": "1.0", "run-duration": run})
    job["spec"]["recovery"] = {"maxAttempts": 2, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    return job


def _apply(lab, job: dict[str, Any]) -> None:
    lab.kubectl("apply", "-f", "-", input=json.dumps(job))


def _reconciles(operator: h.OperatorProcess) -> float:
    """How many reconciles the replica ran (its finetune_reconcile_seconds histogram's count)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in operator.metrics().splitlines()
               if line.startswith("finetune_reconcile_seconds_count"))


def _reconciled(operator: h.OperatorProcess, namespace: str, name: str) -> bool:
    """The operator's log shows it acted on the job (it logs each Event it posts: "ns/name Reason: ...")."""
    return f"{namespace}/{name} Planned:" in operator.logs()


class ChildWatch:
    """Watches the namespace's PyTorchJobs from before the scenario to its end and records, for every
    FineTuneJob, the most PyTorchJobs it ever had alive at once (created, not yet being deleted)."""

    def __init__(self, lab, namespace: str) -> None:
        self.api = client.CustomObjectsApi(lab.api_client())
        self.namespace = namespace
        self.live: dict[str, set[str]] = defaultdict(set)
        self.most: dict[str, int] = defaultdict(int)
        self.errors: list[str] = []
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ChildWatch":
        self._thread.start()
        assert self._ready.wait(10), "the PyTorchJob watch did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)
        assert not self.errors, f"the PyTorchJob watch broke, so it may have missed a child: {self.errors}"

    def _run(self) -> None:
        listed = self.api.list_namespaced_custom_object("kubeflow.org", "v1", self.namespace, "pytorchjobs")
        for item in listed["items"]:
            self._see("ADDED", item)
        version = listed["metadata"]["resourceVersion"]
        self._ready.set()
        # Short watches (the server ends each after a second), resumed where the last one stopped,
        # so that stopping never has to cut a stream.
        while not self._stopping.is_set():
            try:
                for event in watch.Watch().stream(self.api.list_namespaced_custom_object, "kubeflow.org", "v1",
                                                  self.namespace, "pytorchjobs", resource_version=version,
                                                  timeout_seconds=1):
                    if event["type"] == "ERROR":
                        raise RuntimeError(event["object"])
                    self._see(event["type"], event["object"])
                    version = event["object"]["metadata"]["resourceVersion"]
            except Exception as error:  # noqa: BLE001 - reported by __exit__
                self.errors.append(repr(error))
                return

    def _see(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        owner = (meta.get("labels") or {}).get("finetune.dev/job", "?")
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            self.live[owner].discard(meta["name"])
        else:
            self.live[owner].add(meta["name"])
        self.most[owner] = max(self.most[owner], len(self.live[owner]))


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart(lab, ftj_crd):
    h.install_chart(lab)


@pytest.fixture
def replicas(lab, chart, tmp_path):
    started: list[h.OperatorProcess] = []

    def start(count: int, servers: dict[int, str] | None = None) -> list[h.OperatorProcess]:
        """`count` replicas; `servers`: replica index -> the API server's address it uses (a proxy)."""
        made = []
        for i in range(count):
            (tmp_path / f"replica-{i}").mkdir()
            made.append(h.OperatorProcess(lab, tmp_path / f"replica-{i}", server=(servers or {}).get(i)))
        _lease_is_free_of_strangers(lab, {o.identity for o in made})
        for operator in made:
            started.append(operator)
            operator.start()
        return made

    yield start
    for operator in started:
        operator.stop()
        print(f"operator log ({operator.identity}): {operator.log_path}")


# ---- scenarios -----------------------------------------------------------------------------------


def test_standby_takes_over_within_seconds_of_the_leaders_death(lab, replicas, namespace):
    a, b = replicas(2)
    by_identity = {a.identity: a, b.identity: b}
    holder = wait_for(lambda: _holder(lab) if _holder(lab) in by_identity else None, 30,
                      "one of the two replicas to hold the Lease")
    leader, standby = by_identity[holder], (b if holder == a.identity else a)
    h.volumes(lab, namespace, h.claims_of(_job(namespace, "x", "1s")))

    with ChildWatch(lab, namespace) as children:
        # A job that runs through the failover.
        _apply(lab, _job(namespace, "through", "120s"))
        h.wait_phase(lab, namespace, "through", ("Running",), timeout=60)
        (before,) = h.pytorch_jobs(lab, namespace, "through")
        # Only the leader reconciles; the standby watches and waits.
        assert _reconciled(leader, namespace, "through")
        assert not _reconciled(standby, namespace, "through"), standby.logs()[-3000:]
        assert _reconciles(leader) > 0 and _reconciles(standby) == 0, (_reconciles(leader), _reconciles(standby))
        assert f"{standby.identity} leads" not in standby.logs()

        killed = time.monotonic()
        leader.kill()
        _apply(lab, _job(namespace, "after-kill", "120s"))
        wait_for(lambda: _holder(lab) == standby.identity, TAKEOVER_LIMIT_S, "the standby to take the Lease",
                 interval=0.05)
        took_over = time.monotonic() - killed
        wait_for(lambda: h.pytorch_jobs(lab, namespace, "after-kill"), TAKEOVER_LIMIT_S,
                 "the PyTorchJob of the job applied after the kill", interval=0.05)
        acted = time.monotonic() - killed
        print(f"failover: Lease taken by the standby {took_over:.2f} s after SIGKILL of the leader; "
              f"PyTorchJob of a job applied right after the kill {acted:.2f} s after it")
        assert acted < TAKEOVER_LIMIT_S, f"the standby acted {acted:.2f} s after the leader's death"
        assert f"{standby.identity} leads" in standby.logs()

        # The new leader adopts the running attempt: the same PyTorchJob, no second one.
        h.wait_phase(lab, namespace, "after-kill", ("Launching", "Running"), timeout=30)
        time.sleep(1.5)  # let the new leader go over the job that was running
        assert [p["metadata"]["name"] for p in h.pytorch_jobs(lab, namespace, "through")] == [before["metadata"]["name"]]
        assert h.get_job(lab, namespace, "through")["status"]["phase"] == "Running"
    assert children.most["through"] == 1 and children.most["after-kill"] == 1, dict(children.most)
    assert all(count <= 1 for count in children.most.values()), dict(children.most)


def test_a_restarted_replica_leads_again_at_once(lab, replicas, namespace):
    """SIGKILL and restart with the same identity (as a container restart keeps the pod's name): the
    Lease names it still, so it leads on its first try instead of waiting the Lease out (a replica
    with another identity would wait a whole lease duration after it first sees the Lease)."""
    (operator,) = replicas(1)
    wait_for(lambda: _holder(lab) == operator.identity, 30, "the replica to hold the Lease")
    acquired = _lease(lab).spec.acquire_time
    h.volumes(lab, namespace, h.claims_of(_job(namespace, "x", "1s")))
    _apply(lab, _job(namespace, "first", "60s"))
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "first"), 30, "the first job's PyTorchJob")

    operator.kill()
    operator.start()  # returns once /healthz answers
    up = time.monotonic()
    _apply(lab, _job(namespace, "after-restart", "60s"))
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "after-restart"), 15,
             "the PyTorchJob of the job applied after the restart", interval=0.05)
    acted = time.monotonic() - up
    print(f"restart: PyTorchJob of a job applied when the restarted replica was up {acted:.2f} s later")
    lease = _lease(lab)
    assert lease.spec.holder_identity == operator.identity
    # It renewed its own Lease: the same acquisition, no transition to another holder.
    assert lease.spec.acquire_time == acquired, (acquired, lease.spec.acquire_time)
    assert acted < RESTART_LIMIT_S, f"the restarted replica acted {acted:.2f} s after it was up"
    assert len(h.pytorch_jobs(lab, namespace, "first")) == 1


def _leading(operator: h.OperatorProcess) -> bool:
    """What the replica's own finetune_leading gauge says (read from its metrics port, not the API)."""
    return any(line.startswith("finetune_leading ") and float(line.split()[1]) == 1.0
               for line in operator.metrics().splitlines())


def _writes(lab, operator: h.OperatorProcess) -> list[dict[str, Any]]:
    """The API server's record (its audit log) of every write the replica's requests made."""
    agent = f"({operator.identity})"
    return [e for e in audit_events(lab) if agent in (e.get("userAgent") or "")]


def _progress_patch(event: dict[str, Any]) -> bool:
    """A status.progress patch (progress_poller.patch_progress): a JSON patch that tests the attempt first."""
    body = event.get("requestObject")
    return (event["objectRef"].get("resource") == "finetunejobs" and event["verb"] == "patch"
            and isinstance(body, list) and bool(body) and body[0].get("path") == "/status/currentAttempt")


def _received(event: dict[str, Any]) -> float:
    """When the API server received the request (Unix time; the lab runs on this machine's clock)."""
    from datetime import datetime

    return datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()


def test_a_leader_behind_a_frozen_connection_steps_down_and_no_two_replicas_write(lab, replicas, namespace):
    """Chaos at the connection (issue 26 item 7): a TCP proxy between the leader and the real API server
    stops forwarding without closing anything (a stuck load balancer, a lost route). The leader's
    requests get no answer: it stops leading within deposed_within() of its last renew, before the
    standby may take the Lease; the standby takes over within the lease and acts on a job applied
    meanwhile. When the proxy forwards again, the bytes it held reach the API server late: every
    write among them that would change what the new leader owns is refused by its guard
    (resourceVersion, uid, a deterministic name), and the old leader writes nothing after that.
    No FineTuneJob ever has two live children; both jobs end."""
    proxy = FreezingProxy(("127.0.0.1", lab.ports["apiserver"]))
    try:
        a, b = replicas(2, servers={0: f"https://127.0.0.1:{proxy.port}"})
        by_identity = {a.identity: a, b.identity: b}
        wait_for(lambda: _holder(lab) in by_identity, 30, "one of the two replicas to hold the Lease")
        if _holder(lab) != a.identity:  # the replica behind the proxy must lead: make the other give way
            b.stop()
            wait_for(lambda: _holder(lab) == a.identity, TAKEOVER_LIMIT_S, "the proxied replica to hold the Lease")
            b.start()
        h.volumes(lab, namespace, h.claims_of(_job(namespace, "x", "1s")))
        with ChildWatch(lab, namespace) as children:
            _apply(lab, _job(namespace, "before-freeze", "40s"))
            wait_for(lambda: h.pytorch_jobs(lab, namespace, "before-freeze"), 30, "the leader's PyTorchJob")
            assert _leading(a) and not _leading(b)

            last_renew = _lease(lab).spec.renew_time.timestamp()
            proxy.freeze()
            frozen = time.time()
            _apply(lab, _job(namespace, "while-frozen", "20s"))
            # Watch both at once: when the old leader stopped (its own gauge) and when the standby took
            # the Lease (the Lease's acquireTime): two leaders at once is the failure.
            stepped_down = took_over = None
            deadline = time.monotonic() + TAKEOVER_LIMIT_S + 30
            while (stepped_down is None or took_over is None) and time.monotonic() < deadline:
                if stepped_down is None and not _leading(a):
                    stepped_down = time.time()
                lease = _lease(lab)
                if took_over is None and lease.spec.holder_identity == b.identity:
                    took_over = lease.spec.acquire_time.timestamp()
                time.sleep(0.1)
            assert stepped_down is not None, "the leader cut off from the API server never stopped leading"
            assert took_over is not None, "the standby never took the Lease"
            wait_for(lambda: h.pytorch_jobs(lab, namespace, "while-frozen"), TAKEOVER_LIMIT_S,
                     "the new leader's PyTorchJob of the job applied while the old one was cut off", interval=0.1)
            acted = time.time()
            print(f"frozen connection: the leader stepped down {stepped_down - last_renew:.1f} s after its last renew "
                  f"(bound {deposed_within():.1f} s), the standby took the Lease {took_over - last_renew:.1f} s after it "
                  f"and created the new job's PyTorchJob {acted - frozen:.1f} s after the freeze")
            # One leader at a time: the old one stops before the standby may take the Lease (the lease
            # duration after the last renew it saw), and within the bound the timings promise.
            assert deposed_within() < LEASE_DURATION_SECONDS
            assert stepped_down - last_renew <= deposed_within() + 1.0, stepped_down - last_renew
            assert stepped_down <= took_over, (stepped_down - last_renew, took_over - last_renew)
            assert took_over - last_renew <= TAKEOVER_LIMIT_S, took_over - last_renew
            assert acted - frozen <= TAKEOVER_LIMIT_S + 2, acted - frozen

            time.sleep(2)
            proxy.thaw()
            thawed = time.time()
            for job in ("before-freeze", "while-frozen"):
                h.wait_phase(lab, namespace, job, ("Succeeded",), timeout=120)
            # The old replica, its connection back, follows: the standby keeps the Lease.
            assert _holder(lab) == b.identity and not _leading(a) and _leading(b)
        late = [e for e in _writes(lab, a) if _received(e) >= took_over]
        print("writes of the old leader the API server got after the takeover: "
              + (", ".join(f"{e['verb']} {e['objectRef'].get('resource')}/{e['objectRef'].get('subresource', '')} "
                           f"{e['objectRef'].get('name', '')} -> {e['responseStatus']['code']}" for e in late) or "none"))
        # The held bytes reach the server at once when the proxy forwards again; no claim is sent after
        # (Events the old leader queued before it stepped down may still go out: they claim nothing).
        assert all(_received(e) < thawed + 3 for e in late if e["objectRef"].get("resource") != "events"), late
        # What they would have changed of the new leader's is refused: the Lease and the status
        # (resourceVersion), the children (deterministic names, uid preconditions). A progress patch
        # tests the attempt it reports on first, and an Event claims nothing.
        harmful = [e for e in late if e["responseStatus"]["code"] < 300
                   and e["objectRef"].get("resource") != "events" and not _progress_patch(e)]
        assert harmful == [], harmful
    finally:
        proxy.close()
    assert all(count <= 1 for count in children.most.values()), dict(children.most)
