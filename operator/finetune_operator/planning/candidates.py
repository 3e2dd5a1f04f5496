"""Finding the plans that fit: the groups of the job's space, sized and costed.

Memory does not depend on the pool, so estimates are cached per setup (estimates.py). Cost falls
as the micro-batch grows (better utilisation, fewer all-gathers) and memory rises with it, so the
best micro-batch of a group is the largest that fits: a binary search, whose result is cached per
(setup, usable memory, host memory), so same-GPU pools in other regions cost nothing extra.
Which groups are sized at all is bound.py's branch and bound.

`exhaustive=True` sizes every micro-batch of every group instead: tests and bench/planner.py
check that both choose the same plan.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from finetune_trainer.memory_levers import LEVERS

from ..sizing import SizingError
from .bound import bounded_search
from .choice import choose_cheapest_or_startable
from .estimates import EstimateFacts, Estimates
from .plan import PlanKey
from .pools import NodePool
from .space import Ask, Candidate, Group, Stats, changes, fits, groups, key_of, node_host_bytes, weights_floor
from .throughput import PCIE_GBYTES, JobWork, accumulation_steps, combine, compute_and_communication, offload_costs

FitResult = tuple[int | None, str | None, EstimateFacts | None]
# Why a group is left out when its own eval micro-batch does not fit (the job's NoFit message counts these).
EVAL_MISFIT = "GPU memory (evaluation.microBatchSize)"


class Costs:
    """Seconds and ranking cost per step of a group at a micro-batch. Compute and communication do
    not depend on offload, so the offload variants of a group share them."""

    def __init__(self, work: JobWork, arch: Any = None) -> None:
        self.work = work
        self.arch = arch  # for the levers' host transfers
        self.shared: dict[tuple, tuple[float, float]] = {}

    def of(self, group: Group, micro: int) -> tuple[float, float]:
        key = (id(group.pool), group.nodes, group.gpus_per_node, group.strategy, group.checkpointing, micro)
        parts = self.shared.get(key)
        if parts is None:
            parts = self.shared[key] = compute_and_communication(
                self.work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, strategy=group.strategy,
                gradient_checkpointing=group.checkpointing, micro_batch_size=micro, tflops=group.tflops,
            )
        transfers, cpu_step = offload_costs(
            self.work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, offload=group.offload,
            gradient_checkpointing=group.checkpointing, micro_batch_size=micro,
        )
        lever_bytes = [lever.host_transfer_bytes(self.arch, micro, self.work.sequence_length)
                       for lever in LEVERS if lever.host_transfer_bytes is not None and lever.in_use(group.levers)]
        if lever_bytes:
            transfers += self.lever_transfers(group, micro, sum(lever_bytes))
        seconds = combine(parts[0], parts[1], transfers, cpu_step)
        return seconds, seconds * group.world / 3600 * group.price

    def lever_transfers(self, group: Group, micro: int, per_micro: float) -> float:
        """Seconds per step of the levers' host traffic (Lever.host_transfer_bytes: activation
        offloading's block inputs out in forward and back in backward), each micro-batch, over the
        GPU's PCIe link (hidden by compute as far as `combine` lets traffic hide)."""
        return accumulation_steps(self.work, group.world, micro) * per_micro / (PCIE_GBYTES * 1e9)


def find(
    ask: Ask,
    pools: Sequence[NodePool],
    work: JobWork,
    estimates: Estimates,
    excluded: set[PlanKey],
    calibration: float,
    *,
    exhaustive: bool,
) -> tuple[list[Candidate], Stats]:
    """The candidates of the job's space on `pools` (the best micro-batch of each group, or every
    micro-batch when `exhaustive`), and what the search saw."""
    stats = Stats()
    costs = Costs(work, ask.arch)

    def candidate(group: Group, micro: int, facts: EstimateFacts) -> Candidate:
        seconds, cost = costs.of(group, micro)
        scale_up = not group.pool.fits_now(group.nodes, group.gpus_per_node)
        return Candidate(group, micro, facts, seconds, cost, scale_up, changes(ask, group))

    space = groups(ask, pools, stats)
    if not exhaustive:
        fit_cache: dict[tuple, FitResult] = {}
        found = bounded_search(
            ask, space,
            bound_of=lambda g: costs.of(g, g.micros[-1])[1],
            size=lambda g, bound: largest_fitting_micro(ask, g, estimates, calibration, excluded, stats, bound,
                                                        fit_cache),
            candidate=candidate,
            choose=lambda found: leader(found, ask.cost_window),
            stats=stats,
        )
        return found, stats
    found = []
    for group in space:
        stats.groups_visited += 1
        why_not = eval_misfit(ask, group, estimates, calibration)
        if why_not is not None:
            stats.reject(EVAL_MISFIT if why_not == "eval" else "setup not supported")
            continue
        for micro in group.micros:
            facts = estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micro, group.levers)
            if isinstance(facts, SizingError):
                stats.reject("setup not supported")
                break
            if fits(ask, group, facts, calibration) is None:
                c = candidate(group, micro, facts)
                if c.key(ask) not in excluded:
                    found.append(c)
    return found, stats


