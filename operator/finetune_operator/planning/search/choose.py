"""Stage 4 of the plan search: choose. Which groups are sized at all, and which candidate wins.

The rule (`choose_cheapest_or_startable`, one rule for the planner's candidates and for recovery's
choice between finished plans): the lowest cost to finish (throughput.py; pools without a price are
ranked at the highest price among the pools considered, so a known-cheap pool never loses to an
unknown one). Costs within `COST_TIE` of the cheapest count as equal: the model is not more precise
than that. Among equals (`rank_key`): pools with enough free GPUs now first, then fewer GPUs, fewer
nodes, what the plan gives up (the levers' quality cost), fewer changes from the plain setup the
job asked for (no offload, no checkpointing unless asked, ddp), then the exact cost. With
placementPreference startTime, a plan that can start now wins over a cheaper one that must wait,
within the policy's startTimeCostMargin (`cost_window_of`).

`find` runs the stages before this one in their order: it enumerates the job's space on the pools
(space.py), prices every group (estimate.py), and offers groups to the fit stage (fit.py) in the
order of the branch and bound below, or every group at every micro-batch when `exhaustive`
(tests and bench/planner.py check that both choose the same plan).

Branch and bound: the same choice as sizing every group, with a fraction of the sizing estimates
(bench/planner.py: 66 estimates per plan instead of 418; a 1000-job burst of the scale benchmark's
jobs plans in a third of the CPU time that sizing every group takes). Cost falls as the micro-batch
grows, so a group's cost at its largest micro-batch bounds it from below. Groups are visited cheapest bound first. Once a bound passes the cheapest cost found so far
(`lowest`), no cheaper plan can appear, and a group is sized only if it could still be chosen:
  - as the best of the tie window (costs within COST_TIE of the cheapest): its tie-break prefix
    (can start now, GPUs, nodes, the levers' quality cost, changes: known before sizing it) and bound
    are no worse than the current best's first six of `rank_key`;
  - with placementPreference startTime, as a plan that can start now within the policy's margin:
    it can start now and its bound is below the current choice's cost (or the current choice
    must wait); or, while the current choice must wait, as one whose pool's queue is no longer
    (its wait share is known before sizing it);
or if its pool has no candidate yet (runners-up name the best plan of other pools; a budget of
RUNNER_UP_VISITS such groups keeps pools where nothing fits from costing every setup an estimate).
The search stops when the bound leaves the cost window and the best plans of the RUNNERS_UP + 1
cheapest pools are known (up to RUNNER_UP_SPAN times the cheapest cost).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Sequence, TypeVar

from ..plan import PlanKey
from ..policy import ClusterPolicy
from ..pools import NodePool
from .ask import Ask
from .estimate import Costs, Estimates, JobWork
from .fit import Candidate, Fit
from .space import Group, Stats, changes, groups

# Costs within this fraction of the cheapest count as equal: the cost model is not more precise.
COST_TIE = 0.01
# Runners-up named in the plan: the best plan of other pools, then another setup in the winner's pool.
RUNNERS_UP = 3
# Runners-up are looked for among plans costing at most this much more than the cheapest: beyond it
# they say little and would cost the search most of its pruning.
RUNNER_UP_SPAN = 1.5
# Groups sized only to find runners-up in other pools (they cannot change the choice): a budget,
# so that pools where nothing fits do not cost every one of their setups an estimate.
RUNNER_UP_VISITS = 80
T = TypeVar("T")


# ---------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------


def choose_cheapest_or_startable(items: Sequence[T], *, cost: Callable[[T], float], startable: Callable[[T], bool],
                                 tie_break: Callable[[T], Any], window: float,
                                 wait: Callable[[T], float] | None = None) -> T:
    """The planner's choice rule, for its own candidates and for recovery's finished plans:
    the best `tie_break` among items within COST_TIE of the cheapest; when that one must wait
    for its pool and the policy prefers starting now (`window` wider than COST_TIE, see
    `cost_window_of`), the cheapest within `window` that can start now; when none can, and
    `wait` says how long each would wait (capacity.py's queue share), the one within `window`
    that waits least, if it waits less than the cheapest: a burst of jobs then fills every
    allowed pool instead of queueing on the cheapest while the others idle."""
    lowest = min(cost(i) for i in items)
    best = min((i for i in items if cost(i) <= lowest * (1 + COST_TIE)), key=tie_break)
    if not startable(best) and window > COST_TIE:
        within = [i for i in items if cost(i) <= lowest * (1 + window)]
        now = [i for i in within if startable(i)]
        if now:
            return min(now, key=lambda i: (cost(i), tie_break(i)))
        if wait is not None:
            sooner = min(within, key=lambda i: (wait(i), cost(i), tie_break(i)))
            if wait(sooner) < wait(best):
                return sooner
    return best


def cost_window_of(policy: ClusterPolicy) -> float:
    """Costs within this fraction of the cheapest are weighed against starting now."""
    return max(COST_TIE, policy.start_time_cost_margin) if policy.placement_preference == "startTime" else COST_TIE


def rank_key(c: Candidate) -> tuple:
    """The tie-break among candidates of equal cost."""
    g = c.group
    # At equal cost: free now, fewer GPUs and nodes, then what the plan gives up (the levers'
    # quality cost: fp32 master weights before bf16...), then fewer changes.
    return (c.needs_scale_up, g.world, g.nodes, g.levers.quality_cost, len(c.changes), c.cost_per_step,
            g.order, c.micro)


def leader_of(found: list[Candidate], window: float) -> Candidate:
    """The winner: the rule over the candidates."""
    return choose_cheapest_or_startable(found, cost=lambda c: c.cost_per_step, startable=lambda c: not c.needs_scale_up,
                                        tie_break=rank_key, window=window, wait=lambda c: c.wait_share)


def choose(found: list[Candidate], window: float) -> tuple[Candidate, list[Candidate]]:
    """The winner and the others, cheapest first."""
    winner = leader_of(found, window)
    others = sorted((c for c in found if c is not winner), key=lambda c: (c.cost_per_step, rank_key(c)))
    return winner, others


# ---------------------------------------------------------------------------
# Which groups are sized
# ---------------------------------------------------------------------------


def find(ask: Ask, pools: Sequence[NodePool], work: JobWork, estimates: Estimates, excluded: set[PlanKey],
         calibration: float, window: float, *, exhaustive: bool) -> tuple[list[Candidate], Stats]:
    """The candidates of the job's space on `pools` (the best micro-batch of each group the branch
    and bound sizes, or every micro-batch of every group when `exhaustive`), and what the search saw.
    A lever the job leaves to the planner as a last resort (`Lever.last_resort`: sequence parallelism)
    is searched only when nothing fits without it."""
    first = ask.levers.first_resort()
    if first is not None:
        found, stats = _find(replace(ask, levers=first), pools, work, estimates, excluded, calibration, window,
                             exhaustive=exhaustive)
        if found:
            return found, stats
    return _find(ask, pools, work, estimates, excluded, calibration, window, exhaustive=exhaustive)


def _find(ask: Ask, pools: Sequence[NodePool], work: JobWork, estimates: Estimates, excluded: set[PlanKey],
          calibration: float, window: float, *, exhaustive: bool) -> tuple[list[Candidate], Stats]:
    stats = Stats()
    space = groups(ask, pools, stats)  # stage 1: enumerate
    costs = Costs(work, ask.arch)  # stage 2: estimate (memory through `estimates`, when sized)
    fit = Fit(ask, estimates, costs, calibration, excluded, stats)  # stage 3: what fits
    if not exhaustive:
        return bounded_search(ask, space, costs, fit, window, stats), stats
    found = []
    for group in space:
        stats.groups_visited += 1
        found.extend(fit.every(group))
    return found, stats


def bounded_search(ask: Ask, space: list[Group], costs: Costs, fit: Fit, window: float, stats: Stats) -> list[Candidate]:
    """The candidates that decide the choice and name the runners-up: the groups visited cheapest
    bound first (a group's cost at its largest micro-batch), sized by `fit` only while they could
    still be chosen or name a runner-up."""
    ordered = sorted(((costs.of(g, g.micros[-1])[1], g.order, g) for g in space), key=lambda t: (t[0], t[1]))
    pool_best: dict[str, float] = {}
    lowest = math.inf  # cost of the cheapest candidate so far: the anchor of the windows
    stop_above = math.inf
    found: list[Candidate] = []
    leader: Candidate | None = None  # the current choice
    tie_best: Candidate | None = None  # the best rank_key within COST_TIE of `lowest`
    runner_up_visits = 0
    stale = False  # found grew since leader and tie_best were worked out (they are, when needed)
    for bound, _, group in ordered:
        if bound > stop_above:
            break
        if stale and bound >= lowest:
            tie_best = min((f for f in found if f.cost_per_step <= lowest * (1 + COST_TIE)), key=rank_key)
            leader = leader_of(found, window)
            stale = False
        if leader is not None and tie_best is not None and bound >= lowest:
            # Bounds only grow from here, so `lowest` is final.
            startable = group.pool.fits_now(group.nodes, group.gpus_per_node)
            # rank_key's first five, known before sizing the group, then its bound for the cost.
            prefix = (not startable, group.world, group.nodes, group.levers.quality_cost, len(changes(ask, group)))
            could_win = (bound <= lowest * (1 + COST_TIE) and prefix + (bound,) <= rank_key(tie_best)[:6]) or (
                window > COST_TIE and startable and bound <= lowest * (1 + window)
                and (leader.needs_scale_up or bound <= leader.cost_per_step)) or (
                # nothing starts now: the shortest queue within the margin (choose_cheapest_or_startable)
                window > COST_TIE and leader.needs_scale_up and bound <= lowest * (1 + window)
                and _waits_less(group.pool.wait_share(group.nodes, group.gpus_per_node), bound, leader))
            could_place = group.pool.name not in pool_best and runner_up_visits < RUNNER_UP_VISITS
            if not could_win and not could_place:
                stats.groups_skipped += 1
                continue
            if not could_win:
                runner_up_visits += 1
        stats.groups_visited += 1
        c = fit.largest(group, bound)
        if c is None:
            continue
        found.append(c)
        name = group.pool.name
        if c.cost_per_step < pool_best.get(name, math.inf) or c.cost_per_step < lowest:
            lowest = min(lowest, c.cost_per_step)
            pool_best[name] = min(pool_best.get(name, math.inf), c.cost_per_step)
            kth = sorted(pool_best.values())[RUNNERS_UP] if len(pool_best) > RUNNERS_UP else math.inf
            stop_above = max(lowest * (1 + window), min(kth, lowest * RUNNER_UP_SPAN))
        stale = True
    return found


def _waits_less(wait: float, bound: float, leader: Candidate) -> bool:
    """Whether a group that waits `wait` and costs at least `bound` could replace the current
    choice as the shortest queue: it waits less, or as long (and not forever) for less."""
    return wait < leader.wait_share or (wait == leader.wait_share < math.inf and bound <= leader.cost_per_step)
