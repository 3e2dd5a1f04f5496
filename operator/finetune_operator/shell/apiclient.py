"""The one place where the operator's Kubernetes API clients are made and every request's bound is
set: every request bounded, TCP keepalive on every socket. The operator has one HTTP stack (the
Kubernetes client, urllib3) and no other: its watches are informers (informer.py) on this client.

The client library waits forever by default: a request on a half-open connection (a proxy or load
balancer that stopped forwarding, a node that lost its route, an API server that froze) never
returns, so the reconcile worker holding it, and the job's key with it, stays busy for good, and a
leader renewing its Lease never notices it lost it. Here every request that does not name its own
`_request_timeout` gets DEFAULT_TIMEOUT; the Lease's requests get LEASE_TIMEOUT and no retries, short
enough that a leader steps down before a standby may take over (leadership.py states the sum); a
watch gets `watch_timeout` and a pod log read LOG_READ_TIMEOUT, both from here. Keepalive probes (the
client library's, with client-go's timings) find a dead peer on an idle pooled connection or a watch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.rest import tcp_keepalive_socket_options


@dataclass(frozen=True)
class Timeouts:
    """Seconds a request may take to connect, and to wait for each read of its answer."""

    connect: float
    read: float

    @property
    def worst_case(self) -> float:
        """The longest one attempt of a request can block."""
        return self.connect + self.read

    def as_request_timeout(self) -> tuple[float, float]:
        return (self.connect, self.read)


# A reconcile's reads and writes, the policy poll, events, the profile shell: an API server that has
# not answered for 30 s is not going to; the work queue retries the key.
DEFAULT_TIMEOUT = Timeouts(connect=5, read=30)
# The Lease (leadership.py): a renew on a healthy, even loaded, API server takes milliseconds.
LEASE_TIMEOUT = Timeouts(connect=0.5, read=0.5)
# The rank-0 pod's log tail (progress_poller.py): the kubelet answers through the API server.
LOG_READ_TIMEOUT = Timeouts(connect=DEFAULT_TIMEOUT.connect, read=10)
# A watch (informer.py): the API server ends it after WATCH_SECONDS (the informer watches again from
# its resourceVersion) and sends bookmarks meanwhile; a read that waits WATCH_GRACE_SECONDS past that
# is a connection that went silent.
WATCH_SECONDS = 240
WATCH_GRACE_SECONDS = 30


def watch_timeout(server_seconds: float = WATCH_SECONDS) -> Timeouts:
    """The bound of a watch the API server ends after `server_seconds`."""
    return Timeouts(connect=DEFAULT_TIMEOUT.connect, read=server_seconds + WATCH_GRACE_SECONDS)


class BoundedApiClient(client.ApiClient):
    """An ApiClient whose requests without a `_request_timeout` of their own get `default_timeout`.
    Every generated API class (CoreV1Api, CustomObjectsApi, CoordinationV1Api, ...) calls `call_api`."""

    def __init__(self, configuration: client.Configuration, default_timeout: Timeouts = DEFAULT_TIMEOUT) -> None:
        super().__init__(configuration)
        self.default_timeout = default_timeout

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None, post_params: Any = None,
                 _request_timeout: Any = None) -> Any:
        if _request_timeout is None:
            _request_timeout = self.default_timeout.as_request_timeout()
        return super().call_api(method, url, header_params, body, post_params, _request_timeout=_request_timeout)


def bounded_client(configuration: client.Configuration, timeout: Timeouts = DEFAULT_TIMEOUT,
                   retries: bool = True, identity: str | None = None) -> BoundedApiClient:
    """An API client for `configuration` (a copy: the caller's is left as it was) with `timeout` on
    every request and TCP keepalive; `retries=False` makes one attempt per request (the Lease: its
    bound is the sum of the attempts). `identity` (the replica's name in the leader election) goes into
    every request's User-Agent, so the API server's audit log says which replica wrote what."""
    cfg = copy.deepcopy(configuration)
    cfg.socket_options = tcp_keepalive_socket_options()
    if not retries:
        cfg.retries = urllib3.Retry(total=0, connect=0, read=0, redirect=0, status=0, other=0)
    api_client = BoundedApiClient(cfg, timeout)
    api_client.user_agent = user_agent(identity)
    return api_client


def user_agent(identity: str | None = None) -> str:
    """`finetune-operator/<version>`, and the replica's identity in parentheses when it has one."""
    from .. import __version__

    return f"finetune-operator/{__version__}" + (f" ({identity})" if identity else "")


def client_configuration(kubeconfig: str | None) -> client.Configuration:
    """Who the operator (or the CLI) talks to the API server as: the given kubeconfig; else the pod's
    ServiceAccount; else ~/.kube/config (or $KUBECONFIG)."""
    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        return cfg
    try:
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        cfg = client.Configuration()
        config.load_kube_config(client_configuration=cfg)
    return cfg
