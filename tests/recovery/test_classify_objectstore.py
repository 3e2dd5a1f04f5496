"""A fetch init container that fails (finetune_trainer.objectstore) is classified from its report:
a missing object or refused credentials end the job as DataError, which recovery never retries."""

from __future__ import annotations

from finetune_operator.recovery.classify import FailureKind, Remedy, classify_pod
from finetune_trainer import contract, objectstore
from finetune_trainer.errors import DataError


def _pod(init_terminated: dict) -> dict:
    return {
        "metadata": {"name": "support-bot-a1-master-0"},
        "status": {
            "phase": "Failed",
            "initContainerStatuses": [{"name": "fetch-data", "state": {"terminated": init_terminated}}],
            "containerStatuses": [{"name": "pytorch", "state": {"waiting": {"reason": "PodInitializing"}}}],
        },
    }


def test_a_missing_object_in_the_fetch_init_container_is_a_data_error(tmp_path):
    log = tmp_path / "termination-log"
    code = objectstore.report_failure(
        DataError("cannot read s3://team-a/support/train.jsonl at https://s3.example: not found (404)"),
        contract.Phase.DATA, str(log))
    assert code == contract.EXIT_DATA_ERROR
    failure = classify_pod(_pod({"exitCode": code, "reason": "Error", "message": log.read_text()}))
    assert failure is not None and failure.kind is FailureKind.DATA_ERROR and failure.source == "report"
    assert "s3://team-a/support/train.jsonl" in failure.message
    assert failure.remedy is Remedy.GIVE_UP


def test_an_unreachable_endpoint_is_unknown(tmp_path):
    log = tmp_path / "termination-log"
    code = objectstore.report_failure(objectstore.ObjectStoreError("Could not connect to the endpoint URL"),
                                      contract.Phase.LOAD, str(log))
    failure = classify_pod(_pod({"exitCode": code, "reason": "Error", "message": log.read_text()}))
    assert failure is not None and failure.kind is FailureKind.UNKNOWN and failure.phase == "load"
