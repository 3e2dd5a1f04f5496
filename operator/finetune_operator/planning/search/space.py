"""Stage 1 of the plan search: enumerate the job's space.

  pool (in the allowed regions, of an allowed GPU type, or the one the job names)
  x GPUs W (divides globalBatchSize, at most maxGPUs and the pool's ceiling; or the fixed
    count), split evenly over nodes (nodes x GPUs per node, within the pool's ceiling and
    node size: more nodes add cross-node traffic but spread the per-pod host memory and can
    use free GPUs scattered over nodes)
  x strategy (ddp, fsdp, zero1-3) x offload (none, optimizer, optimizer+params, where the
    strategy can) x gradient checkpointing (off, on) x the memory levers' settings (what
    combinations.py allows with them) x micro-batch (divisors of globalBatchSize / W, so that
    micro x accumulation x W = globalBatchSize exactly).
  Fields the job fixes are not searched.

A `Group` is one (pool, W, nodes, strategy, offload, checkpointing, levers); the micro-batch is
searched inside it by the stages after this one. Nothing here is sized: enumerating is cheap, and
which groups get sized is the choice stage's branch and bound (choose.py).
`Stats` is what the search saw, written by each stage in turn (this one counts the groups and
what the job's own numbers rule out) and read by the reason and the infeasible message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Sequence

from finetune_trainer.combinations import allows, offloads_for
from finetune_trainer.memory_levers import (
    NO_LEVERS,
    LeverAsk,
    Levers,
    lever_changes,
    lever_options,
    needs_whole_batch,
    ranks_per_replica,
)

from ..plan import Infeasible, PlanKey
from ..pools import NodePool, same_gpu_type
from .ask import Ask


@dataclass(slots=True, eq=False)
class Group:
    """A (pool, W, nodes, strategy, offload, checkpointing, levers) group; the micro-batch is searched inside it.

    Thousands are made per plan, so it is a plain slotted class (treat it as read-only).
    """

    pool: NodePool
    world: int
    nodes: int
    gpus_per_node: int
    strategy: str
    offload: str
    checkpointing: bool
    micros: tuple[int, ...]  # valid micro-batch sizes, ascending
    price: float  # ranking price per GPU-hour
    order: int  # enumeration order, for determinism
    usable: int  # GPU memory the plan may fill (after headroom)
    tflops: float  # the pool's GPU peak
    levers: Levers = NO_LEVERS

    def fit_key(self) -> tuple:
        """What decides which micro-batches fit: the setup and the memory it must fit in, not the pool's name."""
        return (self.world, self.strategy, self.offload, self.checkpointing, self.micros, self.usable,
                self.pool.host_memory_bytes, self.gpus_per_node, self.levers)


@dataclass
class Stats:
    """What the search saw, for the reason and the infeasible message: the groups enumerated and what
    the job's numbers rule out (here), the misses and how close each came (fit.py), the groups
    visited and skipped (choose.py)."""

    rejected: dict[str, int] = field(default_factory=dict)
    closest: tuple[float, Group, int, int, int] | None = None  # (ratio, group, micro, required, usable)
    closest_host: tuple[float, Group, int, int] | None = None  # (ratio, group, host needed, host there)
    closest_floor: tuple[float, Group] | None = None  # (weights floor / usable, group): not sized
    # Setups that do not fit in GPU memory: (their cost at the largest micro-batch, group, required, usable).
    gpu_misses: list[tuple[float, Group, int, int]] = field(default_factory=list)
    groups: int = 0
    groups_visited: int = 0
    groups_skipped: int = 0  # by the branch and bound: unable to win or to name a runner-up pool

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def pools_for(ask: Ask, pools: Sequence[NodePool]) -> tuple[list[NodePool], Infeasible | None]:
    """The pools the job may use, or an Infeasible that says which constraint left none."""
    regions = list(ask.regions)
    in_region = [p for p in pools if p.region in ask.regions and p.max_nodes > 0]
    if not in_region:
        empty = sorted(p.name for p in pools if p.region in ask.regions)
        where = sorted({p.region for p in pools})
        message = (
            f"the node pools in the allowed regions {regions} cannot scale to any node (maxNodes 0): {', '.join(empty)}"
            if empty else f"no node pool in the allowed regions {regions}; pools exist in {where}"
        )
        return [], Infeasible(message=message, allowed_regions=regions)
    if ask.node_pool is not None:
        named = [p for p in pools if p.name == ask.node_pool]
        if not named:
            return [], Infeasible(
                message=f"spec.resources.nodePool: no pool named {ask.node_pool!r}; pools in the allowed regions:"
                f" {', '.join(sorted(p.name for p in in_region))}",
                allowed_regions=regions,
            )
        in_region = [p for p in in_region if p.name == ask.node_pool]
        if not in_region:
            return [], Infeasible(
                message=f"spec.resources.nodePool: pool {ask.node_pool!r} is in {named[0].region}, outside the allowed"
                f" regions {regions}",
                allowed_regions=regions,
            )
    if ask.gpu_types:
        typed = [p for p in in_region if any(same_gpu_type(p.gpu_type, t) for t in ask.gpu_types)]
        if not typed:
            offered = sorted({p.gpu_type for p in in_region})
            return [], Infeasible(
                message=f"spec.resources.gpuTypes: no pool in the allowed regions {regions} offers"
                f" {', '.join(ask.gpu_types)}; they offer {', '.join(offered)}",
                allowed_regions=regions,
            )
        in_region = typed
    return in_region, None


