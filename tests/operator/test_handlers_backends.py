"""The operator watches only the training-job kinds its ServiceAccount may list and watch (the chart
grants each backend's RBAC only when the policy can use it): a forbidden watch would retry forever."""

from __future__ import annotations

import kopf
import pytest

from finetune_operator.shell import handlers


class MayCluster:
    def __init__(self, allowed: set[tuple[str, str]]) -> None:
        self.allowed = allowed
        self.asked: list[tuple[str, str, str | None]] = []

    def may(self, verb: str, group: str, resource: str, namespace: str | None = None) -> bool:
        self.asked.append((verb, resource, namespace))
        return (verb, resource) in self.allowed


@pytest.fixture
def registry(monkeypatch):
    fresh = kopf.OperatorRegistry()
    before = kopf.get_default_registry()
    kopf.set_default_registry(fresh)
    yield fresh
    kopf.set_default_registry(before)


def _watched(registry) -> set[str]:
    return {h.selector.plural or h.selector.any_name for h in registry._watching.get_all_handlers()}


def test_watches_only_what_it_may_list_and_watch(registry):
    cluster = MayCluster({("list", "trainjobs"), ("watch", "trainjobs"), ("list", "pytorchjobs")})
    watched = handlers.watch_training_jobs(cluster, handlers.Options())
    assert watched == ["trainjobs.trainer.kubeflow.org"]
    assert _watched(registry) == {"trainjobs"}


def test_namespaced_mode_asks_in_every_watched_namespace(registry):
    cluster = MayCluster({("list", "pytorchjobs"), ("watch", "pytorchjobs")})
    handlers.watch_training_jobs(cluster, handlers.Options(clusterwide=False, namespaces=("a", "b")))
    assert {ns for _, r, ns in cluster.asked if r == "pytorchjobs"} == {"a", "b"}
    assert _watched(registry) == {"pytorchjobs"}


class InformedCluster(MayCluster):
    """A cluster whose shell informs (informers.py): it serves `served` kinds now."""

    def __init__(self, allowed, served) -> None:
        super().__init__(allowed)
        self.served = served
        self.informed: list[str] = []
        self.cache = self
        self.forgotten = 0

    def served_backends(self):
        return tuple(b for b in handlers.BACKENDS if b.plural in self.served)

    def forget_served_backends(self) -> None:
        self.forgotten += 1

    def watch_children(self, backend) -> None:
        if backend.plural not in self.informed:
            self.informed.append(backend.plural)


def test_an_allowed_kind_is_informed_only_once_its_crd_is_served(registry, monkeypatch):
    everything = {(v, r) for v in ("list", "watch") for r in ("pytorchjobs", "trainjobs")}
    cluster = InformedCluster(everything, served={"pytorchjobs"})
    handlers.watch_training_jobs(cluster, handlers.Options())
    assert cluster.informed == ["pytorchjobs"]  # no informer on a kind the API server does not serve (404s)

    class Reconciler:
        pass

    reconciler = Reconciler()
    reconciler.cluster = cluster
    monkeypatch.setattr(handlers.RUNTIME, "reconciler", reconciler)
    monkeypatch.setattr(handlers.RUNTIME, "queue", None)
    cluster.served = {"pytorchjobs", "trainjobs"}
    handlers.training_crd_event(name="trainjobs.trainer.kubeflow.org")
    assert cluster.forgotten == 1 and cluster.informed == ["pytorchjobs", "trainjobs"]
