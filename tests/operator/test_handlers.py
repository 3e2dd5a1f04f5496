"""The handlers (shell/handlers.py) fed by the real informers on the strict fake API: FineTuneJob
changes reach the body cache and the work queue, a training-job CRD installed later makes the
operator inform on its kind and look at every job again, and only kinds the ServiceAccount may list
and watch are informed (a forbidden watch would retry and log forever)."""

from __future__ import annotations

from unittest import mock

import pytest

from finetune_operator.planning.policy import ClusterPolicy
from finetune_operator.rendering.backend import BACKENDS
from finetune_operator.shell import handlers
from finetune_operator.shell.cluster import Cluster
from finetune_operator.shell.informers import ClusterCache
from finetune_operator.shell.job_bodies import JobBodies
from finetune_operator.shell.reconciler import PolicyHolder, Reconciler

from fake_kube import FakeKube
from reconcile_world import NAMESPACE, job_document


class Queue:
    """The work queue's `add`, recorded."""

    def __init__(self) -> None:
        self.added: list[tuple[tuple[str, str], bool, bool]] = []  # (key, urgent, first)

    def add(self, key, delay=0.0, urgent=True, first=False):
        self.added.append((key, urgent, first))

    def keys(self) -> list[tuple[str, str]]:
        return [key for key, _, _ in self.added]


class Operator:
    """The real Cluster, informers and Reconciler's caches on the fake API, wired as handlers.start does."""

    def __init__(self, kube: FakeKube, monkeypatch, *, namespaces: list[str] | None = None,
                 may: bool = True) -> None:
        self.kube = kube
        cluster = Cluster(mock.MagicMock())
        cluster.core, cluster.custom = kube.core, kube.custom
        cluster.networking, cluster.extensions = kube.networking, kube.extensions
        monkeypatch.setattr(cluster, "may", lambda verb, group, resource, namespace=None: may)
        cluster.cache = ClusterCache(kube.core, kube.custom, extensions=kube.extensions, namespaces=namespaces,
                                     on_job=handlers._enqueue)
        self.cluster, self.cache = cluster, cluster.cache
        # Informers here are stepped by the test (sync), never run by threads of their own.
        monkeypatch.setattr(self.cache, "watch_children",
                            lambda backend, start=True: ClusterCache.watch_children(self.cache, backend, start=False))
        self.reconciler = Reconciler(cluster=cluster, policy=PolicyHolder(ClusterPolicy()), bodies=JobBodies())
        self.queue = Queue()
        monkeypatch.setattr(handlers.RUNTIME, "reconciler", self.reconciler)
        monkeypatch.setattr(handlers.RUNTIME, "queue", self.queue)
        options = handlers.Options(clusterwide=namespaces is None, namespaces=tuple(namespaces or ()))
        self.watched = handlers.watch_training_jobs(cluster, options)
        self.cache.watch_crds([backend.resource for backend in BACKENDS], handlers.training_crd_changed, start=False)
        self.cache.watch_jobs(handlers.job_changed, start=False)

    def sync(self) -> None:
        """Every informer catches up: a list the first time, then the watch events since."""
        for informer in self.cache.all():
            informer.step()


def test_jobs_reach_the_body_cache_and_the_queue(monkeypatch):
    kube = FakeKube()
    kube.put("FineTuneJob", {**job_document("a"), "metadata": {"name": "a", "namespace": NAMESPACE,
                                                               "managedFields": [{"manager": "kubectl"}]}})
    operator = Operator(kube, monkeypatch)
    operator.sync()
    key = (NAMESPACE, "a")
    # Never looked at (no status): its first look goes ahead of the rest.
    assert operator.queue.added == [(key, True, True)]
    body = operator.reconciler.bodies.get(key)
    assert body["metadata"]["resourceVersion"] == kube.get("FineTuneJob", NAMESPACE, "a")["metadata"]["resourceVersion"]
    assert "managedFields" not in body["metadata"]
    assert handlers.known_jobs() == [key]

    # A status the operator wrote itself: its event needs no reconcile, but the body cache takes it.
    job = kube.get("FineTuneJob", NAMESPACE, "a")
    job["status"] = {"phase": "Pending"}
    kube.touch(job)
    operator.reconciler.own_writes.note(key, job)
    operator.queue.added.clear()
    operator.sync()
    assert operator.queue.added == []
    assert operator.reconciler.bodies.get(key)["status"] == {"phase": "Pending"}

    # Two writes in a row: the watch delivers both events after the second was noted. Neither shows
    # anything the operator has not seen (each write was guarded by the version it read).
    for phase in ("Planned", "Running"):
        job["status"] = {"phase": phase}
        kube.touch(job)
        operator.reconciler.own_writes.note(key, job)
    operator.sync()
    assert operator.queue.added == []
    assert operator.reconciler.bodies.get(key)["status"] == {"phase": "Running"}

    # Anyone else's change is looked at, behind the jobs never looked at.
    job["spec"]["suspend"] = True
    kube.touch(job)
    operator.sync()
    assert operator.queue.added == [(key, True, False)]

    kube.remove("FineTuneJob", NAMESPACE, "a")
    operator.sync()
    assert operator.reconciler.bodies.get(key) is None and handlers.known_jobs() == []


