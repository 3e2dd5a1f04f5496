"""A TrainJob's pods are classified like a PyTorchJob's: their trainer container is called `node`."""

from finetune_operator.recovery.classify import FailureKind, classify_pod
from finetune_trainer import contract


def test_the_node_container_is_the_training_container_beside_a_sidecar():
    report = contract.FailureReport(reason="GPUOutOfMemory", phase="forward", step=2, exit_code=75,
                                    peak_allocated_bytes=79 * 2**30, device_total_bytes=80 * 2**30)
    pod = {"metadata": {"name": "j-a1-node-0-0-abcde"}, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "istio-proxy", "state": {"terminated": {"exitCode": 1, "message": "sidecar stopped"}}},
        {"name": "node", "state": {"terminated": {"exitCode": 75, "message": report.to_termination_message()}}}]}}
    verdict = classify_pod(pod)
    assert verdict is not None and verdict.kind is FailureKind.GPU_OUT_OF_MEMORY and verdict.step == 2
