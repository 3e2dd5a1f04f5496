"""Bounded API calls (apiclient.py, leadership.py) and the liveness probe, against real sockets: a
server that accepts a connection and never answers (what a proxy that stopped forwarding, or a
half-open connection, looks like), and the operator's /healthz server (runner.py)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from kubernetes import client

from finetune_operator.shell import handlers
from finetune_operator.shell.apiclient import DEFAULT_TIMEOUT, LEASE_TIMEOUT, Timeouts, bounded_client
from finetune_operator.shell.leadership import (LEASE_DURATION_SECONDS, RENEW_DEADLINE_SECONDS, RETRY_PERIOD_SECONDS,
                                          BoundedLeaseLock, deposed_within)
from finetune_operator.shell.workqueue import WorkQueue

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "finetune_operator"


@contextmanager
def silent_server() -> Iterator[int]:
    """Accepts connections, reads nothing, answers nothing; closes them only when the test ends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        listener.close()


def _configuration(port: int) -> client.Configuration:
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    return cfg


def _call_returns_within(call, seconds: float) -> tuple[float, BaseException | None]:
    """Run `call` in a thread; (how long it took, what it raised). Fails if it is still blocked."""
    outcome: list[BaseException | None] = []
    start = time.monotonic()

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - what it raised is the result
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the request was still blocked after {seconds} s"
    return time.monotonic() - start, outcome[0]


def test_a_request_to_a_server_that_never_answers_is_bounded():
    with silent_server() as port:
        api = client.CoreV1Api(bounded_client(_configuration(port), Timeouts(connect=1, read=0.5), retries=False))
        took, error = _call_returns_within(lambda: api.read_namespaced_config_map("policy", "ns"), 10)
    assert error is not None and "timed out" in repr(error).lower(), repr(error)
    assert 0.4 < took < 3, took


def test_a_plain_client_would_block_forever():
    """What the bound is for: the library's own client waits with no end on the same server."""
    with silent_server() as port:
        api = client.CoreV1Api(client.ApiClient(_configuration(port)))

        def call() -> None:
            try:
                api.read_namespaced_config_map("policy", "ns")
            except Exception:  # noqa: BLE001 - once the server goes at the end of the test
                pass

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(3)
        assert thread.is_alive()


def test_a_request_that_names_its_own_timeout_keeps_it():
    """Watches and log reads set theirs (informers.py, progress_poller.py): the default does not replace it."""
    seen = []
    api_client = bounded_client(_configuration(1))
    api_client.rest_client.request = lambda *a, **kw: seen.append(kw["_request_timeout"]) or (_ for _ in ()).throw(
        RuntimeError("sent"))
    with pytest.raises(RuntimeError):
        client.CoreV1Api(api_client).list_node(_request_timeout=(10, 330))
    with pytest.raises(RuntimeError):
        client.CoreV1Api(api_client).list_node()
    assert seen == [(10, 330), (DEFAULT_TIMEOUT.connect, DEFAULT_TIMEOUT.read)]


def test_every_request_names_the_replica_in_its_user_agent(tmp_path, monkeypatch):
    """The API server's audit log says which replica wrote what (e2e/test_failover.py reads it): the
    reconcile client and the Lease client of `run` both send the replica's identity."""
    from finetune_operator import __version__
    from finetune_operator.shell.handlers import Options, kube_api_client, lease_api_client

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "http://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    agents = []
    for api_client in (kube_api_client(Options(kubeconfig=str(kubeconfig), identity="replica-a")),
                       lease_api_client(Options(kubeconfig=str(kubeconfig), identity="replica-a"))):
        api_client.rest_client.request = lambda *a, **kw: agents.append(kw["headers"]["User-Agent"]) or (
            _ for _ in ()).throw(RuntimeError("sent"))
        with pytest.raises(RuntimeError):
            client.CoreV1Api(api_client).list_node()
    assert agents == [f"finetune-operator/{__version__} (replica-a)"] * 2
    monkeypatch.setenv("POD_NAME", "ft-operator-7d9c-x2")  # no --identity: the pod's name, as the election's
    assert lease_api_client(Options(kubeconfig=str(kubeconfig))).user_agent.endswith("(ft-operator-7d9c-x2)")


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = json.dumps({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": "policy"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_sockets_keep_alive(monkeypatch):
    """TCP keepalive on the connection's socket itself: a peer that vanished is found on an idle socket."""
    import urllib3.connection

    made: list[tuple[int, int]] = []  # (SO_KEEPALIVE, TCP_KEEPIDLE) of each socket the client opened
    create = urllib3.connection.connection.create_connection

    def recording(*args, **kwargs):
        sock = create(*args, **kwargs)
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) if hasattr(socket, "TCP_KEEPIDLE") else 1
        made.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE), idle))
        return sock

    monkeypatch.setattr(urllib3.connection.connection, "create_connection", recording)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api_client = bounded_client(_configuration(server.server_address[1]))
        assert client.CoreV1Api(api_client).read_namespaced_config_map("policy", "ns").metadata.name == "policy"
        [(keepalive, idle)] = made
        assert keepalive == 1 and 0 < idle <= 60
    finally:
        server.shutdown()


