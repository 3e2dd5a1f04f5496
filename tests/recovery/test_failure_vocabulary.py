"""The failure vocabulary is one table (finetune_trainer.failures): the trainer's report, the
classifier, the lifecycle's outcomes and the API's enum all read it, so they cannot drift."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from finetune_operator import api
from finetune_operator.recovery.classify import classify_pod
from finetune_trainer import contract, failures
from finetune_trainer.failures import FAILURES, FailureKind, Remedy, outcome_of


def test_every_kind_has_its_traits():
    assert set(FAILURES) == set(FailureKind)


def test_the_api_enum_is_the_vocabularys_outcomes():
    enum = typing.get_args(api.AttemptStatus.model_fields["outcome"].annotation)
    assert enum == failures.ATTEMPT_OUTCOMES
    assert {outcome_of(kind) for kind in FailureKind} <= set(enum)
    # An attempt that failed for a reason no one could tell shows "Failed", as it always did.
    assert outcome_of(FailureKind.UNKNOWN) == "Failed"
    assert outcome_of(FailureKind.GPU_OUT_OF_MEMORY) == "GPUOutOfMemory"


def test_exit_codes_are_the_trainers_and_distinct():
    codes = [t.exit_code for t in FAILURES.values() if t.exit_code is not None]
    assert len(codes) == len(set(codes))
    assert failures.EXIT_OK not in codes and failures.EXIT_SIGKILL not in codes and failures.EXIT_SIGTERM not in codes
    assert set(contract.EXIT_CODE_FOR_REASON) == set(failures.TRAINER_REPORTED)
    for kind in failures.TRAINER_REPORTED:
        assert contract.reason_for_exit_code(FAILURES[kind].exit_code) is kind


def test_a_report_carries_only_what_the_trainer_reports():
    with pytest.raises(ValidationError, match="not a reason the trainer reports"):
        contract.FailureReport(reason=FailureKind.EVICTED, phase="data", step=0, exit_code=1)
    assert contract.parse_failure_report(
        '{"reason": "Hung", "phase": "data", "step": 0, "exitCode": 1}') is None


@pytest.mark.parametrize("kind", failures.TRAINER_REPORTED)
def test_the_classifier_reads_each_reported_kind_as_itself(kind):
    report = contract.FailureReport(reason=kind, phase="forward", step=1, exit_code=FAILURES[kind].exit_code)
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Failed", "containerStatuses": [{"name": "pytorch", "state": {
        "terminated": {"exitCode": report.exit_code, "reason": "Error", "message": report.to_termination_message()}}}]}}
    verdict = classify_pod(pod)
    assert verdict is not None and verdict.kind is kind and verdict.source == "report"
    assert verdict.remedy is FAILURES[kind].remedy


def test_remedies():
    assert FAILURES[FailureKind.GPU_OUT_OF_MEMORY].remedy is Remedy.ADJUST
    assert FAILURES[FailureKind.EVICTED].remedy is Remedy.RETRY_SAME
    assert FAILURES[FailureKind.DATA_ERROR].remedy is Remedy.GIVE_UP
