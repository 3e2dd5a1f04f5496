"""The shell and the lifecycle together on a strict fake API: ownership, unreadable status,
refused creates, and a stateful property test over random histories of faults."""

from __future__ import annotations

import time
from types import SimpleNamespace
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from finetune_operator.children import SUSPENDED_BY_ANNOTATION
from finetune_operator.planning.plan import plan_key_of
from finetune_operator.shell.reconciler import CHILDREN_UNREADABLE_RETRY_SECONDS
from finetune_operator import api
from finetune_operator.rendering.labels import ATTEMPT_LABEL

from fake_kube import _error
from reconcile_world import ALLOWED, NAMESPACE, ReconcileWorld, gpu_node, job_document, live


@pytest.mark.parametrize("eager", [False, True], ids=["status-first", "configmap-first"])
def test_a_foreign_configmap_is_neither_adopted_nor_deleted_and_the_job_says_so(eager: bool):
    world = ReconcileWorld(job_document(), eager=eager)
    foreign = world.foreign("ConfigMap", "support-bot-a1")
    world.reconcile()
    assert world.kube.get("ConfigMap", NAMESPACE, "support-bot-a1") == foreign
    assert world.ours("PyTorchJob") == []  # the ConfigMap goes first; nothing runs without it
    blocked = world.conditions()["Blocked"]
    assert blocked["status"] == "True" and blocked["reason"] == "NameConflict" and "support-bot-a1" in blocked["message"]
    assert world.status["reason"] == "NameConflict"  # what `kubectl get ftj` shows
    for _ in range(3):
        world.reconcile()
    assert world.kube.get("ConfigMap", NAMESPACE, "support-bot-a1") == foreign
    assert not [w for w in world.kube.writes if w.name == "support-bot-a1" and w.kind == "ConfigMap"]
    # A person removes it: the job goes on by itself.
    del world.kube.objects[("ConfigMap", NAMESPACE, "support-bot-a1")]
    world.reconcile()
    world.reconcile()
    assert [pj["metadata"]["name"] for pj in world.ours("PyTorchJob")] == ["support-bot-a1"]
    assert world.conditions()["Blocked"]["status"] == "False"


def test_the_attempts_network_policy_comes_before_its_training_job_and_goes_with_its_attempt():
    world = ReconcileWorld(job_document(recovery={"backoff": {"initialSeconds": 0}}))
    world.reconcile()
    creates = [(w.kind, w.name) for w in world.kube.writes if w.verb == "create"]
    assert creates.index(("NetworkPolicy", "support-bot-a1")) < creates.index(("PyTorchJob", "support-bot-a1"))
    [netpol] = world.ours("NetworkPolicy")
    assert netpol["spec"]["podSelector"]["matchLabels"][ATTEMPT_LABEL] == "1"
    world.gpu_oom(world.newest_child())
    for _ in range(4):
        world.reconcile()
    # Attempt 2 has its own; attempt 1's went with its training job and ConfigMap.
    assert [n["metadata"]["name"] for n in world.ours("NetworkPolicy")] == ["support-bot-a2"]
    assert [pj["metadata"]["name"] for pj in world.ours("PyTorchJob")] == ["support-bot-a2"]


def test_a_foreign_network_policy_with_the_attempts_name_blocks_the_attempt_and_is_left_alone():
    world = ReconcileWorld(job_document())
    foreign = world.foreign("NetworkPolicy", "support-bot-a1")
    for _ in range(3):
        world.reconcile()
    assert world.kube.get("NetworkPolicy", NAMESPACE, "support-bot-a1") == foreign
    assert world.ours("PyTorchJob") == []  # no pod of the attempt runs without its own policy
    blocked = world.conditions()["Blocked"]
    assert blocked["status"] == "True" and blocked["reason"] == "NameConflict" and "NetworkPolicy" in blocked["message"]
    del world.kube.objects[("NetworkPolicy", NAMESPACE, "support-bot-a1")]
    world.reconcile()
    world.reconcile()
    assert [pj["metadata"]["name"] for pj in world.ours("PyTorchJob")] == ["support-bot-a1"]
    assert world.conditions()["Blocked"]["status"] == "False"


