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
from typing import Any

from pydantic import ValidationError

from . import api
from .rendering.renderer import ATTEMPT_LABEL, QUEUE_LABEL

log = logging.getLogger("finetune_operator.children")

# The full PlanStatus of the attempt, as JSON: lets a lost status be rebuilt from the child.
PLAN_STATUS_ANNOTATION = "finetune.dev/plan-status"
# Set when the operator suspended the child for spec.suspend. A suspended child without it
# was suspended by someone else (a queueing system such as Kueue): never un-suspended by us.
SUSPENDED_BY_ANNOTATION = "finetune.dev/suspended-by"
SUSPENDED_BY_US = "finetune-operator"


@dataclass(frozen=True)
class Child:
    """One attempt's training job as the cluster shows it."""

    attempt: int
    name: str
    state: str  # Pending | Running | Succeeded | Failed
    suspended: bool
    suspended_by_us: bool
    queue: str | None  # the queue label, when a queueing system admits it
    plan: api.PlanStatus | None  # from the annotation; None when missing or unreadable
    body: dict[str, Any]

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


def pytorch_job_state(pj: dict[str, Any]) -> str:
    """Succeeded, Failed, Running or Pending, from the PyTorchJob's conditions."""
    conditions = {c.get("type"): c.get("status") for c in ((pj.get("status") or {}).get("conditions") or [])}
    for state in ("Succeeded", "Failed", "Running"):
        if conditions.get(state) == "True":
            return state
    return "Pending"


def child_of_pytorch_job(pj: dict[str, Any]) -> Child | None:
    """The Child a PyTorchJob stands for; None when it carries no readable attempt label."""
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
    run_policy = (pj.get("spec") or {}).get("runPolicy") or {}
    return Child(
        attempt=attempt,
        name=meta.get("name", ""),
        state=pytorch_job_state(pj),
        suspended=bool(run_policy.get("suspend")),
        suspended_by_us=annotations.get(SUSPENDED_BY_ANNOTATION) == SUSPENDED_BY_US,
        queue=labels.get(QUEUE_LABEL),
        plan=plan,
        body=pj,
    )


def plan_annotation(plan: api.PlanStatus) -> str:
    return json.dumps(plan.model_dump(mode="json", by_alias=True, exclude_none=True), separators=(",", ":"), sort_keys=True)
