"""The adjustment ladder's rungs, in the API's order, and what each lets the planner change
(adjust.py's docstring says why this order)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import api
from finetune_trainer.memory_levers import LEVERS, by_rung


@dataclass(frozen=True)
class Rung:
    name: str  # as in spec.recovery.allowedAdjustments
    knobs: frozenset[str]  # what this rung lets the planner change


# What each rung lets the planner change: the other adjustments' knobs here, each lever's own
# field for its rung (memory_levers). The order is the API's (api.ADJUSTMENTS); hostMemory is no
# rung of this ladder: it is the remedy of a host OOM (`host_oom.after_host_oom`).
_KNOBS: dict[str, frozenset[str]] = {
    "gradientCheckpointing": frozenset({"gradient_checkpointing"}),
    "microBatch": frozenset({"micro_batch_size"}),
    "sharding": frozenset({"strategy"}),
    "optimizer8bit": frozenset({"optimizer"}),
    "offload": frozenset({"offload"}),
    "moreGPUs": frozenset({"gpus", "node_pool"}),
    "method": frozenset({"method"}),
    **{lever.rung: frozenset({lever.name}) for lever in LEVERS if lever.rung is not None},
}
LADDER: tuple[Rung, ...] = tuple(Rung(name, _KNOBS[name]) for name in api.ADJUSTMENTS if name != "hostMemory")
# The levers in the order the ladder frees them (how a change lists them).
LEVERS_BY_RUNG = by_rung(rung.name for rung in LADDER)
