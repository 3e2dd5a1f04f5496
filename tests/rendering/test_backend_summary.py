"""`Backend.summary`: the training job as the informer keeps it reads the same as the whole object
for everything the operator asks of a child, on both backends, and holds no pod template."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from render_factories import plan_for, policy

from finetune_operator import api
from finetune_operator.children import SUSPENDED_BY_ANNOTATION, SUSPENDED_BY_US, child_of
from finetune_operator.recovery.classify import classify_attempt
from finetune_operator.rendering.backend import PYTORCH_JOB, TRAIN_JOB

CONDITIONS = ("Created", "Running", "Succeeded", "Failed", "Complete", "Suspended")


def _rendered(lora_job: dict, backend) -> dict:
    job = api.parse_job(copy.deepcopy(lora_job))
    job = job.model_copy(update={"metadata": job.metadata.model_copy(update={"uid": "0f3c1d2e-1111-2222-3333-444455556666"})})
    return json.loads(json.dumps(backend.render(job, plan_for(job), 2, policy()).training_job))


@pytest.mark.parametrize("backend", [PYTORCH_JOB, TRAIN_JOB], ids=lambda b: b.name)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conditions=st.lists(st.tuples(st.sampled_from(CONDITIONS), st.sampled_from(["True", "False"])), max_size=4),
       suspended=st.sampled_from([None, True, False]), by_us=st.booleans(), ready=st.integers(0, 2))
def test_the_summary_reads_as_the_whole_training_job(lora_job, backend, conditions, suspended, by_us, ready):
    # lora_job is only read (copied before use): sharing it across examples is safe.
    whole = _rendered(lora_job, backend)
    whole["metadata"]["uid"] = "child-uid"
    whole["metadata"]["managedFields"] = [{"manager": "training-operator", "fieldsV1": {"f:status": {}}}]
    if by_us:
        whole["metadata"]["annotations"][SUSPENDED_BY_ANNOTATION] = SUSPENDED_BY_US
    if suspended is not None:
        backend_path = {"pytorchjob": ("runPolicy",), "trainjob": ()}[backend.name]
        node = whole["spec"]
        for key in backend_path:
            node = node.setdefault(key, {})
        node["suspend"] = suspended
    whole["status"] = {"conditions": [{"type": t, "status": s, "message": f"{t} is {s}"} for t, s in conditions],
                       "jobsStatus": [{"name": "node", "ready": ready}]}
    summary = backend.summary(whole)

    full_child, kept_child = child_of(whole, backend), child_of(summary, backend)
    assert full_child is not None and kept_child is not None
    assert full_child.__dict__ | {"body": None} == kept_child.__dict__ | {"body": None}
    assert kept_child.body["metadata"]["uid"] == "child-uid"
    assert kept_child.body["metadata"]["ownerReferences"] == whole["metadata"]["ownerReferences"]
    assert classify_attempt([], summary) == classify_attempt([], whole)
    assert "managedFields" not in summary["metadata"]
    assert "template" not in json.dumps(summary) and len(json.dumps(summary)) < len(json.dumps(whole)) / 2
