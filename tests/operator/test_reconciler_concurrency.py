"""Plans made at once by several workers (`Reconciler._commit`): each job plans outside the placement
lock on the claims noted so far; its claim is checked and noted under the lock. The test holds every
job's first decision once made, until it lets that job go on, so it chooses the interleaving: which
jobs plan on the same books before which commit."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune_operator import lifecycle

from fake_kube import Serialised
from reconcile_world import NAMESPACE, ReconcileWorld, gpu_node, job_document

POOL = "h100-berlin"
# One GPU each, so that a node of n GPUs has room for n jobs.
ONE_GPU = {"gpus": 1, "maxGPUs": 1, "gpuTypes": ["H100-80GB", "A100-80GB"]}
WAITS = "must free GPUs or scale up first"  # the plan's words for a pool that has no room now (explain.py)
PATIENCE = 10.0  # seconds: longer than any plan here, short enough that a lost interleaving fails soon


class Parked:
    """`lifecycle.step` that stops after each job's first decision until the test lets it go on; a
    step made again (under the lock) goes straight through."""

    def __init__(self, real: Any, names: list[str]) -> None:
        self.real = real
        self.planned = {name: threading.Event() for name in names}
        self.go = {name: threading.Event() for name in names}
        self.steps: Counter[str] = Counter()
        self.lost: set[str] = set()  # waited for longer than PATIENCE: the interleaving was not the test's
        self._lock = threading.Lock()

    def __call__(self, observed: lifecycle.Observed) -> lifecycle.Decision:
        decision = self.real(observed)
        name = observed.job.metadata.name
        with self._lock:
            self.steps[name] += 1
            first = self.steps[name] == 1
        if first:
            self.planned[name].set()
            if not self.go[name].wait(PATIENCE):
                self.lost.add(name)
        return decision


class Workers:
    """One thread per job, each running one reconcile of its job, as the work queue's workers do."""

    def __init__(self, world: ReconcileWorld, parked: Parked) -> None:
        self.world, self.parked = world, parked
        self.threads: dict[str, threading.Thread] = {}
        self.errors: list[BaseException] = []

    def start(self, name: str) -> bool:
        """Start the job's reconcile; whether it planned (while the others already started wait)."""
        def run() -> None:
            try:
                self.world.reconciler.reconcile(NAMESPACE, name)
            except BaseException as error:  # noqa: BLE001 - reported by the test
                self.errors.append(error)

        self.threads[name] = threading.Thread(target=run, name=f"reconcile-{name}", daemon=True)
        self.threads[name].start()
        return self.parked.planned[name].wait(PATIENCE)

    def release(self, name: str) -> None:
        """Let the job commit its decision and write it; wait until its reconcile is done."""
        self.parked.go[name].set()
        self.threads[name].join(PATIENCE)
        assert not self.threads[name].is_alive(), f"{name}: its reconcile did not end"


@contextmanager
def workers(names: list[str], free_gpus: int) -> Iterator[Workers]:
    """Jobs `names` (one GPU each) and one node of pool h100-berlin with `free_gpus` GPUs free; the
    fake API safe to call from several threads."""
    world = ReconcileWorld(job_document(names[0], resources=ONE_GPU))
    for name in names[1:]:
        world.kube.put("FineTuneJob", job_document(name, resources=ONE_GPU))
    world.kube.put("Node", gpu_node("h100-0", POOL, "NVIDIA-H100-80GB-HBM3", free_gpus))
    cluster, kube, lock = world.reconciler.cluster, world.kube, threading.Lock()
    cluster.core, cluster.custom, cluster.networking = (Serialised(f, lock) for f in (kube.core, kube.custom, kube.networking))
    parked = Parked(lifecycle.step, names)
    pool = Workers(world, parked)
    with mock.patch.object(lifecycle, "step", parked):
        try:
            yield pool
        finally:
            for go in parked.go.values():  # nothing left waiting, whatever failed
                go.set()
            for thread in pool.threads.values():
                thread.join(PATIENCE)
        assert not parked.lost, f"{sorted(parked.lost)} went on before the test let them"


def plans(world: ReconcileWorld, names: list[str]) -> dict[str, dict[str, Any]]:
    return {name: world.kube.get("FineTuneJob", NAMESPACE, name)["status"] for name in names}


def assert_placed_without_overcommit(world: ReconcileWorld, names: list[str], free_gpus: int) -> list[str]:
    """Every job has its attempt; the jobs whose plans say they start now on the pool take no more
    GPUs than it has free, and as many as it has; the others wait, and say so. Returns the starters."""
    statuses = plans(world, names)
    starting = []
    for name, status in statuses.items():
        plan = status["plan"]
        assert status["currentAttempt"] == 1 and world.kube.get("PyTorchJob", NAMESPACE, f"{name}-a1") is not None, name
        if plan["nodePool"] == POOL and not plan["needsScaleUp"]:
            starting.append(name)
        else:
            assert plan["needsScaleUp"] and WAITS in plan["reason"], (name, plan["reason"])
    taken = sum(statuses[n]["plan"]["nodes"] * statuses[n]["plan"]["gpusPerNode"] for n in starting)
    assert taken <= free_gpus, f"{taken} GPUs planned to start now on a pool with {free_gpus} free: {starting}"
    # No job waits while the pool has room: what was claimed first is never given away.
    assert len(starting) == min(len(names), free_gpus), (starting, {n: s["plan"]["reason"] for n, s in statuses.items()})
    return starting


