"""Branch and bound over the groups of a job's space: the same choice as sizing every group,
with a fraction of the sizing estimates (bench/planner.py: 46 instead of 237 per plan).

Cost falls as the micro-batch grows, so a group's cost at its largest micro-batch bounds it from
below. Groups are visited cheapest bound first. Once a bound passes the cheapest cost found so far
(`lowest`), no cheaper plan can appear, and a group is sized only if it could still be chosen:
  - as the best of the tie window (costs within COST_TIE of the cheapest): its tie-break prefix
    (can start now, GPUs, nodes, changes: known before sizing it) and bound beat the current best;
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
from typing import Callable

from .choice import COST_TIE
from .estimates import EstimateFacts
from .explain import RUNNERS_UP
from .space import Ask, Candidate, Group, Stats, changes

# Runners-up are looked for among plans costing at most this much more than the cheapest: beyond it
# they say little and would cost the search most of its pruning.
RUNNER_UP_SPAN = 1.5
# Groups sized only to find runners-up in other pools (they cannot change the choice): a budget,
# so that pools where nothing fits do not cost every one of their setups an estimate.
RUNNER_UP_VISITS = 80


def bounded_search(
    ask: Ask,
    groups: list[Group],
    bound_of: Callable[[Group], float],
    size: Callable[[Group, float], tuple[int, EstimateFacts] | None],
    candidate: Callable[[Group, int, EstimateFacts], Candidate],
    choose: Callable[[list[Candidate]], Candidate],
    stats: Stats,
) -> list[Candidate]:
    """The candidates that decide the choice and name the runners-up.

    `bound_of(group)`: its cost at the largest micro-batch; `size(group, bound)`: its
    largest fitting micro-batch, or None; `choose(found)`: the current choice."""
    ordered = sorted(((bound_of(g), g.order, g) for g in groups), key=lambda t: (t[0], t[1]))
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
            tie_best = min((f for f in found if f.cost_per_step <= lowest * (1 + COST_TIE)), key=Candidate.rank_key)
            leader = choose(found)
            stale = False
        if leader is not None and tie_best is not None and bound >= lowest:
            # Bounds only grow from here, so `lowest` is final.
            startable = group.pool.fits_now(group.nodes, group.gpus_per_node)
            prefix = (not startable, group.world, group.nodes, len(changes(ask, group)))
            could_win = (bound <= lowest * (1 + COST_TIE) and prefix + (bound,) <= tie_best.rank_key()[:5]) or (
                ask.cost_window > COST_TIE and startable and bound <= lowest * (1 + ask.cost_window)
                and (leader.needs_scale_up or bound <= leader.cost_per_step)) or (
                # nothing starts now: the shortest queue within the margin (choice.py)
                ask.cost_window > COST_TIE and leader.needs_scale_up and bound <= lowest * (1 + ask.cost_window)
                and _waits_less(group.pool.wait_share(group.nodes, group.gpus_per_node), bound, leader))
            could_place = group.pool.name not in pool_best and runner_up_visits < RUNNER_UP_VISITS
            if not could_win and not could_place:
                stats.groups_skipped += 1
                continue
            if not could_win:
                runner_up_visits += 1
        stats.groups_visited += 1
        best = size(group, bound)
        if best is None:
            continue
        c = candidate(group, *best)
        found.append(c)
        name = group.pool.name
        if c.cost_per_step < pool_best.get(name, math.inf) or c.cost_per_step < lowest:
            lowest = min(lowest, c.cost_per_step)
            pool_best[name] = min(pool_best.get(name, math.inf), c.cost_per_step)
            kth = sorted(pool_best.values())[RUNNERS_UP] if len(pool_best) > RUNNERS_UP else math.inf
            stop_above = max(lowest * (1 + ask.cost_window), min(kth, lowest * RUNNER_UP_SPAN))
        stale = True
    return found


def _waits_less(wait: float, bound: float, leader: Candidate) -> bool:
    """Whether a group that waits `wait` and costs at least `bound` could replace the current
    choice as the shortest queue: it waits less, or as long (and not forever) for less."""
    return wait < leader.wait_share or (wait == leader.wait_share < math.inf and bound <= leader.cost_per_step)
