"""Training progress in status: the pure part (which pod, rate, ETA, summary) and the poller on the
strict fake API together with the real Reconciler (pods/log reads, JSON-patch writes, resets)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator import api, progress
from finetune_operator.shell.reconciler import Reconciler
from finetune_operator.progress import JobProgress, RateEstimate, Target, summary_text, target_of
from finetune_operator.shell.progress_poller import (PollerSettings, ProgressOnlyChanges, ProgressPoller, patch_progress,
                                               read_pod_log)
from finetune_operator.rendering.labels import ATTEMPT_LABEL, JOB_LABEL
from finetune_trainer.contract import ProgressReport

from fake_kube import _error
from reconcile_world import NAMESPACE, ReconcileWorld, job_document

START = 1_800_000_000.0  # the trainer's clock (unix seconds)


def line(step: int, t: float, attempt: int = 1, total: int = 2000, **fields) -> str:
    return ProgressReport(time=t, attempt=attempt, step=step, max_steps=total, loss=1.5, tokens_per_second=900.0,
                          **fields).to_log_line()


def pod(name: str, attempt: int, phase: str = "Running", role: str = "master", containers=("pytorch",),
        **labels: str) -> dict:
    base = {JOB_LABEL: "support-bot", ATTEMPT_LABEL: str(attempt)}
    if role:
        base["training.kubeflow.org/replica-type"] = role
        base["training.kubeflow.org/replica-index"] = "0"
    base.update(labels)
    return {"metadata": {"name": name, "namespace": NAMESPACE, "labels": base},
            "spec": {"containers": [{"name": c} for c in containers]}, "status": {"phase": phase}}


def running_status(attempt: int = 1, phase: str = "Running") -> api.FineTuneJobStatus:
    return api.FineTuneJobStatus(phase=phase, current_attempt=attempt)


# ---------------------------------------------------------------------------
# which log
# ---------------------------------------------------------------------------

def test_the_target_is_the_current_attempts_master_and_its_trainer_container():
    pods = [pod("a1-master-0", 1), pod("a2-worker-0", 2, role="worker"),
            pod("a2-master-0", 2, containers=("sidecar", "pytorch"))]
    assert target_of(NAMESPACE, "support-bot", running_status(2), pods) == Target(
        NAMESPACE, "support-bot", 2, "a2-master-0", "pytorch", ended=False)
    # Not started yet, or not running at all: nothing to read.
    assert target_of(NAMESPACE, "support-bot", running_status(2), [pod("a2-master-0", 2, phase="Pending")]) is None
    assert target_of(NAMESPACE, "support-bot", running_status(2, "Suspended"), pods) is None
    assert target_of(NAMESPACE, "support-bot", api.FineTuneJobStatus(), pods) is None
    # A finished pod is read once more for its last line.
    assert target_of(NAMESPACE, "support-bot", running_status(1, "Succeeded"),
                     [pod("a1-master-0", 1, phase="Succeeded")]).ended


def test_a_trainjobs_rank0_is_the_first_pod_of_the_node_job():
    def v2(name, job_index, completion):
        return pod(name, 1, role="", containers=("node",), **{
            "jobset.sigs.k8s.io/replicatedjob-name": "node", "jobset.sigs.k8s.io/job-index": job_index,
            "batch.kubernetes.io/job-completion-index": completion})
    pods = [v2("n-0-1", "0", "1"), v2("n-0-0", "0", "0")]
    target = target_of(NAMESPACE, "support-bot", running_status(1), pods)
    assert (target.pod, target.container) == ("n-0-0", "node")


# ---------------------------------------------------------------------------
# rate, ETA, summary
# ---------------------------------------------------------------------------

def test_summary_is_step_of_total_with_the_percentage_rounded_down():
    assert summary_text(120, 2000) == "120/2000 (6%)"
    assert summary_text(1999, 2000) == "1999/2000 (99%)"
    assert summary_text(2000, 2000) == "2000/2000 (100%)"


def test_no_eta_until_steps_advance_then_one_from_the_rate():
    job = JobProgress(attempt=1, rate=RateEstimate())
    first = job.read(line(10, START))
    assert first.summary == "10/2000 (0%)" and first.eta is None and first.steps_per_second is None
    assert job.read(line(10, START)) is None  # the same line again: nothing new
    second = job.read(line(20, START + 10))
    assert second.steps_per_second == pytest.approx(1.0)
    assert second.eta == second.updated_at + timedelta(seconds=1980)


def test_the_first_line_of_a_resumed_attempt_gives_a_rate_from_its_own_span():
    job = JobProgress(attempt=2, rate=RateEstimate())
    status = job.read(line(150, START, attempt=2, start_step=100, elapsed_seconds=100.0))
    assert status.steps_per_second == pytest.approx(0.5) and status.eta is not None


def test_a_line_of_another_attempt_is_ignored_and_nan_loss_is_flagged():
    job = JobProgress(attempt=2, rate=RateEstimate())
    assert job.read(line(5, START, attempt=1)) is None
    status = job.read(ProgressReport(time=START, attempt=2, step=6, max_steps=10, loss=float("nan")).to_log_line())
    assert status.loss is None and status.loss_not_finite is True


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(0.01, 50), jitter=st.lists(st.floats(0.8, 1.25), min_size=3, max_size=30),
       every=st.integers(1, 20))
def test_eta_follows_a_steady_rate(rate, jitter, every):
    """Steps at a steady rate with per-interval jitter: the ETA is within the jitter of the truth."""
    job = JobProgress(attempt=1, rate=RateEstimate())
    t, step, total = START, 0, 100_000
    status = None
    for factor in jitter:
        step += every
        t += every / rate * factor
        status = job.read(line(step, t, total=total)) or status
    assert status is not None and status.steps_per_second is not None
    truth = (total - step) / rate
    predicted = (status.eta - status.updated_at).total_seconds()
    assert 0.75 * truth - 1 <= predicted <= 1.3 * truth + 1


def test_one_slow_interval_moves_the_rate_only_a_little():
    """A checkpoint makes one interval slow: the ETA must not jump by its factor."""
    job = JobProgress(attempt=1, rate=RateEstimate())
    t = START
    for i in range(31):  # ten minutes at 1 step/s, read every 20 s
        status = job.read(line(20 * i, t))
        t += 20
    assert status.steps_per_second == pytest.approx(1.0)
    slow = job.read(line(20 * 31, t - 20 + 60))  # 20 steps in 60 s
    assert 0.8 <= slow.steps_per_second < 1.0


def test_a_status_write_keeps_only_the_current_attempts_progress():
    p = JobProgress(attempt=1, rate=RateEstimate()).read(line(5, START))
    assert progress.for_status(api.FineTuneJobStatus(current_attempt=1, progress=p)) == p
    assert progress.for_status(api.FineTuneJobStatus(current_attempt=2, progress=p)) is None


def test_progress_only_changes_do_not_wake_a_reconcile():
    seen = ProgressOnlyChanges()
    body = {"metadata": {"name": "j", "resourceVersion": "1", "generation": 1}, "spec": {"a": 1},
            "status": {"phase": "Running"}}
    key = (NAMESPACE, "j")
    assert not seen.only_progress(key, body)  # first sight
    body = {**body, "metadata": {**body["metadata"], "resourceVersion": "2"},
            "status": {"phase": "Running", "progress": {"step": 3}}}
    assert seen.only_progress(key, body)
    assert not seen.only_progress(key, {**body, "status": {"phase": "Recovering", "progress": {"step": 3}}})
    assert not seen.only_progress(key, {**body, "status": {"phase": "Recovering"}, "spec": {"a": 2}})


# ---------------------------------------------------------------------------
# the poller on the fake API, with the real Reconciler
# ---------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ProgressWorld(ReconcileWorld):
    """ReconcileWorld with a poller: the rank-0 pod is a PyTorchJob master with a `pytorch` container."""

    def __init__(self, **settings_kwargs) -> None:
        self.clock = Clock()
        self.settings = PollerSettings(**{"interval": 20.0, "workers": 2, "max_reads_per_second": 5,
                                          "tail_lines": 64, "limit_bytes": 65536, **settings_kwargs})
        super().__init__(job_document(recovery={"backoff": {"initialSeconds": 0}}))
        self.kube.log_clock = lambda: START + (self.clock.t - 1000.0)

    def restart(self) -> None:
        super().restart()
        cluster = self.reconciler.cluster
        self.poller = ProgressPoller(read_pod_log(cluster.core), patch_progress(cluster.custom), self.settings,
                                     clock=self.clock)
        self.reconciler = Reconciler(cluster=cluster, policy=self.reconciler.policy, clock=self.reconciler.clock,
                                     progress=self.poller)

    def start_master(self, phase: str = "Running") -> str:
        pj = self.newest_child()
        meta = pj["metadata"]
        pj.setdefault("status", {})["conditions"] = [{"type": "Running", "status": "True"}]
        self.kube.touch(pj)
        name = f"{meta['name']}-master-0"
        body = pod(name, int(meta["labels"][ATTEMPT_LABEL]), phase=phase)
        body["metadata"]["labels"][JOB_LABEL] = meta["labels"][JOB_LABEL]
        body["metadata"]["ownerReferences"] = [{"kind": "PyTorchJob", "name": meta["name"], "uid": meta["uid"],
                                                "controller": True}]
        self.kube.put("Pod", body)
        return name

    def log(self, pod_name: str, text: str) -> None:
        self.kube.logs.setdefault((NAMESPACE, pod_name, "pytorch"), []).append(
            (START + (self.clock.t - 1000.0), text))

    def poll_all(self) -> list:
        keys = self.poller.due_now()
        for key in keys:
            self.poller.poll(key)
        return keys

    def tick(self, seconds: float) -> None:
        self.clock.t += seconds
        self.advance(seconds)


def test_progress_moves_into_status_and_survives_the_reconcilers_writes():
    world = ProgressWorld()
    world.reconcile()
    master = world.start_master()
    world.reconcile()
    assert world.poller.tracked()[(NAMESPACE, "support-bot")].pod == master
    world.log(master, "loading the model ...")
    world.log(master, line(10, START))
    assert world.poll_all() == [(NAMESPACE, "support-bot")]
    progress_ = world.status["progress"]
    assert progress_["summary"] == "10/2000 (0%)" and progress_["attempt"] == 1 and "eta" not in progress_
    read = world.kube.log_reads[-1]
    assert read == {"pod": master, "container": "pytorch", "tailLines": 64, "limitBytes": 65536, "sinceSeconds": None}
    # The per-job bound: nothing is read again before the interval.
    world.tick(5)
    assert world.poll_all() == []
    world.tick(15)
    world.log(master, line(30, START + 20) + "\nwarning: a partial line follows\n" + '{"event": "progress", "st')
    world.poll_all()
    assert world.kube.log_reads[-1]["sinceSeconds"] == 20 + 10  # only what is new, with a margin
    progress_ = world.status["progress"]
    assert progress_["step"] == 30 and progress_["stepsPerSecond"] == pytest.approx(1.0)
    assert progress_["eta"]  # an RFC 3339 time
    # The reconciler's own status writes keep it (a PUT of the whole status).
    world.reconcile()
    assert world.status["progress"]["step"] == 30
    assert api.FineTuneJobStatus.model_validate(world.status).progress.step == 30


def test_a_new_attempt_resets_progress_and_an_old_attempts_write_is_refused():
    world = ProgressWorld()
    world.reconcile()
    master = world.start_master()
    world.reconcile()
    world.log(master, line(40, START))
    world.poll_all()
    assert world.status["progress"]["step"] == 40
    old_target = world.poller.tracked()[(NAMESPACE, "support-bot")]
    world.gpu_oom(world.newest_child())
    world.reconcile()
    assert world.status["currentAttempt"] == 2 and "progress" not in world.status
    assert (NAMESPACE, "support-bot") not in world.poller.tracked()  # nothing of attempt 2 to read yet
    # A write of attempt 1's progress that was in flight lands after the move: refused (the test op).
    stale = JobProgress(attempt=1, rate=RateEstimate()).read(line(41, START + 1))
    with pytest.raises(Exception) as refused:
        patch_progress(world.kube.custom)(old_target, stale)
    assert getattr(refused.value, "status", None) == 422
    assert "progress" not in world.status
    # Attempt 2 runs and logs: its progress shows.
    world.tick(30)
    world.reconcile()
    master2 = world.start_master()
    world.reconcile()
    world.log(master2, line(41, START + 30, attempt=2, start_step=40, elapsed_seconds=10.0))
    world.poll_all()
    assert world.status["progress"]["attempt"] == 2 and world.status["progress"]["summary"] == "41/2000 (2%)"


def test_a_finished_job_keeps_its_final_progress():
    world = ProgressWorld()
    world.reconcile()
    master = world.start_master()
    world.reconcile()
    world.log(master, line(1990, START))
    world.poll_all()
    world.tick(3)
    world.log(master, line(2000, START + 3))
    world.kube.get("Pod", NAMESPACE, master)["status"]["phase"] = "Succeeded"
    world.succeed(world.newest_child())
    world.reconcile()
    assert world.status["phase"] == "Succeeded"
    world.poll_all()  # the final read of the ended pod, before its interval
    assert world.status["progress"]["summary"] == "2000/2000 (100%)"
    assert world.poller.tracked() == {}  # then it stops
    world.reconcile()
    assert world.status["progress"]["summary"] == "2000/2000 (100%)"


def test_reads_are_bounded_globally_and_failures_only_delay_progress():
    world = ProgressWorld(max_reads_per_second=3, workers=2)
    for i in range(10):
        world.poller.track((NAMESPACE, f"j{i}"), Target(NAMESPACE, f"j{i}", 1, f"p{i}", "pytorch"))
    assert len(world.poll_all()) == 2  # workers
    assert len(world.poll_all()) == 1  # the rest of this second's read budget
    assert world.poll_all() == []
    world.tick(1)
    assert len(world.poll_all()) == 2
    # Every one of those reads failed (404: no such pod) and nothing raised.
    assert world.poller.stats["read_errors"] == 5 and world.poller.stats["writes"] == 0


def test_a_slow_or_failing_log_read_never_blocks_or_breaks_a_reconcile():
    world = ProgressWorld()
    world.reconcile()
    master = world.start_master()
    release = threading.Event()
    calls = []

    def slow_read(*args, **kwargs):
        calls.append(1)
        release.wait(10)
        raise _error(500, "InternalError", "the kubelet is away")

    world.kube.core.read_namespaced_pod_log = slow_read
    world.poller.settings.interval = 0.01
    world.poller.clock = time.monotonic
    world.poller.start()
    try:
        world.reconcile()  # tracks the master: the poller's thread starts its read now
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls, "the poller did not read"
        started = time.monotonic()
        for _ in range(3):
            world.reconcile()
        assert time.monotonic() - started < 2  # reconciles did not wait for the blocked read
        assert world.status["phase"] == "Running"
    finally:
        release.set()
        # The released read fails on the poller's thread: wait for it to be counted (stop() does
        # not wait for a read in flight; asserting at once failed under load).
        deadline = time.monotonic() + 10
        while world.poller.stats["read_errors"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        world.poller.stop()
    assert "progress" not in world.status
    assert world.poller.stats["read_errors"] >= 1
    assert master


def test_a_refused_first_read_is_tried_again_after_the_interval_then_backs_off():
    """Right after a container starts, its log may not be served yet: the next try is one interval
    later (not a long backoff), and only repeated failures back off further."""
    world = ProgressWorld()
    world.reconcile()
    master = world.start_master()
    world.kube.logs.pop((NAMESPACE, master, "pytorch"), None)
    real = world.kube.core.read_namespaced_pod_log
    refusals = [_error(400, "BadRequest", "log not served yet")]

    def refusing(*args, **kwargs):
        if refusals:
            raise refusals.pop()
        return real(*args, **kwargs)

    world.kube.core.read_namespaced_pod_log = refusing
    world.reconcile()
    assert world.poll_all() and world.poller.stats["read_errors"] == 1
    world.log(master, line(7, START))
    world.tick(19)
    assert world.poll_all() == []
    world.tick(1)
    assert world.poll_all() and world.status["progress"]["step"] == 7
    # Three failures in a row: 20, 40, then 80 s apart.
    refusals.extend(_error(500, "InternalError", "kubelet away") for _ in range(3))
    waits = []
    for _ in range(3):
        waited = 0
        while not world.poll_all():
            world.tick(5)
            waited += 5
        waits.append(waited)
    assert waits == [20, 20, 40], waits


def test_the_watch_handler_does_not_reconcile_for_a_progress_write(monkeypatch):
    from finetune_operator.shell import handlers

    added = []

    class Queue:
        def add(self, key, delay=0.0, urgent=True, first=False):
            added.append(key)

    monkeypatch.setattr(handlers.RUNTIME, "queue", Queue())
    monkeypatch.setattr(handlers.RUNTIME, "progress_only", ProgressOnlyChanges())
    body = {"metadata": {"name": "j", "namespace": NAMESPACE, "resourceVersion": "5", "generation": 1},
            "spec": {}, "status": {"phase": "Running", "currentAttempt": 1}}

    def event(status, rv):
        obj = {**body, "metadata": {**body["metadata"], "resourceVersion": rv}, "status": status}
        handlers.job_changed("MODIFIED", obj)

    event(body["status"], "5")
    event({**body["status"], "progress": {"step": 1}}, "6")
    event({**body["status"], "progress": {"step": 2}}, "7")
    assert added == [(NAMESPACE, "j")]
    event({**body["status"], "phase": "Recovering", "progress": {"step": 2}}, "8")
    assert added == [(NAMESPACE, "j")] * 2


def test_the_loop_uses_its_read_budget_without_waiting_for_its_tick():
    """With 2 workers and 5 reads/s, five jobs due at once are read within a moment (a worker that
    finishes wakes the loop), and the sixth waits for the next second."""
    stamps: list[float] = []

    def read(target, since, tail_lines, limit_bytes):
        stamps.append(time.monotonic())
        return ""

    poller = ProgressPoller(read, lambda target, progress: None, PollerSettings(interval=600, workers=2,
                                                                               max_reads_per_second=5))
    for i in range(6):
        poller.track((NAMESPACE, f"j{i}"), Target(NAMESPACE, f"j{i}", 1, f"p{i}", "pytorch"))
    poller.start()
    try:
        deadline = time.monotonic() + 10
        while len(stamps) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        poller.stop()
    assert len(stamps) == 6
    assert stamps[4] - stamps[0] < 0.8  # a once-a-second loop needs a second or more for five reads
    assert stamps[5] - stamps[0] >= 1.0  # the cap: the sixth read waits for the rolling second


# ---------------------------------------------------------------------------
# Kubeflow Trainer's status.trainerStatus (the TrainJobStatus gate) instead of the log
# ---------------------------------------------------------------------------

def trainer_status(step: int, t: float, attempt: int = 1, total: int = 2000) -> dict:
    from finetune_trainer.contract import trainer_status_payload
    from finetune_trainer.trainjob_status import rfc3339

    report = ProgressReport(time=t, attempt=attempt, step=step, max_steps=total, loss=1.25, tokens_per_second=900.0)
    return trainer_status_payload(report, remaining_seconds=None, updated=rfc3339(t))["trainerStatus"]


class TrainJobProgressWorld(ProgressWorld):
    """The shell reads a TrainJob's status from its informer (the fake's watch), as in the operator."""

    def __init__(self) -> None:
        super().__init__()

    def restart(self) -> None:
        from finetune_operator.shell.informers import ClusterCache
        from finetune_operator.rendering.backend import TRAIN_JOB

        self.informed = True
        super().restart()
        self.kube.served = {"finetunejobs", "trainjobs", "clustertrainingruntimes"}
        self.kube.put("ClusterTrainingRuntime", {"metadata": {"name": "finetune-torch", "namespace": ""}})
        cluster = self.reconciler.cluster
        cluster.cache = ClusterCache(self.kube.core, self.kube.custom, on_job=lambda ns, name: None)
        cluster.cache.watch_children(TRAIN_JOB, start=False)
        self.poller = ProgressPoller(read_pod_log(cluster.core), patch_progress(cluster.custom), self.settings,
                                     clock=self.clock, trainer_status=cluster.trainer_status)
        self.reconciler = Reconciler(cluster=cluster, policy=self.reconciler.policy, clock=self.reconciler.clock,
                                     progress=self.poller)

    def trainjob(self) -> dict:
        return self.ours("TrainJob")[-1]

    def start_node(self) -> str:
        tj = self.trainjob()
        meta = tj["metadata"]
        tj.setdefault("status", {})["jobsStatus"] = [{"name": "node", "ready": 1, "active": 1}]
        self.kube.touch(tj)
        name = f"{meta['name']}-node-0-0"
        body = pod(name, int(meta["labels"][ATTEMPT_LABEL]), role="", containers=("node",), **{
            "jobset.sigs.k8s.io/replicatedjob-name": "node", "jobset.sigs.k8s.io/job-index": "0",
            "batch.kubernetes.io/job-completion-index": "0"})
        body["metadata"]["labels"][JOB_LABEL] = meta["labels"][JOB_LABEL]
        self.kube.put("Pod", body)
        return name

    def report_status(self, status: dict) -> None:
        tj = self.trainjob()
        tj.setdefault("status", {})["trainerStatus"] = status
        self.kube.touch(tj)
        self.sync()


def test_a_trainjobs_trainer_status_is_read_from_memory_instead_of_the_log_while_it_is_newer():
    world = TrainJobProgressWorld()
    world.reconcile()
    assert [t["metadata"]["name"] for t in world.ours("TrainJob")] == ["support-bot-a1"]
    node = world.start_node()
    world.reconcile()
    assert world.poller.tracked()[(NAMESPACE, "support-bot")].pod == node
    # Not reported yet: the log, as on any backend.
    world.kube.logs.setdefault((NAMESPACE, node, "node"), []).append((START, line(10, START)))
    world.poll_all()
    assert world.status["progress"]["step"] == 10 and len(world.kube.log_reads) == 1
    # The trainer's POSTs reach status.trainerStatus: taken from the informer, the log is not read.
    world.report_status(trainer_status(30, START + 20))
    world.tick(20)
    world.poll_all()
    assert world.status["progress"]["step"] == 30 and world.status["progress"]["stepsPerSecond"] == pytest.approx(1.0)
    assert len(world.kube.log_reads) == 1 and world.poller.stats["trainer_status"] == 1
    # The POSTs stop (a NetworkPolicy, the endpoint down): trainerStatus stays behind, the log moves on.
    world.kube.logs[(NAMESPACE, node, "node")].append((START + 40, line(50, START + 40)))
    world.tick(20)
    world.poll_all()
    assert world.status["progress"]["step"] == 50 and len(world.kube.log_reads) == 2
    # Someone else's status there (transformers' callback, another attempt's report): the log.
    world.report_status(trainer_status(70, START + 60, attempt=2))
    world.kube.logs[(NAMESPACE, node, "node")].append((START + 60, line(60, START + 60)))
    world.tick(20)
    world.poll_all()
    assert world.status["progress"]["step"] == 60 and len(world.kube.log_reads) == 3


def test_no_trainer_status_source_means_only_the_log():
    reads = []
    written = []
    poller = ProgressPoller(lambda target, since, tail, limit: reads.append(target) or line(5, START),
                            lambda target, progress: written.append(progress), PollerSettings(interval=1),
                            trainer_status=lambda target: None)
    poller.track((NAMESPACE, "j"), Target(NAMESPACE, "j", 1, "p", "node"))
    poller.poll((NAMESPACE, "j"))
    assert len(reads) == 1 and written[-1].step == 5
