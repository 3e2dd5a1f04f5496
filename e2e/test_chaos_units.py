"""Fast tests of what the chaos benchmark adds to the lab (no cluster): the fake GPU's per-attempt
outcomes and its kubelet-style eviction, and the kwok stage that renders the pod-level reason."""

from __future__ import annotations

import pytest
import yaml

from e2e.lab import fate
from e2e.lab.cluster import LAB_STAGES

GIB = fate.GIB


def _rule(**values):
    return fate.resolve_rule([fate.RuleSource("pod ns/p", {k.replace("_", "-"): v for k, v in values.items()})])


def test_outcome_by_attempt_picks_the_attempts_entry_and_repeats_the_last():
    rule = _rule(outcome_by_attempt="host-oom, evicted,auto")
    small = 1 * GIB
    verdicts = [fate.decide(fate.TrainingPod("p", small, 81559, attempt=n), rule) for n in (1, 2, 3, 7)]
    assert [v.summary.split()[0] for v in verdicts] == ["host-oom", "evicted", "succeed:", "succeed:"]
    # Without an attempt label the plain outcome applies.
    assert fate.decide(fate.TrainingPod("p", small, 81559), rule).exit_code == 0


def test_outcome_by_attempt_rejects_unknown_outcomes():
    with pytest.raises(fate.RuleError, match="outcome-by-attempt"):
        _rule(outcome_by_attempt="host-oom,explode")


def test_eviction_looks_like_the_kubelets():
    v = fate.decide(fate.TrainingPod("p", GIB, 81559), _rule(outcome="evicted"))
    assert (v.pod_phase, v.pod_reason, v.exit_code) == ("Failed", "Evicted", 137)
    annotations = v.annotations()
    assert annotations[fate.VERDICT_POD_REASON] == "Evicted"
    assert "low on resource: memory" in annotations[fate.VERDICT_POD_MESSAGE]
    # Other verdicts carry no pod-level reason.
    assert fate.VERDICT_POD_REASON not in fate.decide(fate.TrainingPod("p", GIB, 81559), fate.Rule()).annotations()


def test_attempt_of_reads_the_label():
    assert fate.attempt_of({fate.ATTEMPT_LABEL: "3"}) == 3
    assert fate.attempt_of({fate.ATTEMPT_LABEL: "x"}) is None and fate.attempt_of(None) is None


def test_kwok_stage_renders_the_pod_reason_and_message():
    template = yaml.safe_load(LAB_STAGES.read_text())["spec"]["next"]["statusTemplate"]
    for key in (fate.VERDICT_POD_REASON, fate.VERDICT_POD_MESSAGE):
        assert f'"{key}"' in template


# ---- the benchmark's checks (e2e/chaos.py) on synthetic watch events ---------------------------
def _pj(name, job, uid, *, suspend=None, finished=None, deleting=False, queue=None):
    from e2e import chaos as ch

    labels = {ch.JOB_LABEL: job}
    if queue:
        labels[ch.QUEUE_LABEL] = queue
    obj = {"metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": labels, "managedFields": [
        {"manager": "someone", "operation": "Update", "fieldsV1": {"f:spec": {"f:runPolicy": {"f:suspend": {}}}}}]},
        "spec": {"runPolicy": {} if suspend is None else {"suspend": suspend}}, "status": {}}
    if finished:
        obj["status"]["conditions"] = [{"type": finished, "status": "True"}]
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return obj