def test_a_foreign_training_job_with_the_next_attempts_name_is_never_deleted():
    world = ReconcileWorld(job_document(recovery={"backoff": {"initialSeconds": 0}}))
    world.reconcile()
    world.gpu_oom(world.newest_child())
    foreign = world.foreign("PyTorchJob", "support-bot-a2")
    for _ in range(4):
        world.reconcile()
    assert world.kube.get("PyTorchJob", NAMESPACE, "support-bot-a2") == foreign
    assert world.conditions()["Blocked"]["reason"] == "NameConflict"
    assert [w.verb for w in world.kube.writes if w.name == "support-bot-a2"] == []


def test_a_status_it_cannot_read_gets_a_condition_and_nothing_else():
    world = ReconcileWorld(job_document())
    world.reconcile()
    world.run(world.newest_child())
    world.job["status"]["attempts"] = "garbage"
    before = len(world.kube.writes)
    world.reconcile()
    writes = world.kube.writes[before:]
    assert [w.verb for w in writes] == ["status-patch"]
    blocked = world.conditions()["Blocked"]
    assert blocked["reason"] == "StatusUnreadable" and "status.attempts" in blocked["message"]
    assert world.status["reason"] == "StatusUnreadable"
    assert world.status["attempts"] == "garbage"
    world.reconcile()  # the same problem: no second write, no event storm
    assert len(world.kube.writes) == before + 1


def test_unknown_status_keys_are_ignored_not_fatal():
    world = ReconcileWorld(job_document())
    world.reconcile()
    world.run(world.newest_child())
    world.job["status"]["attempts"][0]["addedByANewerOperator"] = {"x": 1}
    world.job["status"]["somethingElse"] = 3
    world.reconcile()
    assert world.status["phase"] == "Running" and len(world.ours("PyTorchJob")) == 1


def test_training_jobs_it_may_not_list_block_the_job_instead_of_a_retry_loop():
    """RBAC that forbids listing a served kind (a backend switched by helm upgrade): the operator cannot
    know whether an attempt of that kind runs, so it starts none, says what it lacks, and looks again."""
    world = ReconcileWorld(job_document())
    world.reconcile()
    world.run(world.newest_child())
    world.reconcile()
    assert len(world.ours("PyTorchJob")) == 1 and world.status["phase"] == "Running"
    world.kube.refuse_list["PyTorchJob"] = _error(403, "Forbidden", 'pytorchjobs.kubeflow.org is forbidden')
    for _ in range(3):
        assert world.reconcile() == CHILDREN_UNREADABLE_RETRY_SECONDS
    blocked = world.conditions()["Blocked"]
    assert blocked["status"] == "True" and blocked["reason"] == "ChildrenUnreadable"
    assert "pytorchjobs.kubeflow.org" in blocked["message"] and "creates and deletes nothing" in blocked["message"]
    assert len(world.ours("PyTorchJob")) == 1 and world.status["phase"] == "Running"
    assert [e["reason"] for e in world.kube.events].count("ChildrenUnreadable") == 1  # once, not per look
    del world.kube.refuse_list["PyTorchJob"]
    world.reconcile()
    assert world.status["phase"] == "Running" and len(world.ours("PyTorchJob")) == 1
    assert world.conditions()["Blocked"]["status"] == "False", world.conditions()["Blocked"]


def test_a_refused_create_is_a_condition_quoting_the_api_then_a_failure():
    world = ReconcileWorld(job_document())
    world.kube.refuse_create["PyTorchJob"] = _error(403, "Forbidden",
                                                   'admission webhook "quota.example" denied the request: exceeded quota')
    world.reconcile()
    blocked = world.conditions()["Blocked"]
    assert blocked["reason"] == "CreateRejected" and "exceeded quota" in blocked["message"]
    assert "PyTorchJob support-bot-a1" in blocked["message"]  # the object refused, not the ConfigMap before it
    events = [e["reason"] for e in world.kube.events]
    world.advance(60)
    world.reconcile()
    assert [e["reason"] for e in world.kube.events] == events  # retried quietly
    world.advance(world.policy.create_retry_seconds)
    world.reconcile()
    assert world.status["phase"] == "Failed" and world.conditions()["Failed"]["reason"] == "CreateRejected"


