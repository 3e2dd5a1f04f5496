"""The memory levers of a lean trainer as planner freedoms (issue 13).

A job fixes a lever (the API field is set) or leaves it to the planner (`auto` / unset). The
planner enumerates the lever settings the job allows and combinations.py accepts, sizes each,
and ranks them with everything else: the cheapest plan wins, and at equal cost the plan that
gives up less (`quality_cost`): fp32 master weights before bf16, no optimizer step in
backward (which turns clipping off) before it, no activation offloading (PCIe traffic)
before it. The chunked loss costs nothing in quality (the same loss), so `auto` simply uses
it (torchtune's 8 chunks) unless the model transforms its logits after the head.
"""

from __future__ import annotations

from itertools import product
from typing import NamedTuple

from finetune_trainer.combinations import Choices, allows

# What `training.lossChunks: auto` means.
AUTO_LOSS_CHUNKS = 8
# What a lever gives up, for the tie-break between plans of equal cost (higher: worse).
QUALITY_COST = {
    "activation_offloading": 1,  # time (host transfers), nothing of the result
    "optimizer_in_backward": 2,  # no gradient clipping
    "master_weights": 4,  # the low bits of each update (rounding compensates in part)
}


class Levers(NamedTuple):
    """One setting of the levers (the TrainingSetup / TrainerConfig fields of the same names)."""

    master_weights: str = "fp32"
    update_rounding: str = "nearest"
    optimizer_in_backward: bool = False
    loss_chunks: int = 1
    activation_offloading: bool = False

    def setup_fields(self) -> dict:
        return self._asdict()

    @property
    def quality_cost(self) -> int:
        cost = 0
        if self.master_weights == "bf16":
            cost += QUALITY_COST["master_weights"]
        if self.optimizer_in_backward:
            cost += QUALITY_COST["optimizer_in_backward"]
        if self.activation_offloading:
            cost += QUALITY_COST["activation_offloading"]
        return cost

    def words(self, chunks: bool = True) -> list[str]:
        """The levers in use, as a person reads them (`chunks`: name the chunked loss too; the
        planner's reasons leave it out, as it is the same loss and on by default)."""
        parts = []
        if self.master_weights == "bf16":
            rounding = "" if self.update_rounding == "nearest" else f", {self.update_rounding} rounding"
            parts.append(f"bf16 master weights{rounding}")
        if self.optimizer_in_backward:
            parts.append("optimizer step in backward")
        if chunks and self.loss_chunks > 1:
            parts.append(f"loss in {self.loss_chunks} chunks")
        if self.activation_offloading:
            parts.append("activation offloading")
        return parts


NO_LEVERS = Levers()


class LeverAsk(NamedTuple):
    """What the job allows of each lever: the fixed value, or the values the planner may try."""

    master_weights: tuple[str, ...] = ("fp32",)
    update_rounding: str | None = "nearest"  # None: auto (stochastic with bf16 AdamW, nearest otherwise)
    optimizer_in_backward: tuple[bool, ...] = (False,)
    loss_chunks: int = 1
    activation_offloading: tuple[bool, ...] = (False,)
    fixed: frozenset = frozenset()  # lever fields the job sets itself (not changes the plan makes)


def lever_ask(training, method: str, logit_transform: bool) -> LeverAsk:
    """The lever ranges of a spec.training (api.TrainingSpec) for `method`."""
    fixed = set()
    if training.master_weights == "auto":
        full_bf16 = method == "full" and training.precision == "bf16"
        masters = ("fp32", "bf16") if full_bf16 else ("fp32",)
    else:
        masters = (training.master_weights,)
        fixed.add("master_weights")
    rounding = None if training.update_rounding == "auto" else training.update_rounding
    if training.optimizer_in_backward is None:
        oib = (False, True)
    else:
        oib = (training.optimizer_in_backward,)
        fixed.add("optimizer_in_backward")
    if training.loss_chunks == "auto":
        chunks = 1 if logit_transform else AUTO_LOSS_CHUNKS
    else:
        chunks = training.loss_chunks
        fixed.add("loss_chunks")
    if training.activation_offloading is None:
        offloading = (False, True)
    else:
        offloading = (training.activation_offloading,)
        fixed.add("activation_offloading")
    return LeverAsk(masters, rounding, oib, chunks, offloading, frozenset(fixed))


def lever_options(ask: LeverAsk, base: Choices, *, accumulation_one: bool) -> tuple[Levers, ...]:
    """Every lever setting the job allows with `base` (method, strategy, offload, optimizer,
    precision, checkpointing...), as combinations.py accepts it. `accumulation_one`: whether
    this group can run with gradient accumulation 1 (the optimizer step in backward needs it)."""
    found = []
    for master, oib, offloading in product(ask.master_weights, ask.optimizer_in_backward, ask.activation_offloading):
        if oib and not accumulation_one:
            continue
        rounding = ask.update_rounding
        if rounding is None:
            rounding = "stochastic" if (master == "bf16" and base.optimizer == "adamw") else "nearest"
        levers = Levers(master, rounding, oib, ask.loss_chunks, offloading)
        choices = base.but(master_weights=master, update_rounding=rounding, optimizer_in_backward=oib,
                           gradient_accumulation=1 if oib else base.gradient_accumulation,
                           gradient_clipping=False if oib else base.gradient_clipping,
                           activation_offloading=offloading, chunked_loss=ask.loss_chunks > 1)
        if allows(choices):
            found.append(levers)
    return tuple(found)


def lever_changes(levers: Levers, fixed: frozenset) -> tuple[str, ...]:
    """The levers a plan turns on that the job did not ask for (the chunked loss changes nothing)."""
    out = []
    if levers.master_weights == "bf16" and "master_weights" not in fixed:
        out.append("bf16 master weights")
    if levers.optimizer_in_backward and "optimizer_in_backward" not in fixed:
        out.append("optimizer step in backward")
    if levers.activation_offloading and "activation_offloading" not in fixed:
        out.append("activation offloading")
    return tuple(out)
