"""A FineTuneJob's status as the shell reads it and writes it: read tolerantly (a status with plans
another operator version wrote is salvaged without them, the children rebuild them), and written
through one function that derives the fields `kubectl get` shows.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from .. import api, progress
from ..summary import status_reason

# Named as when this code was shell/controller.py: log lines (and filters on them) keep their logger name.
log = logging.getLogger("finetune_operator.controller")


def read_status(raw: Any) -> tuple[api.FineTuneJobStatus | None, str | None]:
    """The status as the operator's model, read tolerantly (unknown keys are ignored); or None
    and what is wrong, when a field the operator relies on cannot be understood."""
    if not isinstance(raw, dict):
        return None, "status is not an object"
    try:
        return api.FineTuneJobStatus.model_validate(raw), None
    except ValidationError as error:
        first = error.errors(include_url=False)[:3]
        problem = "; ".join(f"status.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in first)
    # Plans are the one part that can be rebuilt (each child carries its plan): read the rest
    # without the plans that cannot be understood (e.g. written in another operator version's shape).
    salvaged = dict(raw)
    if not _readable_plan(salvaged.get("plan")):
        salvaged.pop("plan", None)
    if isinstance(salvaged.get("attempts"), list):
        salvaged["attempts"] = [
            {k: v for k, v in a.items() if k != "plan"} if isinstance(a, dict) and not _readable_plan(a.get("plan")) else a
            for a in salvaged["attempts"]]
    try:
        status = api.FineTuneJobStatus.model_validate(salvaged)
    except ValidationError:
        return None, problem
    log.warning("status read without the plans it could not understand (%s); they are rebuilt from the children", problem)
    return status, None


def _readable_plan(plan: Any) -> bool:
    if plan is None:
        return True
    try:
        api.PlanStatus.model_validate(plan)
    except ValidationError:
        return False
    return True


def status_json(status: api.FineTuneJobStatus) -> dict[str, Any]:
    """The status as written: every write goes through here, so the one-word reason that
    `kubectl get` shows (summary.status_reason, derived from the conditions) is never stale."""
    return status.model_copy(update={"reason": status_reason(status), "progress": progress.for_status(status)}).model_dump(
        mode="json", by_alias=True, exclude_none=True)