def test_every_client_of_the_operator_is_made_in_one_place():
    """No ApiClient is made outside apiclient.py, so no request escapes the bound."""
    offenders = [str(path.relative_to(OPERATOR)) for path in OPERATOR.rglob("*.py") if path.name != "apiclient.py"
                 and re.search(r"\bApiClient\(", path.read_text())]
    assert offenders == []
    assert "bounded_client(" in (OPERATOR / "shell" / "handlers.py").read_text()


# --- the Lease -------------------------------------------------------------------------------------


def test_a_leader_that_cannot_renew_stops_before_a_standby_may_take_over():
    assert (LEASE_DURATION_SECONDS, RENEW_DEADLINE_SECONDS, RETRY_PERIOD_SECONDS) == (15, 10, 2)
    assert deposed_within() == RETRY_PERIOD_SECONDS + RENEW_DEADLINE_SECONDS + 2 * LEASE_TIMEOUT.worst_case
    assert deposed_within() < LEASE_DURATION_SECONDS
    # The library's floor: a renew deadline over 1.2 retry periods.
    assert RENEW_DEADLINE_SECONDS > 1.2 * RETRY_PERIOD_SECONDS


def test_a_lease_request_that_gets_no_answer_is_a_failed_try_within_its_bound():
    with silent_server() as port:
        lock = BoundedLeaseLock("finetune-operator", "ns", "me")
        lock.api_instance = client.CoordinationV1Api(bounded_client(_configuration(port), LEASE_TIMEOUT, retries=False))
        results = []
        took, error = _call_returns_within(lambda: results.append(lock.get("finetune-operator", "ns")), 10)
    assert error is None and results[0][0] is False
    assert took < LEASE_TIMEOUT.worst_case + 0.5, took


def test_an_election_whose_lease_reads_get_no_answer_keeps_trying():
    """Through the library's own loop: a try that got no answer is a failed try (no exception out of
    the election, which would make the replica step down and start over)."""
    from kubernetes.leaderelection import electionconfig, leaderelection

    with silent_server() as port:
        lock = BoundedLeaseLock("finetune-operator", "ns", "me")
        lock.api_instance = client.CoordinationV1Api(bounded_client(_configuration(port), LEASE_TIMEOUT, retries=False))
        config = electionconfig.Config(lock, lease_duration=15, renew_deadline=10, retry_period=1,
                                       onstarted_leading=lambda: None, onstopped_leading=lambda: None)
        election = leaderelection.LeaderElection(config)
        took, error = _call_returns_within(lambda: [election.try_acquire_or_renew() for _ in range(2)], 10)
    assert error is None, repr(error)
    assert took < 2 * LEASE_TIMEOUT.worst_case + 0.5, took


# --- the liveness probe ----------------------------------------------------------------------------


def _healthz_status() -> int:
    """The operator's /healthz server (runner.serve_health, as `finetune-operator run` serves it): the
    status it answers now."""
    from finetune_operator.shell.runner import serve_health

    server = serve_health(0, handlers.dead_threads, host="127.0.0.1")
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/healthz", timeout=10).status
    except urllib.error.HTTPError as error:
        return error.code
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the worker's SystemExit
def test_liveness_fails_when_a_reconcile_worker_dies(monkeypatch):
    def handle(key):
        raise SystemExit("a library called exit")  # not an Exception: the worker's guard lets it through

    queue = WorkQueue(handle, workers=2)
    monkeypatch.setattr(handlers.RUNTIME, "queue", queue)
    monkeypatch.setattr(handlers.RUNTIME, "reconciler", None)
    monkeypatch.setattr(handlers.RUNTIME, "leadership", None)
    queue.start()
    try:
        assert handlers.dead_threads() == [] and _healthz_status() == 200
        queue.add(("ns", "job"))
        deadline = time.monotonic() + 5
        while not queue.dead() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(handlers.dead_threads()) == 1
        assert _healthz_status() == 500
    finally:
        queue.stop()
    assert handlers.dead_threads() == []  # a queue stopped on purpose is not a dead one


