"""The operator watches only the training-job kinds its ServiceAccount may list and watch (the chart
grants each backend's RBAC only when the policy can use it): a forbidden watch would retry forever."""

from __future__ import annotations

import kopf
import pytest

from finetune_operator import handlers


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
