"""status.reason: the one word `kubectl get ftj` shows for why a job is in its phase."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from finetune_operator import api, lifecycle
from finetune_operator.summary import status_reason

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _status(phase: str, *conditions: tuple[str, str, str]) -> api.FineTuneJobStatus:
    return api.FineTuneJobStatus(
        phase=phase,
        conditions=[
            api.Condition(type=t, status=s, reason=r, message="", last_transition_time=NOW) for t, s, r in conditions
        ],
    )


VALID = ("Validated", "True", "Valid")
PLANNED = ("Planned", "True", "Planned")

CASES = [
    # Pending: nothing fits, or not validated yet
    ("pending-no-fit", _status("Pending", VALID, ("Planned", "False", "NoFit")), "NoFit"),
    ("pending-cannot-render", _status("Pending", VALID, ("Planned", "False", "CannotRender")), "CannotRender"),
    ("pending-new", _status("Pending"), None),
    ("pending-waiting-for-configmap", _status("Pending", ("Validated", "Unknown", "WaitingForConfigMap"),
                                              ("Planned", "False", "NoFit")), "WaitingForConfigMap"),
    ("running-while-waiting", _status("Running", ("Validated", "Unknown", "WaitingForConfigMap"), PLANNED,
                                      ("Running", "True", "Running")), None),
    # Failed: the Failed condition's reason, whatever else is set
    ("failed-invalid", _status("Failed", ("Validated", "False", "Invalid"), ("Failed", "True", "Invalid")), "Invalid"),
    ("failed-oom", _status("Failed", VALID, PLANNED, ("Running", "False", "Failed"),
                           ("Recovering", "False", "GaveUp"), ("Failed", "True", "GPUOutOfMemory")), "GPUOutOfMemory"),
    ("failed-create-rejected", _status("Failed", VALID, ("Blocked", "False", "GaveUp"),
                                       ("Failed", "True", "CreateRejected")), "CreateRejected"),
    # Blocked=True wins in every phase; Blocked=False does not count
    ("blocked-running", _status("Running", VALID, PLANNED, ("Running", "True", "Running"),
                                ("Blocked", "True", "NameConflict")), "NameConflict"),
    ("blocked-pending", _status("Pending", VALID, ("Planned", "False", "NoFit"),
                                ("Blocked", "True", "StatusUnreadable")), "StatusUnreadable"),
    ("blocked-resolved", _status("Running", VALID, PLANNED, ("Running", "True", "Running"),
                                 ("Blocked", "False", "Resolved")), None),
    # Queued, Launching, Recovering, Suspended
    ("queued", _status("Queued", VALID, PLANNED, ("Queued", "True", "WaitingForAdmission")), "WaitingForAdmission"),
    ("launching-unschedulable", _status("Launching", VALID, PLANNED, ("Running", "False", "Unschedulable")),
     "Unschedulable"),
    ("launching-not-starting", _status("Launching", VALID, PLANNED, ("Running", "False", "NotStarting")), "NotStarting"),
    ("launching-plain", _status("Launching", VALID, PLANNED, ("Running", "False", "Launching")), None),
    ("recovering-oom", _status("Recovering", VALID, PLANNED, ("Running", "False", "GPUOutOfMemory"),
                               ("Recovering", "True", "GPUOutOfMemory")), "GPUOutOfMemory"),
    ("suspended", _status("Suspended", VALID, PLANNED, ("Suspended", "True", "Suspended")), None),
    # Running and Succeeded: the phase says it all (an old Recovering=True does not leak into Running)
    ("running-after-recovery", _status("Running", VALID, PLANNED, ("Running", "True", "Running"),
                                       ("Recovering", "True", "GPUOutOfMemory")), None),
    ("succeeded", _status("Succeeded", VALID, PLANNED, ("Running", "False", "Finished"),
                          ("Succeeded", "True", "Succeeded")), None),
]


@pytest.mark.parametrize("status,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_reason_that_matters(status: api.FineTuneJobStatus, expected: str | None):
    assert status_reason(status) == expected


def test_an_unknown_phase_falls_back_to_the_usual_conditions():
    status = _status("Pending", VALID, ("Planned", "False", "NoFit"))
    status = status.model_copy(update={"phase": "Waiting"})  # a phase a newer operator might write
    assert status_reason(status) == "NoFit"


def test_an_invalid_job_from_the_lifecycle_says_invalid():
    decision = lifecycle.invalid(api.FineTuneJobStatus(), [api.FieldProblem(path="spec.x", message="bad")], NOW, 3)
    assert decision.status.phase == "Failed"
    assert status_reason(decision.status) == "Invalid"


def test_the_reason_is_a_status_field_the_printer_column_reads():
    from finetune_operator import crd

    status = _status("Pending", VALID, ("Planned", "False", "NoFit"))
    status.reason = status_reason(status)
    dumped = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert dumped["reason"] == "NoFit"
    (column,) = [c for c in crd.PRINTER_COLUMNS if c["name"] == "Reason"]
    assert column["jsonPath"] == ".status.reason"
    assert "reason" in crd.openapi_schema()["properties"]["status"]["properties"]
