"""Informers (informers.py) on the strict fake API: list, then watch from the list's resourceVersion;
a compacted history is 410 Gone and a relist that reports what vanished; selectors, pages, and the
shell reading memory instead of the API."""

from __future__ import annotations

from typing import Any

import pytest

from finetune_operator.shell.cluster import Cluster
from finetune_operator.shell.informer import Informer
from finetune_operator.shell.informers import ACTIVE_PODS, ClusterCache, gpu_pod_facts, job_bucket
from finetune_operator.planning.policy import load_policy
from finetune_operator.rendering.backend import PYTORCH_JOB
from finetune_operator.rendering.labels import JOB_LABEL
from unittest import mock

from fake_kube import FakeKube
from reconcile_world import NAMESPACE, ReconcileWorld, job_document


def pod(name: str, *, job: str | None = "a", node: str | None = "gpu-1", gpus: int = 8, phase: str = "Running",
        namespace: str = "team-a") -> dict[str, Any]:
    labels = {JOB_LABEL: job} if job else {"app": "other"}
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def recorder() -> tuple[list[tuple[str, str]], Any]:
    seen: list[tuple[str, str]] = []
    return seen, lambda kind, obj: seen.append((kind, obj["metadata"]["name"]))


def test_list_then_watch_replays_every_change_in_order():
    kube = FakeKube()
    kube.put("Pod", pod("p1"))
    seen, on_change = recorder()
    informer = Informer("pods", kube.core.list_pod_for_all_namespaces, selectors={"label_selector": JOB_LABEL},
                        index=job_bucket, on_change=on_change)
    informer.step()  # list
    assert informer.synced.is_set() and [p["metadata"]["name"] for p in informer.indexed(("team-a", "a"))] == ["p1"]
    listed_at = informer.resource_version
    kube.put("Pod", pod("p2"))
    p1 = kube.get("Pod", "team-a", "p1")
    p1["status"]["phase"] = "Failed"
    kube.touch(p1)
    kube.remove("Pod", "team-a", "p2")
    informer.step()  # watch from the list's resourceVersion
    assert kube.watch_requests[-1]["resourceVersion"] == listed_at
    assert seen == [("ADDED", "p1"), ("ADDED", "p2"), ("MODIFIED", "p1"), ("DELETED", "p2")]
    assert informer.get("team-a", "p1")["status"]["phase"] == "Failed" and informer.get("team-a", "p2") is None
    # The watch ended with a bookmark: the next watch starts after everything seen.
    assert informer.resource_version == str(kube.resource_version)


def test_a_compacted_history_is_410_and_the_relist_reports_what_vanished():
    kube = FakeKube()
    for name in ("p1", "p2", "p3"):
        kube.put("Pod", pod(name))
    seen, on_change = recorder()
    informer = Informer("pods", kube.core.list_pod_for_all_namespaces, selectors={"label_selector": JOB_LABEL},
                        on_change=on_change)
    informer.step()
    kube.remove("Pod", "team-a", "p2")
    changed = kube.get("Pod", "team-a", "p3")
    changed["status"]["phase"] = "Succeeded"
    kube.touch(changed)
    kube.compact()  # the events above are gone from the history
    seen.clear()
    from finetune_operator.shell.informer import Gone

    with pytest.raises(Gone):
        informer.step()  # the watch answers ERROR 410
    assert informer.resource_version is None
    informer.step()  # lists again
    assert informer.relists == 2
    assert sorted(seen) == [("DELETED", "p2"), ("MODIFIED", "p3")]  # nothing dropped silently
    assert {p["metadata"]["name"] for p in informer.items()} == {"p1", "p3"}