# --- a deposed leader, through a proxy that stops forwarding ----------------------------------------


def test_a_leader_behind_a_frozen_connection_stops_within_its_bound_and_leads_again():
    """The chaos case at the Lease: a proxy between the replica and the API server stops forwarding
    without closing. The leader stops reconciling within deposed_within() of its last renew (here with
    an 8/4/1 s lease, to keep the test short; the same sum holds for 15/10/2), and leads again once the
    proxy forwards again."""
    from e2e.chaos import FreezingProxy, LeaseEndpoint, QuietServer
    from finetune_operator.shell.leadership import Leadership, LeaseSettings

    LeaseEndpoint.lease, LeaseEndpoint.written = {}, []
    server = QuietServer(("127.0.0.1", 0), LeaseEndpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = FreezingProxy(("127.0.0.1", server.server_address[1]))
    started, stopped = [], []
    settings = LeaseSettings(namespace="ns", name="lease", identity="me", lease_duration=8, renew_deadline=4,
                             retry_period=1)
    assert deposed_within(8, 4, 1) < 8
    leadership = Leadership(bounded_client(_configuration(proxy.port), LEASE_TIMEOUT, retries=False), settings,
                            on_started=lambda: started.append(time.monotonic()),
                            on_stopped=lambda: stopped.append(time.monotonic()))
    leadership.start()
    try:
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started, "never led"
        time.sleep(2.5)  # a few renews
        proxy.freeze()
        deadline = time.monotonic() + 20
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stopped, "a leader that could not renew for 20 s still leads"
        last_renew = max(t for t in LeaseEndpoint.written if t < stopped[0])
        assert stopped[0] - last_renew <= deposed_within(8, 4, 1) + 0.5, stopped[0] - last_renew
        print(f"frozen connection: stopped leading {stopped[0] - last_renew:.2f} s after the last renew "
              f"(bound {deposed_within(8, 4, 1):.1f} s, lease 8 s)")
        assert not leadership.leading.is_set() and not leadership.dead()
        proxy.thaw()
        deadline = time.monotonic() + 15
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) == 2, "did not lead again after the connection came back"
    finally:
        leadership.stop()
        proxy.close()
        server.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_liveness_sees_a_dead_informer_and_a_dead_election(monkeypatch):
    """An informer whose thread died (its store would never change again: nodes, pods, FineTuneJobs, a
    training CRD) and an election thread that ended (the replica would never lead, or never notice it
    lost the Lease) are named by the probe."""
    from finetune_operator.shell.informers import ClusterCache
    from finetune_operator.shell.leadership import Leadership, LeaseSettings

    def dies(**_):
        raise SystemExit("gone")  # past the informer's `except Exception`

    class Core:
        list_node = list_pod_for_all_namespaces = staticmethod(dies)

    class Custom:
        list_cluster_custom_object = staticmethod(lambda *args, **kwargs: dies())

    class Extensions:
        list_custom_resource_definition = staticmethod(dies)

    cache = ClusterCache(Core(), Custom(), extensions=Extensions()).start()
    cache.watch_crds(["pytorchjobs.kubeflow.org"], lambda kind, crd: None)
    cache.watch_jobs(lambda kind, job: None)
    monkeypatch.setattr("kubernetes.leaderelection.leaderelection.LeaderElection.run", lambda self: dies())
    leadership = Leadership(bounded_client(_configuration(1), LEASE_TIMEOUT, retries=False),
                            LeaseSettings(namespace="ns", identity="me"), on_started=lambda: None, on_stopped=lambda: None)
    leadership.start()

    class Reconciler:
        class cluster:  # noqa: N801 - the attribute the probe reads
            pass

    Reconciler.cluster.cache = cache
    monkeypatch.setattr(handlers.RUNTIME, "queue", None)
    monkeypatch.setattr(handlers.RUNTIME, "reconciler", Reconciler)
    monkeypatch.setattr(handlers.RUNTIME, "leadership", leadership)
    expected = sorted([informer.name for informer in cache.all()] + ["leader-election"])
    assert {"finetunejobs", "crd[pytorchjobs.kubeflow.org]"} <= set(expected)
    deadline = time.monotonic() + 5
    while len(handlers.dead_threads()) < len(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(handlers.dead_threads()) == expected
    assert _healthz_status() == 500
    cache.stop()
    leadership.stop()
    assert handlers.dead_threads() == []