def test_a_crash_between_status_write_and_create_does_not_start_two_runs():
    world = ReconcileWorld(job_document(recovery={"backoff": {"initialSeconds": 0}}))
    world.reconcile()
    world.gpu_oom(world.newest_child())
    world.kube.fail_after_writes = 1  # the status write of the recovery lands, the delete does not
    with pytest.raises(RuntimeError):
        world.reconcile()
    world.restart()
    for _ in range(3):
        world.reconcile()
    assert [pj["metadata"]["name"] for pj in world.live_children()] == ["support-bot-a2"]


def test_a_configmap_left_by_a_crash_holds_the_config_of_the_try_that_creates_the_training_job():
    world = ReconcileWorld(job_document())
    world.kube.fail_after_writes = 2  # the status write and the ConfigMap land, the training job does not
    with pytest.raises(RuntimeError):
        world.reconcile()
    assert world.ours("PyTorchJob") == [] and len(world.ours("ConfigMap")) == 1
    rendered = world.ours("ConfigMap")[0]["data"]
    # What the next try renders differs (the plan's pool changed, the policy was edited): here the
    # left ConfigMap is made to hold another config.
    world.ours("ConfigMap")[0]["data"] = {key: "{}" for key in rendered} | {"stale.json": "{}"}
    world.restart()
    world.reconcile()
    assert len(world.ours("PyTorchJob")) == 1
    assert world.ours("ConfigMap")[0]["data"] == rendered


@pytest.mark.parametrize("eager", [False, True], ids=["status-first", "configmap-first"])
def test_a_status_conflict_is_retried_not_lost(eager: bool):
    world = ReconcileWorld(job_document(), eager=eager)
    real = world.kube.custom.replace_namespaced_custom_object_status
    calls = []

    def stale_once(*args, **kwargs):
        if not calls:
            calls.append(1)
            world.kube.touch(world.job)  # someone wrote the job since we read it
        return real(*args, **kwargs)

    world.kube.custom.replace_namespaced_custom_object_status = stale_once
    with pytest.raises(Exception) as error:
        world.reconcile()
    assert getattr(error.value, "status", None) == 409
    assert world.ours("PyTorchJob") == []  # nothing created on a status that did not land
    # The ConfigMap posted alongside the write is taken back (or, status first, never posted).
    assert world.ours("ConfigMap") == []
    world.reconcile()
    assert len(world.ours("PyTorchJob")) == 1 and len(world.ours("ConfigMap")) == 1


# ---------------------------------------------------------------------------
# the stateful property test
# ---------------------------------------------------------------------------

FATES = ("gpu-oom", "host-oom", "evict", "succeed")