def test_an_object_leaving_the_selector_is_deleted_from_the_store():
    kube = FakeKube()
    kube.put("Pod", pod("busy", job=None))
    kube.put("Pod", pod("cpu-only", job=None, gpus=0))
    kube.put("Pod", pod("pending", job=None, node=None))
    informer = Informer("gpu-pods", kube.core.list_pod_for_all_namespaces, selectors={"field_selector": ACTIVE_PODS},
                        project=gpu_pod_facts)
    informer.step()
    assert [p["metadata"]["name"] for p in informer.items()] == ["busy"]  # only pods holding GPUs on a node
    bound = kube.get("Pod", "team-a", "pending")
    bound["spec"]["nodeName"] = "gpu-2"
    kube.touch(bound)
    done = kube.get("Pod", "team-a", "busy")
    done["status"]["phase"] = "Succeeded"  # no longer matches status.phase!=Succeeded: a DELETED event
    kube.touch(done)
    informer.step()
    assert [p["metadata"]["name"] for p in informer.items()] == ["pending"]
    assert set(informer.items()[0]) == {"metadata", "spec", "status"}  # what discovery reads, not the whole pod


def test_lists_are_read_in_pages():
    kube = FakeKube()
    for i in range(7):
        kube.put("Node", {"metadata": {"name": f"n{i}", "namespace": ""}})
    informer = Informer("nodes", kube.core.list_node, page_size=3)
    informer.step()
    assert len(informer) == 7


def test_the_fake_refuses_to_serve_a_watch_after_a_change_without_a_resource_version():
    kube = FakeKube()
    kube.put("Pod", pod("p1"))
    informer = Informer("pods", kube.core.list_pod_for_all_namespaces)
    informer.step()
    kube.get("Pod", "team-a", "p1")["status"]["phase"] = "Failed"  # edited in place: no event would say so
    with pytest.raises(AssertionError, match="without a new resourceVersion"):
        informer.step()


def test_the_shell_reads_the_informers_not_the_api():
    world = ReconcileWorld(job_document(), informed=True)
    calls: list[str] = []
    for facade, names in ((world.kube.core, ("list_namespaced_pod", "list_pod_for_all_namespaces", "list_node")),
                          (world.kube.custom, ("list_namespaced_custom_object", "create_namespaced_custom_object"))):
        for name in names:
            real = getattr(facade, name)

            def counted(*args, _real=real, _name=name, **kwargs):
                calls.append(_name)
                return _real(*args, **kwargs)

            setattr(facade, name, counted)
    world.sync()
    calls.clear()
    world.reconcile()  # plans and creates attempt 1, reading pods and children from memory
    world.lagging = True  # its PyTorchJob's watch event has not arrived yet
    world.reconcile()
    assert [c for c in calls if c.startswith("list")] == []
    # The created child was in the store at once: no second create (which the API would refuse as
    # AlreadyExists, costing a create and a read).
    assert calls.count("create_namespaced_custom_object") == 1 and len(world.ours("PyTorchJob")) == 1
    world.lagging = False
    pj = world.newest_child()
    world.run(pj)
    world.sync()
    assert world.queued and world.queued[-1] == (NAMESPACE, world.name)  # the pod's change queued the job