def splits(world: int, pool: NodePool) -> list[tuple[int, int]]:
    """Every even way to place `world` GPUs on the pool's nodes, fewest nodes first: (nodes, GPUs per node).

    More nodes than needed cost cross-node traffic, but they spread the per-pod host memory
    (every rank loads the model) and free GPUs scattered over nodes; the search weighs that.
    """
    return [
        (nodes, world // nodes)
        for nodes in range(max(1, -(-world // pool.gpus_per_node)), min(world, pool.max_nodes) + 1)
        if world % nodes == 0
    ]


def divisors(n: int) -> list[int]:
    small, large = [], []
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def groups(ask: Ask, pools: Sequence[NodePool], stats: Stats) -> list[Group]:
    priced = [p.price_per_gpu_hour for p in pools if p.price_per_gpu_hour is not None]
    unknown_price = max(priced) if priced else 1.0
    lever_memo: dict[tuple, tuple[Levers, ...]] = {}
    found: list[Group] = []
    order = 0
    for pool in pools:
        price = pool.price_per_gpu_hour if pool.price_per_gpu_hour is not None else unknown_price
        usable = int(pool.gpu_memory_bytes * (1 - ask.headroom))
        tflops = pool.tflops
        ceiling = min(ask.max_gpus, pool.max_gpus)
        worlds = [ask.gpus] if ask.gpus is not None else divisors(ask.global_batch_size)
        for world in worlds:
            if world > ceiling:
                stats.reject("more GPUs than maxGPUs or the pool's ceiling")
                continue
            per_rank = ask.global_batch_size // world
            if ask.global_batch_size % world:
                stats.reject("globalBatchSize not divisible by the GPU count")
                continue
            if ask.micro_batch_size is not None:
                micros = (ask.micro_batch_size,) if per_rank % ask.micro_batch_size == 0 else ()
            else:
                micros = tuple(divisors(per_rank))
            if not micros:
                stats.reject("micro-batch does not divide globalBatchSize / GPUs")
                continue
            ways = splits(world, pool)
            if not ways:
                stats.reject("GPU count does not split evenly over the pool's nodes")
                continue
            # A lever that needs accumulation 1 (the optimizer step in backward): the one micro-batch of per_rank.
            whole = (per_rank,) if per_rank in micros else ()
            for nodes, per_node in ways:
                for strategy in ask.strategies:
                    for offload in _offloads_for(strategy, ask.method):
                        if offload not in ask.offloads:
                            continue
                        for ckpt in ask.checkpointing:
                            # The lever settings depend on the setup, not on the pool or GPU count: asked
                            # once per setup (combinations.py's checks were most of a plan's time).
                            known = lever_memo.get((strategy, offload, ckpt, bool(whole)))
                            if known is None:
                                known = lever_memo[(strategy, offload, ckpt, bool(whole))] = _lever_options(
                                    ask.levers, ask.base_choices(strategy, offload, ckpt), bool(whole))
                            for levers in known:
                                if world % ranks_per_replica(levers):
                                    stats.reject("sequence-parallel degree does not divide the GPU count")
                                    continue
                                found.append(Group(pool, world, nodes, per_node, strategy, offload, ckpt,
                                                   whole if needs_whole_batch(levers) else micros, price,
                                                   order, usable, tflops, levers))
                                order += 1
    stats.groups = len(found)
    return found


# Pure functions of small hashable arguments, asked in the innermost loop of every plan.
_offloads_for = lru_cache(maxsize=256)(offloads_for)


@lru_cache(maxsize=2048)
def _lever_options(levers: LeverAsk, base: Any, accumulation_one: bool) -> tuple[Levers, ...]:
    """`lever_options`, remembered across plans: a pure function of its (hashable) arguments, which
    jobs of a platform repeat."""
    return lever_options(levers, base, accumulation_one=accumulation_one, allows=allows)


def changes(ask: Ask, group: Group) -> tuple[str, ...]:
    """Departures from the plain setup: things the user did not ask for that the plan turns on."""
    turned_on = []
    if group.checkpointing and not ask.fixed_checkpointing:
        turned_on.append("gradient checkpointing on")
    if group.offload != "none" and not ask.fixed_offload:
        turned_on.append(f"offload {group.offload}")
    if group.strategy != "ddp" and not ask.fixed_strategy:
        turned_on.append(f"strategy {group.strategy}")
    turned_on.extend(lever_changes(group.levers, ask.levers.fixed))
    return tuple(turned_on)


def accumulation_of(ask: Ask, g: Group, micro: int) -> int:
    """Micro-batches per optimizer step on each GPU: globalBatchSize over micro x the data-parallel size
    (the GPUs, but for those that split one sequence: memory_levers.ranks_per_replica)."""
    return ask.global_batch_size * ranks_per_replica(g.levers) // (micro * g.world)


def key_of(ask: Ask, g: Group, micro: int) -> PlanKey:
    """The PlanKey of group `g` at micro-batch `micro`."""
    return PlanKey(g.pool.name, g.nodes, g.gpus_per_node, ask.method, g.strategy, g.offload, ask.optimizer,
                   micro, g.checkpointing, g.levers)
