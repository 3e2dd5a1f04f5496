"""What every document of the contract shares: camelCase on the wire, the failure reasons and
the exit codes the trainer signals them with (the failure vocabulary's, `failures.py`), the phases."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from ..failures import EXIT_OK, FAILURES, TRAINER_REPORTED, FailureKind


DEFAULT_CONFIG_PATH = "/etc/finetune/config.json"
DEFAULT_REPORT_PATH = "/dev/termination-log"
# The kubelet truncates the termination message at 4096 bytes; stay within it so the
# JSON is never cut in the middle.
TERMINATION_MESSAGE_LIMIT = 4096

# The trainer's name for the one failure vocabulary: a report carries one of the kinds the
# trainer reports itself (failures.TRAINER_REPORTED).
FailureReason = FailureKind


class Phase(str, Enum):
    SETUP = "setup"
    LOAD = "load"
    DATA = "data"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    CHECKPOINT = "checkpoint"
    EXPORT = "export"  # after training: the merged or full folder (export.py)


EXIT_CODE_FOR_REASON: dict[FailureReason, int] = {
    kind: FAILURES[kind].exit_code for kind in TRAINER_REPORTED  # type: ignore[misc]
}
_REASON_FOR_EXIT_CODE = {code: reason for reason, code in EXIT_CODE_FOR_REASON.items()}


def reason_for_exit_code(exit_code: int) -> FailureReason | None:
    """The failure reason our trainer signals with ``exit_code``.

    ``None`` for 0 (success). Every other code that is not one of ours, including
    137 and 143, gives ``Unknown``: a signal death is not something the trainer
    reported, and the operator must look at the container's ``reason`` (``OOMKilled``)
    to tell a kernel OOM kill from any other kill.
    """
    if exit_code == EXIT_OK:
        return None
    return _REASON_FOR_EXIT_CODE.get(exit_code, FailureReason.UNKNOWN)


class Contract(BaseModel):
    """camelCase on the wire (matching the FineTuneJob API), snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="forbid",
    )



def json_object(text: str | None) -> dict[str, Any] | None:
    if not text or not text.strip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