class ControlLoop(RuleBasedStateMachine):
    """Random histories of pod fates, operator restarts and crashes, status tampering,
    foreign objects and queue suspensions; the invariants hold after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.max_attempts = 4
        self.world = ReconcileWorld(job_document(recovery={"maxAttempts": self.max_attempts,
                                                           "backoff": {"initialSeconds": 1, "maxSeconds": 4}}))
        self.foreign: dict[tuple[str, str], dict] = {}
        self.created_attempts: list[int] = []
        self.seen_writes = 0
        self.resumed_unmarked = 0
        # The reconciler reads the job from a watch cache that may lag (JobBodies): a stale body must
        # never act (its writes are refused with 409 first).
        self.shown: list[dict] = []
        self._fresh_cache()

    def _fresh_cache(self) -> None:
        from finetune_operator.shell.job_bodies import JobBodies

        self.world.reconciler.bodies = JobBodies()

    # -- the operator --------------------------------------------------------
    @rule()
    def reconcile(self) -> None:
        try:
            self.world.reconcile()
        except Exception as error:  # a 409 (status conflict) or an injected crash: the queue retries
            if getattr(error, "status", None) != 409 and not isinstance(error, RuntimeError):
                raise
        self._note_writes()

    @rule(writes=st.integers(min_value=0, max_value=3))
    def crash_mid_reconcile(self, writes: int) -> None:
        self.world.kube.fail_after_writes = writes
        try:
            self.world.reconcile()
        except Exception as error:  # the injected crash, or a 409 when the watch cache was stale
            if getattr(error, "status", None) != 409 and not isinstance(error, RuntimeError):
                raise
        self.world.kube.fail_after_writes = None
        self._note_writes()
        self.world.restart()
        self._fresh_cache()

    @rule()
    def restart(self) -> None:
        self.world.restart()
        self._fresh_cache()

    @rule(eager=st.booleans())
    def the_configmap_post_overtakes_the_status_write(self, eager: bool) -> None:
        from reconcile_world import at_once
        from finetune_operator.shell.reconciler import CHILDREN_UNREADABLE_RETRY_SECONDS, Later

        self.world.alongside = at_once if eager else Later
        self.world.reconciler.alongside = self.world.alongside

    @rule()
    def the_watch_shows_the_job(self) -> None:
        import copy

        body = copy.deepcopy(self.world.job)
        self.shown.append(body)
        self.world.reconciler.bodies.seen((NAMESPACE, self.world.name), body)

    @precondition(lambda self: bool(self.shown))
    @rule(back=st.integers(min_value=1, max_value=4))
    def the_watch_shows_an_old_version(self, back: int) -> None:
        import copy

        old = copy.deepcopy(self.shown[-min(back, len(self.shown))])
        old["metadata"]["resourceVersion"] = f"lagging-{old['metadata']['resourceVersion']}"  # not comparable: taken
        self.world.reconciler.bodies.seen((NAMESPACE, self.world.name), old)

    @rule(seconds=st.sampled_from([1, 5, 30]))
    def time_passes(self, seconds: int) -> None:
        self.world.advance(seconds)

    # -- the training jobs ----------------------------------------------------
    @precondition(lambda self: self._newest_live() is not None)
    @rule(fate=st.sampled_from(FATES), running_first=st.booleans())
    def the_newest_child_ends(self, fate: str, running_first: bool) -> None:
        pj = self._newest_live()
        if running_first:
            self.world.run(pj)
        {"gpu-oom": self.world.gpu_oom, "host-oom": self.world.host_oom,
         "evict": self.world.evict, "succeed": self.world.succeed}[fate](pj)

    @precondition(lambda self: self._newest_live() is not None)
    @rule()
    def the_pods_vanish(self) -> None:
        for key in [k for k in self.world.kube.objects if k[0] == "Pod"]:
            self.world.kube.remove(*key)

    @precondition(lambda self: self._newest_live() is not None)
    @rule()
    def a_queue_suspends_the_child(self) -> None:
        pj = self._newest_live()
        self.world.queue_suspend(pj)

    @precondition(lambda self: self._newest_live() is not None)
    @rule()
    def the_queue_admits_the_child(self) -> None:
        self.world.queue_admit(self._newest_live())

    # -- people and other tools -------------------------------------------------
    @precondition(lambda self: self.world.status.get("currentAttempt") is not None)
    @rule()
    def someone_nulls_current_attempt(self) -> None:
        self.world.job["status"]["currentAttempt"] = None
        self.world.kube.touch(self.world.job)

    @precondition(lambda self: bool(self.world.status.get("attempts")))
    @rule()
    def someone_adds_unknown_status_keys(self) -> None:
        self.world.job["status"]["attempts"][-1]["fromAnotherTool"] = True
        self.world.job["status"]["unknownTopLevel"] = {"a": 1}
        self.world.kube.touch(self.world.job)

    @rule(kind=st.sampled_from(["ConfigMap", "PyTorchJob"]), ahead=st.integers(min_value=0, max_value=2))
    def a_foreign_object_takes_a_name(self, kind: str, ahead: int) -> None:
        attempt = (self.world.status.get("currentAttempt") or 0) + ahead
        name = f"support-bot-a{max(attempt, 1)}"
        if self.world.kube.get(kind, NAMESPACE, name) is None:
            self.foreign[(kind, name)] = self.world.foreign(kind, name)

    @precondition(lambda self: bool(self.foreign))
    @rule()
    def a_person_removes_the_foreign_objects(self) -> None:
        for kind, name in self.foreign:
            self.world.kube.remove(kind, NAMESPACE, name)
        self.foreign.clear()

    # -- helpers ----------------------------------------------------------------
    def _newest_live(self):
        children = self.world.live_children()
        return max(children, key=lambda pj: int(pj["metadata"]["labels"][ATTEMPT_LABEL])) if children else None

    def _note_writes(self) -> None:
        for write in self.world.kube.writes[self.seen_writes:]:
            if write.kind == "PyTorchJob" and write.verb == "create":
                self.created_attempts.append(int(write.body["metadata"]["labels"][ATTEMPT_LABEL]))
                self._check_pinned(write.body)
                # Its pods mount the attempt's ConfigMap: it exists, and it is ours.
                config_map = self.world.kube.get("ConfigMap", NAMESPACE, write.name)
                assert config_map is not None and ("ConfigMap", write.name) not in self.foreign, write.name
                assert [ref["uid"] for ref in config_map["metadata"]["ownerReferences"] if ref.get("controller")] == \
                    [self.world.job["metadata"]["uid"]], write.name
            if write.kind == "PyTorchJob" and write.verb == "patch":
                suspend = ((write.body.get("spec") or {}).get("runPolicy") or {}).get("suspend")
                if suspend is False:
                    # Only a child the operator suspended itself (it carries our mark) may be resumed by it.
                    marks = write.before["metadata"].get("annotations") or {}
                    self.resumed_unmarked += SUSPENDED_BY_ANNOTATION not in marks
            assert (write.kind, write.name) not in self.foreign, f"touched a foreign object: {write}"
        self.seen_writes = len(self.world.kube.writes)

    def _check_pinned(self, pj: dict) -> None:
        for replica in pj["spec"]["pytorchReplicaSpecs"].values():
            terms = replica["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            for term in terms:
                regions = [e for e in term["matchExpressions"] if e["key"] == "topology.kubernetes.io/region"]
                # One region per attempt, inside the allowed ones; and pinned to the plan's GPU product.
                assert regions and all(e["operator"] == "In" and len(e["values"]) == 1 and set(e["values"]) <= set(ALLOWED)
                                       for e in regions)
                assert any(e["key"] == "nvidia.com/gpu.product" for e in term["matchExpressions"])

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def at_most_one_live_training_job(self) -> None:
        assert len(self.world.live_children()) <= 1, [pj["metadata"]["name"] for pj in self.world.live_children()]

    @invariant()
    def attempts_increase_without_gaps_and_stay_bounded(self) -> None:
        created = self.created_attempts
        assert created == sorted(created), created
        if created:
            assert sorted(set(created)) == list(range(1, max(created) + 1)), created
            assert max(created) <= self.max_attempts

    @invariant()
    def foreign_objects_are_untouched(self) -> None:
        for (kind, name), original in self.foreign.items():
            assert self.world.kube.get(kind, NAMESPACE, name) == original

    @invariant()
    def a_plan_that_ran_out_of_memory_is_never_planned_again(self) -> None:
        status = self.world.status
        if not isinstance(status.get("attempts"), list):
            return
        records = [api.AttemptStatus.model_validate(a) for a in status["attempts"]]
        for index, record in enumerate(records):
            if record.outcome == "GPUOutOfMemory" and record.plan is not None:
                later = [r for r in records[index + 1:] if r.plan is not None]
                assert plan_key_of(record.plan) not in [plan_key_of(r.plan) for r in later]

    @invariant()
    def a_queued_child_is_never_resumed_by_us(self) -> None:
        assert self.resumed_unmarked == 0

    def teardown(self) -> None:
        # Settle: with faults gone, the job reaches a terminal phase in bounded steps.
        for (kind, name) in list(self.foreign):
            self.world.kube.remove(kind, NAMESPACE, name)
        self.foreign.clear()
        for _ in range(60):
            for pj in self.world.live_children():
                if (pj["spec"].get("runPolicy") or {}).get("suspend") and not (
                        pj["metadata"].get("annotations") or {}).get(SUSPENDED_BY_ANNOTATION):
                    self.world.queue_admit(pj)
                self.world.succeed(pj)
            self.world.advance(5)
            self.reconcile()
            if self.world.status.get("phase") in ("Succeeded", "Failed"):
                break
        assert self.world.status.get("phase") in ("Succeeded", "Failed"), self.world.status
        self.at_most_one_live_training_job()
        self.attempts_increase_without_gaps_and_stay_bounded()


ControlLoop.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_control_loop = ControlLoop.TestCase


class InformedControlLoop(ControlLoop):
    """The same histories with the shell reading pods and training jobs from informers (informers.py)
    on the fake's strict watches, which may fall behind the API for a while: the invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.world = ReconcileWorld(job_document(recovery={"maxAttempts": self.max_attempts,
                                                           "backoff": {"initialSeconds": 1, "maxSeconds": 4}}),
                                    informed=True)
        self._fresh_cache()

    @rule(lagging=st.booleans())
    def the_informers_fall_behind_or_catch_up(self, lagging: bool) -> None:
        self.world.lagging = lagging

    def teardown(self) -> None:
        self.world.lagging = False
        super().teardown()


