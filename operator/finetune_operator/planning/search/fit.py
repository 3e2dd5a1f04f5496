"""Stage 3 of the plan search: filter what fits.

A group fits at a micro-batch when its required bytes (the memory estimate, times the calibration
factor) are at most the GPU memory the plan may fill (after headroom), the pod's host memory (per-rank
host bytes x ranks per node, or the export's, plus its other containers' requests) fits the node's
allocatable memory (when the pool says what that is), and, when the job evaluates at its own
micro-batch, that evaluation fits beside what the setup keeps resident.

Memory rises with the micro-batch and cost falls with it, so the best micro-batch of a group is the
largest that fits: a binary search (`Fit.largest`), whose result is cached per (setup, usable memory,
host memory), so same-GPU pools in other regions cost nothing extra; the weights alone are checked
first, which saves sizing setups that cannot fit whatever their micro-batch. What does not fit is
noted in `Stats` (how close it came, and what would have cost less) for the reason and the
infeasible message. `Fit.every` sizes every micro-batch instead (exhaustive_plan). A fitting
micro-batch becomes a `Candidate`, costed by the estimate stage; which groups are offered to this
stage at all is the choice stage's branch and bound (choose.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from finetune_trainer.memory_levers import eval_micro_batch

from ...sizing import SizingError
from ..plan import PlanKey
from .ask import Ask
from .estimate import Costs, EstimateFacts, Estimates
from .space import Group, Stats, changes, key_of

FitResult = tuple[int | None, str | None, EstimateFacts | None]
# Why a group is left out when its own eval micro-batch does not fit (the job's NoFit message counts these).
EVAL_MISFIT = "GPU memory (evaluation.microBatchSize)"


@dataclass(frozen=True)
class Candidate:
    """A group at a micro-batch that fits, with its cost."""

    group: Group
    micro: int
    facts: EstimateFacts
    seconds_per_step: float
    cost_per_step: float  # ranking cost (GPU-hours x ranking price)
    needs_scale_up: bool
    changes: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.group.world

    @property
    def wait_share(self) -> float:
        """How long it would wait for its pool (NodePool.wait_share; 0: starts now)."""
        return self.group.pool.wait_share(self.group.nodes, self.group.gpus_per_node)

    def key(self, ask: Ask) -> PlanKey:
        return key_of(ask, self.group, self.micro)


def fits(ask: Ask, group: Group, facts: EstimateFacts, calibration: float) -> str | None:
    """None when the setup fits the pool; else which memory does not."""
    if facts.required_bytes * calibration > group.usable:
        return "gpu"
    host = node_host_bytes(ask, facts, group.gpus_per_node)
    if group.pool.host_memory_bytes and host > group.pool.host_memory_bytes:
        return "host"
    return None


def pod_host_bytes(ask: Ask, facts: EstimateFacts, gpus_per_node: int) -> int:
    """Host memory of one pod, its memory request and limit: its training processes', or the export's
    (on rank 0, after the others exited) where that is more."""
    return max(facts.host_bytes_per_rank * gpus_per_node, ask.export_host_bytes)


def node_host_bytes(ask: Ask, facts: EstimateFacts, gpus_per_node: int) -> int:
    """Host memory a node must have for the pod: its training container's and what its other
    containers request (the upload sidecar)."""
    return pod_host_bytes(ask, facts, gpus_per_node) + ask.pod_extra_host_bytes


def weights_floor(ask: Ask, group: Group) -> float:
    """Bytes of weights every GPU holds whatever else it holds: a floor under any estimate.

    Checking it first saves sizing setups whose weights alone do not fit (most of a 70B model's
    setups on small GPUs). tests/planning/test_search.py checks it stays under the sizing model
    for every preset, method, strategy and offload.
    """
    per_param = 0.5 if ask.method == "qlora" else (4 if ask.precision == "fp32" else 2)
    floor = per_param * ask.arch.total_params
    if group.strategy in ("fsdp", "zero3"):
        return 0.0 if group.offload == "optimizer+params" else floor / group.world
    return floor


class Fit:
    """What fits of the groups offered, for one search: sized through `estimates`, costed through
    `costs`, never a plan in `excluded` (plans that failed before), misses noted in `stats`."""

    def __init__(self, ask: Ask, estimates: Estimates, costs: Costs, calibration: float, excluded: set[PlanKey],
                 stats: Stats) -> None:
        self.ask = ask
        self.estimates = estimates
        self.costs = costs
        self.calibration = calibration
        self.excluded = excluded
        self.stats = stats
        self.cache: dict[tuple, FitResult] = {}  # per Group.fit_key

    def candidate(self, group: Group, micro: int, facts: EstimateFacts) -> Candidate:
        seconds, cost = self.costs.of(group, micro)
        scale_up = not group.pool.fits_now(group.nodes, group.gpus_per_node)
        return Candidate(group, micro, facts, seconds, cost, scale_up, changes(self.ask, group))

    def largest(self, group: Group, bound: float) -> Candidate | None:
        """The group at its largest micro-batch that fits and has not failed before, or None (noted
        in `stats`). `bound`: the group's cost at its largest micro-batch."""
        ask, stats, calibration, micros = self.ask, self.stats, self.calibration, group.micros

        def probe(i: int) -> EstimateFacts | SizingError:
            return self.estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micros[i],
                                      group.levers)

        key = group.fit_key()
        cached = self.cache.get(key)
        if cached is None:
            why_not = self.eval_misfit(group)
            cached = self.cache[key] = (None, why_not, None) if why_not else fit_index(ask, group, probe, calibration)
        index, why, first = cached
        if index is None:
            self.note_miss(group, why, first, bound)
            return None
        # Recovery: skip micro-batches of plans that already failed (smaller ones fit too).
        for i in range(index, -1, -1):
            if self.excluded and key_of(ask, group, micros[i]) in self.excluded:
                stats.reject("excluded (failed before)")
                continue
            facts = probe(i)
            if isinstance(facts, SizingError):
                return None
            return self.candidate(group, micros[i], facts)
        return None

    def note_miss(self, group: Group, why: str | None, first: EstimateFacts | None, bound: float) -> None:
        """Note in `stats` why the group does not fit at any micro-batch, and how close it came."""
        ask, stats, calibration = self.ask, self.stats, self.calibration
        if why == "unsupported":
            stats.reject("setup not supported")
            return
        if why == "eval":
            stats.reject(EVAL_MISFIT)
            return
        stats.reject("host memory" if why == "host" else "GPU memory")
        if why == "gpu" and first is None:  # rejected on the weights alone, without sizing
            ratio = weights_floor(ask, group) * calibration / group.usable
            if stats.closest_floor is None or ratio < stats.closest_floor[0]:
                stats.closest_floor = (ratio, group)
        elif why == "gpu" and first is not None:
            required = int(first.required_bytes * calibration)
            ratio = required / group.usable
            if stats.closest is None or ratio < stats.closest[0]:
                stats.closest = (ratio, group, group.micros[0], required, group.usable)
            # With its cost bound: the plan's reason names the cheaper setup that came closest to fitting.
            stats.gpu_misses.append((bound, group, required, group.usable))
        elif why == "host" and first is not None:
            needed = node_host_bytes(ask, first, group.gpus_per_node)
            ratio = needed / group.pool.host_memory_bytes
            if stats.closest_host is None or ratio < stats.closest_host[0]:
                stats.closest_host = (ratio, group, needed, group.pool.host_memory_bytes)

    def every(self, group: Group) -> list[Candidate]:
        """The group at every micro-batch that fits and has not failed before (exhaustive_plan)."""
        ask = self.ask
        why_not = self.eval_misfit(group)
        if why_not is not None:
            self.stats.reject(EVAL_MISFIT if why_not == "eval" else "setup not supported")
            return []
        found = []
        for micro in group.micros:
            facts = self.estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micro,
                                       group.levers)
            if isinstance(facts, SizingError):
                self.stats.reject("setup not supported")
                break
            if fits(ask, group, facts, self.calibration) is None:
                c = self.candidate(group, micro, facts)
                if c.key(ask) not in self.excluded:
                    found.append(c)
        return found

    def eval_misfit(self, group: Group) -> str | None:
        """Why the group cannot evaluate at the job's own eval micro-batch ("eval", "unsupported"), or None
        (it can, or the job evaluates at the training micro-batch, which the step's estimate covers). A
        group that splits sequences over GPUs evaluates them whole, one at a time unless the job names its
        eval micro-batch (the trainer's eval_micro_batch): the step's estimate does not cover that."""
        micro = eval_micro_batch(self.ask.eval_micro_batch, None, group.levers) if self.ask.evaluates else None
        if micro is None:
            return None
        need = self.estimates.eval_required(group.world, group.strategy, group.offload, group.levers, micro)
        if isinstance(need, SizingError):
            return "unsupported"
        return "eval" if need * self.calibration > group.usable else None


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