def test_two_jobs_planned_at_once_for_the_last_free_gpu_one_starts_the_other_waits():
    names = ["first", "second"]
    with workers(names, free_gpus=1) as pool:
        assert pool.start("first")
        # The second plans while the first's decision is made but not noted: the placement lock is not
        # held while planning (it was: the second then waited for the first's whole step).
        assert pool.start("second"), "the second job could not plan while the first one's decision was pending"
        pool.release("first")
        pool.release("second")
        assert not pool.errors, pool.errors
    world = pool.world
    assert assert_placed_without_overcommit(world, names, free_gpus=1) == ["first"]
    # Both counted the free GPU; the second found it claimed at its commit and planned again, once.
    assert pool.parked.steps == {"first": 1, "second": 2} and world.reconciler.replans == 1
    assert "0 free now" in plans(world, names)["second"]["plan"]["reason"]


def test_a_plan_still_fitting_at_its_commit_is_not_made_again():
    """Two free GPUs, two jobs planned at once: the second's GPU is still free when it commits."""
    names = ["first", "second"]
    with workers(names, free_gpus=2) as pool:
        assert pool.start("first") and pool.start("second")
        pool.release("second")
        pool.release("first")
        assert not pool.errors, pool.errors
    assert pool.world.reconciler.replans == 0 and pool.parked.steps == {"first": 1, "second": 1}
    assert sorted(assert_placed_without_overcommit(pool.world, names, free_gpus=2)) == names


@st.composite
def interleavings(draw: Any) -> tuple[list[str], int, list[str]]:
    """Jobs, the pool's free GPUs, and an order of steps: each job's name twice, its first time its
    reconcile starts and plans (on the claims noted so far), its second time it commits and writes."""
    jobs = draw(st.integers(min_value=2, max_value=4))
    names = [f"job-{i}" for i in range(jobs)]
    free = draw(st.integers(min_value=1, max_value=jobs))
    order = draw(st.permutations(names + names))
    return names, free, order


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(interleavings())
def test_no_interleaving_of_plans_and_commits_overcommits_a_pool_or_leaves_a_job_without_its_place(case):
    names, free, order = case
    started: set[str] = set()
    with workers(names, free_gpus=free) as pool:
        for name in order:
            if name in started:
                pool.release(name)
            else:
                started.add(name)
                assert pool.start(name), f"{name} could not plan while others' decisions were pending"
        assert not pool.errors, pool.errors
    assert_placed_without_overcommit(pool.world, names, free)
    reconciler = pool.world.reconciler
    assert reconciler.replans <= len(names) and sum(pool.parked.steps.values()) == len(names) + reconciler.replans
    # Every job holds its claim: the next plan counts it.
    assert all(reconciler.claims.get((NAMESPACE, name)) is not None for name in names)


def test_a_job_waiting_on_a_full_pool_is_woken_when_another_pool_in_its_regions_has_room():
    """waiting_to_wake reads the claims and the waiting jobs under the placement lock, on a snapshot
    taken outside it."""
    import dataclasses

    from finetune_operator.rendering.labels import ATTEMPT_LABEL, JOB_LABEL

    world = ReconcileWorld(job_document("first", resources=ONE_GPU))
    world.kube.put("FineTuneJob", job_document("second", resources=ONE_GPU))
    world.kube.put("Node", gpu_node("h100-0", POOL, "NVIDIA-H100-80GB-HBM3", 1))
    reconciler = world.reconciler
    reconciler.reconcile(NAMESPACE, "first")
    reconciler.reconcile(NAMESPACE, "second")
    second = world.kube.get("FineTuneJob", NAMESPACE, "second")["status"]["plan"]
    assert second["nodePool"] == POOL and second["needsScaleUp"], second
    # Its pod exists and waits for a node; it has waited long enough to be worth a move.
    world.kube.put("Pod", {"metadata": {"name": "second-a1-master-0", "namespace": NAMESPACE,
                                        "labels": {JOB_LABEL: "second", ATTEMPT_LABEL: "1"}},
                           "spec": {}, "status": {"phase": "Pending"}})
    reconciler.reconcile(NAMESPACE, "second")
    key = (NAMESPACE, "second")
    held = reconciler.claims.get(key)
    assert held is not None and held.waiting_since is not None
    reconciler.claims.restore(key, dataclasses.replace(held, waiting_since=held.waiting_since - 3600))
    with mock.patch("finetune_operator.shell.cluster.DISCOVERY_CACHE_SECONDS", -1.0):  # every look lists the nodes
        assert reconciler.waiting_to_wake() == []  # nowhere else to go
        # A GPU frees up in another pool, and a new job claims it before the waiting one is looked at.
        world.kube.put("Node", gpu_node("a100-0", "a100-berlin", "NVIDIA-A100-SXM4-80GB", 1))
        world.kube.put("FineTuneJob", job_document("third", resources=dict(ONE_GPU, gpuTypes=["A100-80GB"])))
        reconciler.reconcile(NAMESPACE, "third")
        third = world.kube.get("FineTuneJob", NAMESPACE, "third")["status"]["plan"]
        assert third["nodePool"] == "a100-berlin" and not third["needsScaleUp"], third
        assert reconciler.waiting_to_wake() == []  # the room is claimed
        world.kube.put("Node", gpu_node("a100-1", "a100-berlin", "NVIDIA-A100-SXM4-80GB", 1))
        assert reconciler.waiting_to_wake() == [key]
        assert reconciler.waiting_to_wake() == []  # not woken again at once
