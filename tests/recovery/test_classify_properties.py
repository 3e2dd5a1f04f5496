"""Classification over random pod fates (hypothesis): it never fails, and whatever path a
verdict takes (report, kubelet, log tail, exit code, disruption, the job's condition), its
message is bounded and quotes no credential the process printed."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator.recovery import FailureKind, classify_attempt, classify_pod
from finetune_operator.recovery.redact import MESSAGE_LIMIT
from finetune_trainer import contract

from .test_classify import OUR_LOG_TAIL, TORCH_OOM_TAIL, TORCHRUN_SIGKILL_TAIL
from .test_redact import CASES

SECRET_LINES = [(text, secret) for text, secret, _ in CASES]
REASONS = ["Error", "OOMKilled", "Completed", "ContainerCannotRun", ""]
CODES = [0, 1, 2, 65, 71, 75, 78, 137, 143, None]
TAILS = ["", TORCH_OOM_TAIL, TORCHRUN_SIGKILL_TAIL, OUR_LOG_TAIL, "MemoryError\n", "KeyError: 'input_ids'\n"]


@st.composite
def terminated(draw) -> tuple[dict[str, Any], str]:
    """A terminated container state whose message carries one credential; and the credential."""
    text, secret = draw(st.sampled_from(SECRET_LINES))
    tail = draw(st.sampled_from(TAILS))
    before = draw(st.booleans())
    message = f"{text}\n{tail}" if before else f"{tail}{text}\n"
    if draw(st.booleans()):
        # Our trainer's report, the credential in its message (an exception's text).
        reason = draw(st.sampled_from(contract.TRAINER_REPORTED))
        message = contract.FailureReport(
            reason=reason, phase="data", step=0, exit_code=contract.EXIT_CODE_FOR_REASON[reason],
            message=draw(st.text(max_size=200)) + "\n" + text,
        ).to_termination_message()
    state: dict[str, Any] = {"message": message, "reason": draw(st.sampled_from(REASONS))}
    code = draw(st.sampled_from(CODES))
    if code is not None:
        state["exitCode"] = code
    return state, secret


@st.composite
def pods(draw) -> tuple[list[dict[str, Any]], list[str]]:
    result, secrets = [], []
    for i in range(draw(st.integers(min_value=1, max_value=4))):
        state, secret = draw(terminated())
        secrets.append(secret)
        status: dict[str, Any] = {
            "phase": draw(st.sampled_from(["Failed", "Running", "Succeeded", "Unknown"])),
            "containerStatuses": [{"name": "pytorch", "state": {"terminated": state}}],
        }
        if draw(st.booleans()):
            text, secret = draw(st.sampled_from(SECRET_LINES))
            secrets.append(secret)
            status["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                     "reason": draw(st.sampled_from(["PreemptionByScheduler", "DeletionByTaintManager",
                                                                     "TerminationByKubelet"])),
                                     "message": text}]
        if draw(st.booleans()):
            text, secret = draw(st.sampled_from(SECRET_LINES))
            secrets.append(secret)
            status.update(reason="Evicted", message=text)
        result.append({"metadata": {"name": f"j-a1-worker-{i}"}, "status": status})
    return result, secrets


@settings(max_examples=300, deadline=None)
@given(pods(), st.sampled_from(SECRET_LINES))
def test_every_verdict_is_bounded_and_quotes_no_credential(pods_and_secrets, job_line):
    pod_list, secrets = pods_and_secrets
    job = {"status": {"conditions": [{"type": "Failed", "status": "True", "message": job_line[0]}]}}
    for pod in pod_list:
        verdict = classify_pod(pod)
        if verdict is not None:
            assert len(verdict.message) <= MESSAGE_LIMIT
            for secret in secrets:
                assert secret not in verdict.message and secret not in verdict.describe()
    for verdict in (classify_attempt(pod_list, job), classify_attempt([], job)):
        assert isinstance(verdict.kind, FailureKind)
        assert len(verdict.message) <= MESSAGE_LIMIT
        for secret in [*secrets, job_line[1]]:
            assert secret not in verdict.message and secret not in verdict.describe()