def largest_fitting_micro(
    ask: Ask,
    group: Group,
    estimates: Estimates,
    calibration: float,
    excluded: set[PlanKey],
    stats: Stats,
    bound: float,
    fit_cache: dict[tuple, FitResult],
) -> tuple[int, EstimateFacts] | None:
    """The group's largest micro-batch that fits and has not failed before, or None (noted in `stats`).
    `bound`: the group's cost at its largest micro-batch."""
    micros = group.micros

    def probe(i: int) -> EstimateFacts | SizingError:
        return estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micros[i], group.levers)

    key = group.fit_key()
    cached = fit_cache.get(key)
    if cached is None:
        why_not = eval_misfit(ask, group, estimates, calibration)
        cached = fit_cache[key] = (None, why_not, None) if why_not else fit_index(ask, group, probe, calibration)
    index, why, first = cached
    if index is None:
        if why == "unsupported":
            stats.reject("setup not supported")
            return None
        if why == "eval":
            stats.reject(EVAL_MISFIT)
            return None
        stats.reject("host memory" if why == "host" else "GPU memory")
        if why == "gpu" and first is None:  # rejected on the weights alone, without sizing
            ratio = weights_floor(ask, group) * calibration / group.usable
            if stats.closest_floor is None or ratio < stats.closest_floor[0]:
                stats.closest_floor = (ratio, group)
        elif why == "gpu" and first is not None:
            required = int(first.required_bytes * calibration)
            ratio = required / group.usable
            if stats.closest is None or ratio < stats.closest[0]:
                stats.closest = (ratio, group, micros[0], required, group.usable)
            # With its cost bound: the plan's reason names the cheaper setup that came closest to fitting.
            stats.gpu_misses.append((bound, group, required, group.usable))
        elif why == "host" and first is not None:
            needed = node_host_bytes(ask, first, group.gpus_per_node)
            ratio = needed / group.pool.host_memory_bytes
            if stats.closest_host is None or ratio < stats.closest_host[0]:
                stats.closest_host = (ratio, group, needed, group.pool.host_memory_bytes)
        return None
    # Recovery: skip micro-batches of plans that already failed (smaller ones fit too).
    for i in range(index, -1, -1):
        if excluded and key_of(ask, group, micros[i]) in excluded:
            stats.reject("excluded (failed before)")
            continue
        facts = probe(i)
        if isinstance(facts, SizingError):
            return None
        return micros[i], facts
    return None


def eval_misfit(ask: Ask, group: Group, estimates: Estimates, calibration: float) -> str | None:
    """Why the group cannot evaluate at the job's own eval micro-batch ("eval", "unsupported"), or None
    (it can, or the job evaluates at the training micro-batch, which the step's estimate covers)."""
    if ask.eval_micro_batch is None:
        return None
    need = estimates.eval_required(group.world, group.strategy, group.offload, group.levers)
    if isinstance(need, SizingError):
        return "unsupported"
    return "eval" if need * calibration > group.usable else None


def fit_index(ask: Ask, group: Group, probe: Callable[[int], Any], calibration: float) -> FitResult:
    """(index of the largest micro-batch that fits, None) or (None, why the smallest does not, its estimate).

    The weights floor is checked first: it saves sizing setups whose weights alone do not fit (most
    of a 70B model's setups on small GPUs)."""
    if weights_floor(ask, group) * calibration > group.usable:
        return None, "gpu", None
    first = probe(0)
    if isinstance(first, SizingError):
        return None, "unsupported", None
    why = fits(ask, group, first, calibration)
    if why is not None:
        return None, why, first
    # Memory grows with the micro-batch: binary search the largest that fits.
    lo, hi = 0, len(group.micros) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        facts = probe(mid)
        if not isinstance(facts, SizingError) and fits(ask, group, facts, calibration) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo, None, first


def leader(found: list[Candidate], window: float) -> Candidate:
    """The winner: choice.py's rule over the candidates."""
    return choose_cheapest_or_startable(found, cost=lambda c: c.cost_per_step, startable=lambda c: not c.needs_scale_up,
                                        tie_break=Candidate.rank_key, window=window, wait=lambda c: c.wait_share)


def choose(found: list[Candidate], window: float) -> tuple[Candidate, list[Candidate]]:
    """The winner (choice.py's rule over the candidates) and the others, cheapest first."""
    winner = leader(found, window)
    others = sorted((c for c in found if c is not winner), key=lambda c: (c.cost_per_step, c.rank_key()))
    return winner, others