def test_a_namespaced_operator_informs_on_the_jobs_of_its_namespaces_only(monkeypatch):
    kube = FakeKube()
    for namespace in ("a", "b", "c"):
        kube.put("FineTuneJob", {**job_document("j"), "metadata": {"name": "j", "namespace": namespace}})
    operator = Operator(kube, monkeypatch, namespaces=["a", "b"])
    operator.sync()
    assert sorted(operator.queue.keys()) == [("a", "j"), ("b", "j")]
    assert sorted(informer.name for informer in operator.cache.jobs.values()) == ["finetunejobs[a]", "finetunejobs[b]"]


def test_a_training_crd_installed_later_is_informed_and_wakes_every_job(monkeypatch):
    kube = FakeKube()
    kube.served.discard("pytorchjobs")
    kube.install_crd("pytorchjobs")
    for name in ("a", "b"):
        kube.put("FineTuneJob", job_document(name))
    operator = Operator(kube, monkeypatch)
    # Both kinds may be listed and watched, only PyTorchJob is served: no informer on TrainJobs (404s).
    assert operator.watched == [b.resource for b in BACKENDS]
    assert sorted(operator.cache.children) == ["pytorchjob"]
    operator.sync()
    assert sorted(set(operator.queue.keys())) == [(NAMESPACE, "a"), (NAMESPACE, "b")]

    operator.queue.added.clear()
    kube.install_crd("trainjobs")
    operator.sync()
    # The CRDs are watched by name (what the chart's RBAC allows), not as a list of every CRD.
    crd_watches = [r for r in kube.watch_requests if r["kind"] == "CustomResourceDefinition"]
    assert sorted(r["fieldSelector"] for r in crd_watches) == sorted(f"metadata.name={b.resource}" for b in BACKENDS)
    assert sorted(operator.cache.children) == ["pytorchjob", "trainjob"]
    assert sorted(operator.queue.added) == [((NAMESPACE, "a"), False, False), ((NAMESPACE, "b"), False, False)]
    train_jobs = operator.cache.children["trainjob"][None]
    train_jobs.step()
    assert train_jobs.synced.is_set()

    # Removed again: the served kinds are looked up again (a job then says NoTrainingBackend). The
    # TrainJob informer stays and retries with backoff (its list is 404 until the CRD is back).
    operator.queue.added.clear()
    kube.remove_crd("trainjobs")
    for informer in operator.cache.crds:
        informer.step()
    assert [b.plural for b in operator.cluster.served_backends()] == ["pytorchjobs"]
    assert len(operator.queue.added) == 2


def test_leading_looks_at_every_job_the_informer_holds(monkeypatch):
    kube = FakeKube()
    for name in ("a", "b"):
        kube.put("FineTuneJob", job_document(name))
    operator = Operator(kube, monkeypatch)
    operator.sync()
    operator.queue.added.clear()
    monkeypatch.setattr(operator.queue, "set_active", lambda active: None, raising=False)
    handlers._lead()
    assert sorted(operator.queue.added) == [((NAMESPACE, "a"), False, False), ((NAMESPACE, "b"), False, False)]


@pytest.mark.parametrize("allowed, expected", [
    ({"list", "watch"}, [b.resource for b in BACKENDS]),
    ({"list"}, []),
])
def test_only_kinds_it_may_list_and_watch_are_informed(monkeypatch, allowed, expected):
    kube = FakeKube()
    kube.install_crd("trainjobs")
    asked: list[tuple[str, str, str | None]] = []

    def may(verb, group, resource, namespace=None):
        asked.append((verb, resource, namespace))
        return verb in allowed

    cluster = Cluster(mock.MagicMock())
    cluster.custom = kube.custom
    cluster.may = may
    cluster.cache = ClusterCache(kube.core, kube.custom, namespaces=["a", "b"])
    informed: list[str] = []
    cluster.cache.watch_children = lambda backend: informed.append(backend.plural)
    watched = handlers.watch_training_jobs(cluster, handlers.Options(clusterwide=False, namespaces=("a", "b")))
    assert watched == expected
    assert informed == [b.plural for b in BACKENDS if b.resource in expected]
    if expected:  # asked in every watched namespace
        assert {ns for _, r, ns in asked if r == "pytorchjobs"} == {"a", "b"}


@pytest.mark.parametrize("namespaces", [None, ["a", "b", "c"]])
def test_the_client_pool_counts_a_connection_for_every_watch(monkeypatch, namespaces):
    """Each informer's watch holds a pooled connection for minutes: the pool keeps one for each."""
    kube = FakeKube()
    kube.install_crd("trainjobs")
    operator = Operator(kube, monkeypatch, namespaces=namespaces)
    options = handlers.Options(clusterwide=namespaces is None, namespaces=tuple(namespaces or ()))
    assert len(operator.cache.all()) == handlers.watch_connections(options)