def test_child_tracker_counts_two_live_training_jobs_and_backward_attempts():
    from e2e import chaos as ch

    tracker = ch.ChildTracker(lambda: set())
    tracker.on_event("ADDED", _pj("j-a1", "j", "u1"))
    tracker.on_event("MODIFIED", _pj("j-a1", "j", "u1", finished="Failed"))
    tracker.on_event("ADDED", _pj("j-a2", "j", "u2"))
    assert tracker.duplicates() == []  # a finished attempt next to a running one is fine
    tracker.on_event("ADDED", _pj("j-a1", "j", "u3"))  # a1 again, beside the running a2
    assert [sorted(i.detail["live"]) for i in tracker.duplicates()] == [["j-a1", "j-a2"]]
    assert [i.detail["created"] for i in tracker.regressions()] == ["j-a1"]
    tracker.on_event("MODIFIED", _pj("j-a1", "j", "u3"))  # same pair again: one incident, not two
    assert len(tracker.duplicates()) == 1
    tracker.on_sync([_pj("j-a2", "j", "u2")])  # a relist without a1: it was deleted
    assert tracker.live_count(("ns", "j")) == 1


def test_queue_sim_flags_a_flip_before_admission_and_not_its_own_admission():
    from kubernetes import client

    from e2e import chaos as ch

    import threading

    sim = ch.QueueSim(client.ApiClient(), lambda ns, name: 3600.0, threading.Event())
    sim._patch = lambda ns, name, suspend: True  # no cluster here
    sim.on_event("ADDED", _pj("j-a1", "j", "u1", suspend=True, queue="q"))
    sim.on_event("MODIFIED", _pj("j-a1", "j", "u1", suspend=False, queue="q"))
    assert [i.detail["pytorchjob"] for i in sim.incidents] == ["j-a1"]
    assert sim.incidents[0].detail["managers"][0]["manager"] == "someone" and sim.resuspends == 1
    sim.on_event("MODIFIED", _pj("j-a1", "j", "u1", suspend=True, queue="q"))
    sim.admitted.add("u1")
    sim.on_event("MODIFIED", _pj("j-a1", "j", "u1", suspend=False, queue="q"))
    assert len(sim.incidents) == 1
    sim.on_event("ADDED", _pj("k-a1", "k", "u9", queue="q"))  # created running: the webhook was bypassed
    assert [i.job for i in sim.created_unsuspended] == ["k-a1"]
    sim.on_event("ADDED", _pj("x-a1", "x", "u5", suspend=False))  # no queue label: none of its business
    assert len(sim.incidents) == 1 and len(sim.created_unsuspended) == 1


def test_queue_webhook_suspends_a_queued_pytorchjob_on_create():
    import base64
    import json
    import threading
    import urllib.request
    from http.server import ThreadingHTTPServer

    from kubernetes import client

    from e2e import chaos as ch

    sim = ch.QueueSim(client.ApiClient(), lambda ns, name: 1.0, threading.Event())
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Hook", (ch._Hook,), {"sim": sim}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        def review(obj):
            body = json.dumps({"request": {"uid": "r1", "operation": "CREATE", "object": obj}}).encode()
            url = f"http://127.0.0.1:{server.server_address[1]}/mutate"
            return json.loads(urllib.request.urlopen(urllib.request.Request(url, body, method="POST")).read())["response"]

        queued = review(_pj("j-a1", "j", "u1", queue="q"))
        assert queued["allowed"] and json.loads(base64.b64decode(queued["patch"])) == [
            {"op": "add", "path": "/spec/runPolicy/suspend", "value": True}]
        assert "patch" not in review(_pj("j-a1", "j", "u1"))
        assert "patch" not in review(_pj("j-a1", "j", "u1", suspend=True, queue="q"))
    finally:
        server.shutdown()


def test_a_lab_process_started_from_a_short_lived_thread_outlives_it(tmp_path):
    """PR_SET_PDEATHSIG follows the forking thread: an apiserver restarted by a chaos thread
    must not get SIGTERM when that thread returns."""
    import threading
    import time

    from e2e.lab.processes import is_alive, start, stop

    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("p", start("sleeper", ["sleep", "30"], tmp_path, die_with_parent=True)))
    thread.start()
    thread.join()
    time.sleep(0.5)
    try:
        assert is_alive(out["p"])
    finally:
        stop([out["p"]], grace=1)
