"""What the operator reads back from the training jobs it created: one `Child` per attempt.

The children are the truth of what runs. The status says what the operator meant to do;
when the two disagree (a status rolled back, patched by a person, or lost in a crash
between two writes) the lifecycle rebuilds the status from the children, never the other
way round. So every child carries what the status would need: its attempt number (a
label), the plan it runs (an annotation) and who suspended it (an annotation).

Only children whose controller owner is the FineTuneJob (by uid) count; anything else
with a clashing name is foreign and is never adopted, changed or deleted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError

from . import api
from .rendering.backend import DEFAULT_BACKEND, Backend
from .rendering.labels import ATTEMPT_LABEL
from .rendering.renderer import QUEUE_LABEL

log = logging.getLogger("finetune_operator.children")

# The full PlanStatus of the attempt, as JSON: lets a lost status be rebuilt from the child.
PLAN_STATUS_ANNOTATION = "finetune.dev/plan-status"
# Set when the operator suspended the child for spec.suspend. A suspended child without it
# was suspended by someone else (a queueing system such as Kueue): never un-suspended by us.
SUSPENDED_BY_ANNOTATION = "finetune.dev/suspended-by"
SUSPENDED_BY_US = "finetune-operator"


@dataclass(frozen=True)
class Admission:
    """What Kueue says of a queued child, read from its Workload (owned by the child) and LocalQueue."""

    admitted: bool
    reason: str  # Kueue's condition reason (Pending, Inadmissible, QuotaReserved, Admitted, Preempted, ...)
    message: str  # Kueue's message: which quota or flavor is short
    workload: str | None = None  # None: Kueue has made no Workload for it yet
    cluster_queue: str | None = None
    flavors: tuple[str, ...] = ()  # the ResourceFlavors admission assigned (one per region in the lab)
    queue_missing: bool = False  # the LocalQueue the child names does not exist


@dataclass(frozen=True)
class Child:
    """One attempt's training job as the cluster shows it (a PyTorchJob or a TrainJob)."""

    attempt: int
    name: str
    state: str  # Pending | Running | Succeeded | Failed
    suspended: bool
    suspended_by_us: bool
    queue: str | None  # the queue label, when a queueing system admits it
    plan: api.PlanStatus | None  # from the annotation; None when missing or unreadable
    body: dict[str, Any]
    api_version: str = DEFAULT_BACKEND.api_version
    kind: str = DEFAULT_BACKEND.kind
    admission: Admission | None = None  # Kueue's word on a queued child, when the shell could read it

    @property
    def live(self) -> bool:
        """Holds or may hold GPUs: not finished."""
        return self.state not in ("Succeeded", "Failed")


def controlled_by(obj: dict[str, Any], owner_uid: str | None) -> bool:
    """True when `obj`'s controller ownerReference is the object with `owner_uid`."""
    if not owner_uid:
        return False
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == owner_uid and r.get("controller") for r in refs)


def child_of(pj: dict[str, Any], backend: Backend) -> Child | None:
    """The Child a training job of `backend`'s kind stands for; None when it carries no readable attempt label."""
    meta = pj.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    try:
        attempt = int(labels.get(ATTEMPT_LABEL, ""))
    except ValueError:
        return None
    if attempt < 1:
        return None
    plan = None
    text = annotations.get(PLAN_STATUS_ANNOTATION)
    if text:
        try:
            plan = api.PlanStatus.model_validate(json.loads(text))
        except (ValueError, ValidationError) as error:
            log.warning("%s: unreadable %s annotation: %s", meta.get("name"), PLAN_STATUS_ANNOTATION, error)
    return Child(
        attempt=attempt,
        name=meta.get("name", ""),
        state=backend.state(pj),
        suspended=backend.suspended(pj),
        suspended_by_us=annotations.get(SUSPENDED_BY_ANNOTATION) == SUSPENDED_BY_US,
        queue=labels.get(QUEUE_LABEL),
        plan=plan,
        body=pj,
        api_version=backend.api_version,
        kind=backend.kind,
    )


def plan_annotation(plan: api.PlanStatus) -> str:
    return json.dumps(plan.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"), sort_keys=True)


def _conditions(obj: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in ((obj.get("status") or {}).get("conditions") or []) if isinstance(c, dict)}


def owned_workload(workloads: list[dict[str, Any]], child_uid: str | None) -> dict[str, Any] | None:
    """Kueue's Workload for a child: the one whose controller owner is the child (by uid)."""
    return next((w for w in workloads if controlled_by(w, child_uid)), None)


def admission_of(workload: Mapping[str, Any] | None, *, queue_missing: bool = False) -> Admission:
    """Kueue's word on a queued child, read-only: admitted or not, and Kueue's reason and message (the
    quota or flavor that is short), from the Workload's QuotaReserved / Admitted / Evicted conditions."""
    if workload is None:
        reason = "LocalQueueNotFound" if queue_missing else "NoWorkload"
        message = "the LocalQueue does not exist" if queue_missing else "Kueue has not made a Workload for it yet"
        return Admission(admitted=False, reason=reason, message=message, queue_missing=queue_missing)
    conditions = _conditions(workload)
    status = workload.get("status") or {}
    admission = status.get("admission") or {}
    flavors = sorted({f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()})
    common = dict(workload=(workload.get("metadata") or {}).get("name"), cluster_queue=admission.get("clusterQueue"),
                  flavors=tuple(flavors), queue_missing=queue_missing)
    admitted = conditions.get("Admitted") or {}
    if admitted.get("status") == "True":
        return Admission(admitted=True, reason="Admitted", message=str(admitted.get("message") or ""), **common)
    evicted = conditions.get("Evicted") or {}
    if evicted.get("status") == "True":
        return Admission(admitted=False, reason=str(evicted.get("reason") or "Evicted"),
                         message=str(evicted.get("message") or ""), **common)
    reserved = conditions.get("QuotaReserved") or {}
    if reserved.get("status") == "True":
        return Admission(admitted=False, reason="QuotaReserved",
                         message=str(reserved.get("message") or "quota reserved; waiting for admission checks"), **common)
    if reserved:
        return Admission(admitted=False, reason=str(reserved.get("reason") or "Pending"),
                         message=str(reserved.get("message") or ""), **common)
    return Admission(admitted=False, reason="Pending", message="Kueue has not looked at its Workload yet", **common)