InformedControlLoop.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow])
test_informed_control_loop = InformedControlLoop.TestCase


def test_a_repeated_event_is_aggregated_and_names_sort_in_time_order():
    world = ReconcileWorld(job_document())
    cluster = world.reconciler.cluster
    from finetune_operator import lifecycle

    for _ in range(5):
        cluster.post_event(world.job, lifecycle.Event("Warning", "Flapping", "the same thing again"))
    cluster.post_event(world.job, lifecycle.Event("Normal", "Other", "something else"))
    stored = world.kube.of_kind("Event", NAMESPACE)
    assert len(stored) == 2
    flapping = next(e for e in stored if e["reason"] == "Flapping")
    assert flapping["count"] == 5
    # list order (by name) is creation order: kubectl describe keeps it for events of one second
    assert [e["reason"] for e in sorted(stored, key=lambda e: e["metadata"]["name"])] == ["Flapping", "Other"]


def test_a_configmap_architecture_that_arrives_later_is_waited_for():
    doc = job_document()
    doc["spec"]["model"]["architecture"] = {"configMapRef": {"name": "cfg"}}
    world = ReconcileWorld(doc)
    assert world.reconcile() is not None  # looks again soon
    validated = world.conditions()["Validated"]
    assert world.status["phase"] == "Pending" and validated["reason"] == "WaitingForConfigMap"
    assert "cfg" in validated["message"] and world.ours("PyTorchJob") == []
    config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
    world.kube.put("ConfigMap", {"metadata": {"name": "cfg", "namespace": NAMESPACE}, "data": {}})
    world.reconcile()
    assert "no key 'config.json'" in world.conditions()["Validated"]["message"]
    world.kube.get("ConfigMap", NAMESPACE, "cfg")["data"]["config.json"] = __import__("json").dumps(config)
    world.reconcile()
    assert world.conditions()["Validated"]["status"] == "True" and len(world.ours("PyTorchJob")) == 1


