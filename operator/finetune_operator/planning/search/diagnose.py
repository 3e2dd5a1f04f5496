"""After the choice, when there is nothing to choose: why nothing fits. The nearest miss, the
memory that stopped it, and the one constraint whose lifting would let the job fit (more GPUs, a
fixed setting, the named pool, the GPU types, or another region), found by running the search
(choose.find) again with that constraint lifted."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from finetune_trainer.combinations import OFFLOADS, strategies_for

from ...sizing import SizingError
from ..plan import Infeasible, PlanKey
from ..pools import NodePool
from .ask import Ask
from .choose import choose, find
from .estimate import Estimates, JobWork
from .explain import gib, setup_words, shape
from .fit import EVAL_MISFIT, weights_floor
from .space import Stats, divisors, pools_for


def infeasible(ask: Ask, all_pools: Sequence[NodePool], considered: Sequence[NodePool], work: JobWork,
               estimates: Estimates, excluded: set[PlanKey], calibration: float, window: float,
               stats: Stats) -> Infeasible:
    parts = []
    biggest = max(considered, key=lambda p: p.max_gpus)
    if ask.gpus is not None and ask.global_batch_size % ask.gpus:
        parts.append(
            f"spec.resources.gpus: {ask.gpus} GPUs cannot share globalBatchSize {ask.global_batch_size} evenly"
            " (micro-batch x accumulation x GPUs must equal it)"
        )
    elif ask.gpus is not None and ask.gpus > biggest.max_gpus:
        parts.append(
            f"spec.resources.gpus: {ask.gpus} GPUs is more than any allowed pool gives (the most:"
            f" {biggest.name}, {biggest.max_nodes} nodes x {biggest.gpus_per_node} = {biggest.max_gpus})"
        )
    elif stats.closest is not None or stats.closest_floor is not None:
        closest = stats.closest
        if stats.closest_floor is not None and (closest is None or stats.closest_floor[0] < closest[0]):
            # Rejected on its weights alone: size it now, for the message.
            group = stats.closest_floor[1]
            facts = estimates.get(group.world, group.strategy, group.offload, group.checkpointing, group.micros[0],
                                  group.levers)
            if not isinstance(facts, SizingError):
                required = int(facts.required_bytes * calibration)
                if closest is None or required / group.usable < closest[0]:
                    closest = (required / group.usable, group, group.micros[0], required, group.usable)
        assert closest is not None or stats.closest_floor is not None
        if closest is None:  # the floor's setup could not be sized: say what is known
            group = stats.closest_floor[1]
            floor = int(weights_floor(ask, group) * calibration)
            closest = (0.0, group, group.micros[0], floor, group.usable)
        _, group, micro, required, usable = closest
        gpus = "1 GPU" if group.world == 1 else f"{group.world} GPUs"
        parts.append(
            f"needs {gib(required)} per GPU on {gpus} at best ({setup_words(group, micro)} on {group.pool.name});"
            f" {group.pool.gpu_type} gives {gib(usable)} usable"
        )
    elif stats.rejected:
        parts.append("no candidate is left: " + "; ".join(f"{why} ({n})" for why, n in sorted(stats.rejected.items())))
    else:
        parts.append("no candidate is left")
    evaluation = stats.rejected.get(EVAL_MISFIT, 0)
    if evaluation:
        # Checked before a group's training is sized: its closest miss above may be another setup.
        parts.append(
            f"{evaluation} setups were left out because their evaluation does not fit (at evaluation.microBatchSize;"
            " a sequence the plan splits over GPUs is evaluated whole, one at a time): drop spec.evaluation, or"
            " evaluate shorter sequences")
    if stats.closest_host is not None:
        _, group, needed, there = stats.closest_host
        parts.append(
            f"{stats.rejected.get('host memory', 0)} setups fit in GPU memory but not in host memory: the closest"
            f" ({shape(group)} on {group.pool.name}, {setup_words(group)}) needs {gib(needed)} per pod,"
            f" its nodes have {gib(there)}"
        )
    suggestion = relaxed_suggestion(ask, all_pools, work, estimates, excluded, calibration, window)
    if suggestion:
        parts.append(suggestion)
    nearest = parts[0]
    return Infeasible(
        message="nothing fits: " + "; ".join(parts),
        allowed_regions=list(ask.regions),
        nearest_miss=nearest,
        rejected=dict(stats.rejected),
    )


def relaxed_suggestion(ask: Ask, all_pools: Sequence[NodePool], work: JobWork, estimates: Estimates,
                       excluded: set[PlanKey], calibration: float, window: float) -> str | None:
    """Try lifting one constraint at a time; say what would fit and which constraint stops it."""
    biggest = max((p.max_gpus for p in all_pools), default=1)
    relaxations: list[tuple[Ask, str, bool]] = []  # (relaxed ask, what stops it, search all regions)
    # More GPUs: the smallest count that fits is the suggestion, so try the counts in turn.
    stopper = f"gpus is fixed at {ask.gpus}" if ask.gpus is not None else f"maxGPUs is {ask.max_gpus}"
    for count in divisors(ask.global_batch_size):
        if ask.max_gpus < count <= biggest:
            relaxations.append((replace(ask, gpus=None, max_gpus=count), stopper, False))
    fixed = []
    if ask.fixed_strategy:
        fixed.append("strategy")
    if ask.fixed_offload:
        fixed.append("offload")
    if ask.fixed_checkpointing:
        fixed.append("gradientCheckpointing")
    if ask.micro_batch_size is not None:
        fixed.append("microBatchSize")
    if fixed:
        relaxations.append((
            replace(ask, strategies=strategies_for(ask.method, ask.precision, ask.optimizer), offloads=OFFLOADS, checkpointing=(False, True), micro_batch_size=None,
                    fixed_strategy=False, fixed_offload=False, fixed_checkpointing=False),
            "the job fixes " + ", ".join(fixed), False))
    if ask.node_pool is not None:
        relaxations.append((replace(ask, node_pool=None), f"nodePool is {ask.node_pool}", False))
    if ask.gpu_types:
        relaxations.append((replace(ask, gpu_types=()), f"gpuTypes allows only {', '.join(ask.gpu_types)}", False))
    relaxations.append((replace(ask, gpu_types=(), node_pool=None, max_gpus=max(ask.max_gpus, biggest), gpus=None),
                        "", True))
    for relaxed, stopper, any_region in relaxations:
        if any_region:
            pools = [p for p in all_pools if p.region not in ask.regions and p.max_nodes > 0]
        else:
            pools, none = pools_for(relaxed, all_pools)
            if none is not None:
                continue
        found, _ = find(relaxed, pools, work, estimates, excluded, calibration, window, exhaustive=False)
        if not found:
            continue
        winner, _ = choose(found, window)
        g = winner.group
        what = f"{shape(g)} in {g.pool.region} ({g.pool.name}, {setup_words(g, winner.micro)})"
        if any_region:
            return f"{what} would fit, but {g.pool.region} is not an allowed region"
        return f"{what} would fit but {stopper}"
    return None