def _h100_node() -> dict:
    """One ready node of 8 H100s in the pool h100-berlin."""
    return {"metadata": {"name": "gpu-1", "namespace": "", "labels": {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "topology.kubernetes.io/region": "eu-de-berlin",
        "karpenter.sh/nodepool": "h100-berlin"}},
        "status": {"allocatable": {"nvidia.com/gpu": "8", "memory": "2048Gi", "cpu": "192"},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


def test_free_gpus_come_from_informed_nodes_and_pods(monkeypatch):
    import finetune_operator.shell.cluster as cluster_module

    monkeypatch.setattr(cluster_module, "DISCOVERY_REFRESH_SECONDS", 0.0)
    kube = FakeKube()
    kube.put("Node", _h100_node())
    kube.put("Pod", pod("other", job=None, gpus=3))
    cluster = Cluster(mock.MagicMock())
    cluster.core, cluster.custom, cluster.networking = kube.core, kube.custom, kube.networking
    cluster.cache = ClusterCache(kube.core, kube.custom)
    cluster.cache.watch_children(PYTORCH_JOB, start=False)
    for informer in cluster.cache.all():
        informer.step()
    policy = load_policy({"allowedRegions": ["eu-de-berlin"]})
    [pool] = cluster.pools(policy)
    assert pool.free_gpus == 5
    other = kube.get("Pod", "team-a", "other")
    other["status"]["phase"] = "Succeeded"
    kube.touch(other)
    [pool] = cluster.pools(policy)
    assert pool.free_gpus == 5  # the informer has not seen it yet
    for informer in cluster.cache.all():
        informer.step()
    [pool] = cluster.pools(policy)
    assert pool.free_gpus == 8


def test_a_namespaced_install_counts_gpu_pods_of_its_namespaces_without_a_cluster_wide_read(monkeypatch):
    """A namespaced install may read pods only in its watched namespaces (chart RBAC): the GPU-pod
    informer and the fallback read list there, never cluster-wide (that was 403 Forbidden)."""
    import finetune_operator.shell.cluster as cluster_module

    monkeypatch.setattr(cluster_module, "DISCOVERY_REFRESH_SECONDS", 0.0)
    kube = FakeKube()
    kube.put("Node", _h100_node())
    kube.put("Pod", pod("ours", job=None, gpus=3, namespace="team-a"))
    kube.put("Pod", pod("theirs", job=None, gpus=2, namespace="team-b"))

    def forbidden(*args, **kwargs):
        raise AssertionError("a namespaced install listed pods cluster-wide")

    monkeypatch.setattr(kube.core, "list_pod_for_all_namespaces", forbidden)
    policy = load_policy({"allowedRegions": ["eu-de-berlin"]})
    cluster = Cluster(mock.MagicMock())
    cluster.core, cluster.custom, cluster.networking = kube.core, kube.custom, kube.networking
    cluster.watched_namespaces = ["team-a"]
    [pool] = cluster.pools(policy)  # before the informers have listed: the API, per namespace
    assert pool.free_gpus == 5
    cluster.cache = ClusterCache(kube.core, kube.custom, namespaces=["team-a"])
    for informer in cluster.cache.all():
        informer.step()
    cluster._pool_cache = None
    [pool] = cluster.pools(policy)
    assert pool.free_gpus == 5  # team-b's pod is not visible to this install


def test_stop_ends_a_watch_that_waits_for_events_at_once():
    """An informer's thread sits in a blocking read of its watch; stop() must cut it, not wait for the
    next event or the watch's timeout (the operator hung 20 s on SIGTERM and never handed the Lease
    back)."""
    import http.server
    import json as _json
    import threading as _threading
    import time as _time

    import urllib3

    from finetune_operator.shell.informer import Informer

    class Quiet(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if "watch=1" not in self.path:
                body = _json.dumps({"metadata": {"resourceVersion": "1"}, "items": []}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            _time.sleep(30)  # no event, as a quiet watch

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    server.daemon_threads = True
    _threading.Thread(target=server.serve_forever, daemon=True).start()
    pool = urllib3.PoolManager()
    url = f"http://127.0.0.1:{server.server_address[1]}/things"

    class Page:
        def __init__(self, data):
            self.data = data

    def list_fn(watch=False, _preload_content=False, **kwargs):
        if watch:
            return pool.request("GET", url + "?watch=1", preload_content=False, timeout=urllib3.Timeout(connect=5, read=60))
        return Page(pool.request("GET", url).data)

    informer = Informer("things", list_fn).start()
    try:
        assert informer.synced.wait(5)
        deadline = _time.monotonic() + 5
        while informer._response is None and _time.monotonic() < deadline:
            _time.sleep(0.01)
        assert informer._response is not None, "the informer never started watching"
        started = _time.monotonic()
        informer.stop()
        informer._thread.join(timeout=10)
        assert not informer._thread.is_alive() and _time.monotonic() - started < 3
    finally:
        server.shutdown()