def test_statuses_of_earlier_versions_stay_readable_and_a_lost_plan_comes_back_from_the_child():
    from finetune_operator.shell.job_status import read_status

    world = ReconcileWorld(job_document())
    world.reconcile()
    world.run(world.newest_child())
    world.reconcile()
    status = world.job["status"]
    plan = status["plan"]
    # Before quantities, GiB figures were numbers under <name>GiB keys.
    old = dict(plan, predictedPeakGiB=61.3, requiredGiB=66.0, gpuMemoryGiB=79.6, hostMemoryGiB=128.0)
    for key in ("predictedPeak", "required", "gpuMemory", "hostMemory"):
        del old[key]
    parsed, problem = read_status(dict(status, plan=old))
    assert problem is None and parsed.plan.gpu_memory_gi_b == 79.6
    # A plan in a shape this version cannot read is dropped, not fatal; the child brings it back.
    status["plan"] = {"nodePool": plan["nodePool"], "shape": "from the future"}
    world.kube.touch(world.job)
    world.reconcile()
    assert world.status["plan"] == plan and world.status["phase"] == "Running"
    assert "Blocked" not in world.conditions()


def test_an_attempt_just_planned_counts_against_the_free_gpus_of_the_next_plan():
    """Two jobs planned one after the other: the second sees that the first took the free GPU,
    though no pod of the first is bound yet (the 5 s discovery cache would not show it anyway)."""
    world = ReconcileWorld(job_document("first"))
    world.kube.put("Node", gpu_node("h100-0", "h100-berlin", "NVIDIA-H100-80GB-HBM3", 1))
    world.kube.put("Node", gpu_node("a100-0", "a100-berlin", "NVIDIA-A100-SXM4-80GB", 1))
    world.kube.put("FineTuneJob", job_document("second"))
    world.reconcile()
    first = world.status["plan"]
    assert first["needsScaleUp"] is False
    world.reconciler.reconcile(NAMESPACE, "second")
    second = world.kube.get("FineTuneJob", NAMESPACE, "second")["status"]["plan"]
    assert not (second["nodePool"] == first["nodePool"] and second["needsScaleUp"] is False), (first, second)


