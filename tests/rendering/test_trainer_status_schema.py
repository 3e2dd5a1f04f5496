"""What the trainer POSTs to Kubeflow Trainer's status endpoint fits status.trainerStatus of the
TrainJob CRD of the release the lab pins (the endpoint writes it there as is)."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from finetune_trainer.contract import ProgressReport, trainer_status_payload
from finetune_trainer.trainjob_status import rfc3339
from upstream_crd import UpstreamCrdMissing, trainjob_crd


def trainer_status_schema() -> dict:
    try:
        crd = trainjob_crd()
    except UpstreamCrdMissing as missing:
        pytest.skip(str(missing))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return copy.deepcopy(version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["trainerStatus"])


def test_the_payload_fits_the_trainjob_crds_trainer_status_schema():
    schema = trainer_status_schema()
    report = ProgressReport(time=1_800_000_000.25, attempt=2, step=30, maxSteps=120, startStep=20,
                            elapsedSeconds=50.0, loss=1.375, tokensPerSecond=812.5, evalLoss=1.5, evalStep=24,
                            learningRate=2e-5, gradNorm=0.5, peakAllocatedBytes=7 * 2**30)
    status = trainer_status_payload(report, remaining_seconds=180.4, updated=rfc3339(report.time))["trainerStatus"]
    jsonschema.validate(status, schema)
    assert status["progressPercentage"] == 25 and status["estimatedRemainingSeconds"] == 180
    assert status["lastUpdatedTime"] == "2027-01-15T08:00:00Z"
    # The schema bites: a percentage past 100 or a metric value over 64 characters is refused.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**status, "progressPercentage": 101}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**status, "metrics": [{"name": "x", "value": "1" * 65}]}, schema)
