"""The attempts' records in status.attempts: finding and updating one, and keeping there what the
attempt's pods showed (failures, nodes, images) before the pods are gone."""

from __future__ import annotations

from typing import Any, Sequence

from .. import api, provenance
from ..planning.pools import GiB
from ..recovery.classify import Failure, FailureKind, classify_pod
from ..recovery.redact import redact
from ..rendering.backend import trainer_containers
from ..rendering.labels import ATTEMPT_LABEL
from .types import MAX_EVIDENCE_MESSAGE


def attempt_record(status: api.FineTuneJobStatus, attempt: int) -> api.AttemptStatus | None:
    return next((a for a in status.attempts if a.attempt == attempt), None)


def update_record(status: api.FineTuneJobStatus, attempt: int, **changes: Any) -> None:
    for index, record in enumerate(status.attempts):
        if record.attempt == attempt:
            status.attempts[index] = record.model_copy(update=changes)
            return


def pods_of_attempt(pods: Sequence[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    return [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(ATTEMPT_LABEL) == str(attempt)]


def record_failed_pods(status: api.FineTuneJobStatus, attempt: int, pods: Sequence[dict[str, Any]]) -> None:
    """Put what each failed pod shows into the attempt's record now: the pod may be deleted
    (eviction, cleanup) and the operator may restart before the attempt is judged."""
    record = attempt_record(status, attempt)
    if record is None:
        return
    known = {p.pod: p for p in record.failed_pods}
    for pod in pods:
        verdict = classify_pod(pod)
        if verdict is None or not verdict.pod:
            continue
        known[verdict.pod] = _pod_failure_record(verdict)
    if list(known.values()) != record.failed_pods:
        update_record(status, attempt, failed_pods=sorted(known.values(), key=lambda p: p.pod))


def record_where_it_ran(status: api.FineTuneJobStatus, attempt: int, pods: Sequence[dict[str, Any]]) -> None:
    """Add the nodes, trainer images and first start the attempt's pods show to its record as they
    appear (a pod may be gone by the time the attempt ends): the provenance record reads them."""
    record = attempt_record(status, attempt)
    if record is None:
        return
    nodes, images, started = provenance.pod_facts(list(pods), trainer_containers())
    changes: dict[str, Any] = {}
    if not set(nodes) <= set(record.nodes):
        changes["nodes"] = sorted(set(record.nodes) | set(nodes))
    if not set(images) <= set(record.images):
        changes["images"] = sorted(set(record.images) | set(images))
    if started is not None and (record.running_since is None or started < record.running_since):
        changes["running_since"] = started
    if changes:
        update_record(status, attempt, **changes)


def _pod_failure_record(failure: Failure) -> api.PodFailure:
    return api.PodFailure(
        pod=failure.pod or "", kind=failure.kind.value, source=failure.source,
        message=redact(failure.message)[:MAX_EVIDENCE_MESSAGE], exit_code=failure.exit_code,
        phase=failure.phase, step=failure.step, peak_allocated_gi_b=_gib(failure.peak_allocated_bytes),
        capacity_gi_b=_gib(failure.capacity_bytes), tried_to_allocate_gi_b=_gib(failure.tried_to_allocate_bytes),
        micro_batch_size=failure.micro_batch_size)


def _gib(value: int | None) -> float | None:
    # Two decimals, as the status shows it: the record must read back the same after a restart.
    return None if value is None else round(value / GiB, 2)


def _bytes(value: float | None) -> int | None:
    return None if value is None else int(round(value * GiB))


def failure_of_record(record: api.PodFailure) -> Failure:
    try:
        kind = FailureKind(record.kind)
    except ValueError:
        kind = FailureKind.UNKNOWN
    return Failure(kind, record.message, record.source, pod=record.pod, exit_code=record.exit_code,
                   phase=record.phase, step=record.step, peak_allocated_bytes=_bytes(record.peak_allocated_gi_b),
                   capacity_bytes=_bytes(record.capacity_gi_b), tried_to_allocate_bytes=_bytes(record.tried_to_allocate_gi_b),
                   micro_batch_size=record.micro_batch_size)