def test_a_look_that_changes_nothing_writes_nothing_and_our_own_write_is_known():
    world = ReconcileWorld(job_document())
    world.reconcile()
    child = world.newest_child()
    world.run(child)
    world.reconcile()
    writes = len(world.kube.writes)
    # Running, nothing new: looking again costs no write (a PUT of the same status was one per resync).
    world.reconcile()
    world.reconcile()
    assert len(world.kube.writes) == writes, world.kube.writes[writes:]
    # The job as our last status write stored it is ours; any other change is not.
    assert world.reconciler.own_writes.is_own((NAMESPACE, world.name), world.job)
    world.kube.touch(world.job)
    assert not world.reconciler.own_writes.is_own((NAMESPACE, world.name), world.job)


def test_a_claim_holds_until_discovery_counts_the_bound_pods_then_goes():
    """The GPUs of an attempt are counted once: as a claim until discovery's inputs hold its bound
    pods and a pool snapshot made after that counts them, then only by discovery."""
    from finetune_operator.shell.claim_book import ClaimBook

    book = ClaimBook()
    key = (NAMESPACE, "job")
    plan = SimpleNamespace(node_pool="h100-berlin", nodes=1, gpus_per_node=2)
    status = SimpleNamespace(phase="Launching", current_attempt=1, plan=plan)
    decision = SimpleNamespace(status=status, create=[{"kind": "PyTorchJob"}])
    regions = frozenset({"eu-de-berlin"})
    book.note(key, decision, None, [], regions, counted=lambda pods: True)
    assert book.others(None) and not book.others(key)
    assert book.waiting() == []  # just created: not waiting yet
    pod = {"metadata": {"name": "p", "namespace": NAMESPACE, "labels": {ATTEMPT_LABEL: "1"}}, "spec": {}}
    child = mock.MagicMock()
    steady = SimpleNamespace(status=status, create=[])
    book.note(key, steady, child, [pod], regions, counted=lambda pods: True)
    [(waiting_key, held)] = book.waiting()
    assert waiting_key == key and held.waiting_since is not None
    bound = dict(pod, spec={"nodeName": "n1"})
    book.note(key, steady, child, [bound], regions, counted=lambda pods: False)
    assert book.others(None, as_of=time.monotonic() + 60), "discovery does not hold the pods yet: still claimed"
    book.note(key, steady, child, [bound], regions, counted=lambda pods: True)
    counted_at = book.get(key).counted_since
    assert book.others(None, as_of=counted_at - 1), "a snapshot older than the count does not see them"
    assert not book.others(None, as_of=counted_at), "a snapshot made since counts them: no second count"


def test_a_stale_job_from_the_watch_cache_never_acts_it_meets_a_409_and_the_job_is_read_again():
    import copy

    from kubernetes.client.rest import ApiException

    from finetune_operator.shell.job_bodies import JobBodies

    world = ReconcileWorld(job_document())
    bodies = world.reconciler.bodies = JobBodies()
    key = (NAMESPACE, world.name)
    stale = copy.deepcopy(world.job)
    world.reconcile()  # plans and creates attempt 1 (read from the API: nothing cached yet)
    assert len(world.ours("PyTorchJob")) == 1
    # The watch then shows an old version (a lagging event, a resourceVersion that cannot be compared):
    stale["metadata"]["resourceVersion"] = "not-a-number"
    bodies.seen(key, stale)
    writes = len(world.kube.writes)
    with pytest.raises(ApiException) as conflict:
        world.reconcile()  # it would plan attempt 1 again: the status write is refused first
    assert conflict.value.status == 409 and len(world.kube.writes) == writes and len(world.ours("PyTorchJob")) == 1
    world.reconcile()  # read from the API this time
    assert len(world.ours("PyTorchJob")) == 1 and world.status["currentAttempt"] == 1
    # An older numbered version never replaces a newer one.
    newer = world.job
    bodies.seen(key, newer)
    older = copy.deepcopy(newer)
    older["metadata"]["resourceVersion"] = str(int(newer["metadata"]["resourceVersion"]) - 1)
    bodies.seen(key, older)
    assert bodies.get(key) is newer


def test_a_failed_training_job_seen_before_its_pods_failure_is_judged_on_the_pods_as_they_are_now():
    """Two watches, two streams: the PyTorchJob's Failed condition reaches the informer before the
    pod's failure does. The attempt is an out-of-memory failure, not 'gone without a trace'."""
    world = ReconcileWorld(job_document(), informed=True)
    world.reconcile()
    child = world.newest_child()
    world.run(child)
    world.reconcile()
    assert world.status["phase"] == "Running"
    world.gpu_oom(child)
    cache = world.reconciler.cluster.cache
    for informer in cache.all():
        if informer not in cache.pods.values():
            informer.step()  # the training job's watch delivers; the pods' lags behind
    assert cache.job_pods(NAMESPACE, world.name)[0]["status"]["phase"] == "Running"
    world.lagging = True
    world.reconcile()
    first = world.status["attempts"][0]
    assert first["outcome"] == "GPUOutOfMemory", first


def test_a_job_deleted_behind_the_watch_cache_is_read_again_and_forgotten():
    from kubernetes.client.rest import ApiException

    from finetune_operator.shell.job_bodies import JobBodies

    world = ReconcileWorld(job_document())
    bodies = world.reconciler.bodies = JobBodies()
    world.reconcile()
    child = world.newest_child()
    world.run(child)
    world.reconcile()
    key = (NAMESPACE, world.name)
    bodies.seen(key, world.job)
    world.succeed(child)  # something to write ...
    world.kube.remove("FineTuneJob", NAMESPACE, world.name)  # ... about a job already gone (no DELETED event yet)
    with pytest.raises(ApiException) as gone:
        world.reconcile()  # from the cached body: the write meets a 404
    assert gone.value.status == 404
    assert world.reconcile() is None  # read from the API: gone, forgotten, not retried
