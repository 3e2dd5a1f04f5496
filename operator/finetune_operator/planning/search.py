"""The plan search: the cheapest way to run a job that fits in memory, inside the allowed regions.

The space
  pool (in the allowed regions, of an allowed GPU type, or the one the job names)
  x GPUs W (divides globalBatchSize, at most maxGPUs and the pool's ceiling; or the fixed
    count), split evenly over nodes (nodes x GPUs per node, within the pool's ceiling and
    node size: more nodes add cross-node traffic but spread the per-pod host memory and can
    use free GPUs scattered over nodes)
  x strategy (ddp, fsdp, zero1-3) x offload (none, optimizer, optimizer+params, where the
    strategy can) x gradient checkpointing (off, on) x micro-batch (divisors of
    globalBatchSize / W, so that micro x accumulation x W = globalBatchSize exactly).
  Fields the job fixes are not searched.
Feasible
  required bytes (the sizing estimate, times the calibration factor) <= GPU memory x
  (1 - headroom), and the pod's host memory (per-rank host bytes x ranks per node) fits
  the node's allocatable memory (when the pool says what that is).
Chosen
  the lowest cost to finish (throughput.py; pools without a price are ranked at the
  highest price among the pools considered, so a known-cheap pool never loses to an
  unknown one). Costs within `COST_TIE` of the cheapest count as equal: the model is not
  more precise than that. Among equals: pools with enough free GPUs now first, then fewer
  GPUs, fewer nodes, fewer changes from the plain setup the job asked for (no offload, no
  checkpointing unless asked, ddp), then the exact cost.
Fast (branch and bound)
  Memory does not depend on the pool, so estimates are cached per setup. Cost falls as the
  micro-batch grows (better utilisation, fewer all-gathers) and memory rises with it, so
  for each (pool, W, strategy, offload, checkpointing) the best micro-batch is the largest
  that fits: a binary search. The cost at the largest conceivable micro-batch bounds each
  such group from below; groups are visited cheapest bound first and the search stops
  when the bound leaves the tie window and the runners-up are found (the best plan of the
  next cheapest pools, up to RUNNER_UP_SPAN times the cheapest cost). Once the bound passes
  the cheapest cost found, no cheaper plan can appear, so a group is skipped unless its
  tie-break (free now, GPUs, nodes, changes: all known before sizing) and its bound could
  still beat the current choice, or its pool has no runner-up yet. Which micro-batches fit
  is cached per (setup, usable memory, host memory), so same-GPU pools in other regions
  cost nothing extra. `exhaustive_plan` enumerates the whole space without any of this;
  tests and bench/planner.py check that both choose the same plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, TypeVar

from .. import api
from ..sizing import ModelArchitecture, SizingError, TrainingSetup
from ..sizing.from_job import architecture_of
from .plan import Infeasible, Plan, PlanKey, PlanningResult, plan_key_of
from .policy import ClusterPolicy
from .storage import StorageError, storage_regions
from .pools import GiB, NodePool, same_gpu_type
from .throughput import JobWork, combine, compute_and_communication, job_work, offload_costs

COST_TIE = 0.01
T = TypeVar("T")
RUNNERS_UP = 3
# Runners-up are looked for among plans costing at most this much more than the cheapest: beyond it
# they say little and would cost the search most of its pruning.
RUNNER_UP_SPAN = 1.5
# Groups sized only to find runners-up in other pools (they cannot change the choice): a budget,
# so that pools where nothing fits do not cost every one of their setups an estimate.
RUNNER_UP_VISITS = 80
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "optimizer+params")
# Offload each strategy can do, as the API allows it: DeepSpeed ZeRO-1/2 offload optimizer states
# only, FSDP's CPUOffload moves parameters and optimizer together, DDP none.
_STRATEGY_OFFLOADS = {
    "ddp": ("none",),
    "zero1": ("none", "optimizer"),
    "zero2": ("none", "optimizer"),
    "fsdp": ("none", "optimizer+params"),
    "zero3": OFFLOADS,
}
# QLoRA replicates its 4-bit base (the API accepts only ddp for it): only adapters train.
_METHOD_STRATEGIES = {"qlora": ("ddp",)}

Estimator = Callable[[TrainingSetup], Any]


# ---------------------------------------------------------------------------
# The estimate, as the planner reads it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimateFacts:
    """The numbers of a sizing estimate the planner uses (and the estimate itself, for the plan)."""

    peak_bytes: int
    required_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    host_bytes_per_rank: int  # host RAM of one training process
    source: Any = None

    @property
    def document(self) -> dict[str, Any]:
        """The estimate as the sizing CLI's JSON (`perGPU`, `host`, `notes`)."""
        if isinstance(self.source, dict):
            return self.source
        if hasattr(self.source, "to_json"):
            return self.source.to_json()
        return {
            "perGPU": {"peakAllocatedBytes": self.peak_bytes, "requiredBytes": self.required_bytes,
                       "peakPhase": self.peak_phase, "breakdown": dict(self.breakdown)},
            "host": {"requiredBytes": self.host_bytes_per_rank},
        }


def estimate_facts(estimate: Any) -> EstimateFacts:
    """Read a sizing MemoryEstimate, or its JSON document (perGPU/host, as `estimate -o json` prints)."""
    if isinstance(estimate, EstimateFacts):
        return estimate
    if not isinstance(estimate, dict):
        return EstimateFacts(
            peak_bytes=int(estimate.peak_allocated_bytes),
            required_bytes=int(estimate.required_bytes),
            peak_phase=str(estimate.peak_phase),
            breakdown={k: int(v) for k, v in estimate.breakdown.items()},
            host_bytes_per_rank=int(estimate.host_required_bytes),
            source=estimate,
        )
    per_gpu, host = estimate.get("perGPU", {}), estimate.get("host", {})
    return EstimateFacts(
        peak_bytes=int(per_gpu.get("peakAllocatedBytes", 0)),
        required_bytes=int(per_gpu["requiredBytes"]),
        peak_phase=str(per_gpu.get("peakPhase", "")),
        breakdown={k: int(v) for k, v in dict(per_gpu.get("breakdown", {})).items()},
        host_bytes_per_rank=int(host.get("requiredBytes", 0)),
        source=estimate,
    )


def _default_estimator() -> Estimator:
    from ..sizing import estimate_memory

    return estimate_memory


# ---------------------------------------------------------------------------
# The job, as the search sees it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ask:
    """A job's fixed settings and the ranges of its `auto` ones."""

    arch: ModelArchitecture
    method: str
    lora_rank: int
    lora_targets: str | tuple[str, ...]
    precision: str
    optimizer: str
    attention: str
    sequence_length: int
    global_batch_size: int
    steps: int | None
    gpus: int | None  # fixed total, or None (auto)
    max_gpus: int
    strategies: tuple[str, ...]
    offloads: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    micro_batch_size: int | None  # fixed, or None (auto)
    headroom: float
    node_pool: str | None
    gpu_types: tuple[str, ...]
    regions: tuple[str, ...]
    fixed_strategy: bool
    fixed_offload: bool
    fixed_checkpointing: bool
    # Costs within this fraction of the cheapest count as equal (then: free now first). COST_TIE,
    # or the policy's start-time margin when the platform prefers starting now to saving a little.
    cost_window: float = COST_TIE


@dataclass(slots=True, eq=False)
class _Group:
    """A (pool, W, strategy, offload, checkpointing) group; the micro-batch is searched inside it.

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

    def fit_key(self) -> tuple:
        """What decides which micro-batches fit: the setup and the memory it must fit in, not the pool's name."""
        return (self.world, self.strategy, self.offload, self.checkpointing, self.micros, self.usable,
                self.pool.host_memory_bytes, self.gpus_per_node)


@dataclass(frozen=True)
class _Candidate:
    group: _Group
    micro: int
    facts: EstimateFacts
    seconds_per_step: float
    cost_per_step: float  # ranking cost (GPU-hours x ranking price)
    needs_scale_up: bool
    changes: tuple[str, ...]

    @property
    def world(self) -> int:
        return self.group.world

    def rank_key(self) -> tuple:
        g = self.group
        return (self.needs_scale_up, g.world, g.nodes, len(self.changes), self.cost_per_step, g.order, self.micro)

    def key(self, ask: _Ask) -> PlanKey:
        g = self.group
        return PlanKey(g.pool.name, g.nodes, g.gpus_per_node, ask.method, g.strategy, g.offload, ask.optimizer,
                       self.micro, g.checkpointing)


class _Estimates:
    """Sizing estimates cached per setup (they do not depend on the pool)."""

    def __init__(self, ask: _Ask, estimator: Estimator):
        self.ask = ask
        self.estimator = estimator
        self.cache: dict[tuple, EstimateFacts | SizingError] = {}
        self.calls = 0

    def get(self, world: int, strategy: str, offload: str, checkpointing: bool, micro: int) -> EstimateFacts | SizingError:
        key = (world, strategy, offload, checkpointing, micro)
        hit = self.cache.get(key)
        if hit is None:
            a = self.ask
            try:
                setup = TrainingSetup(
                    architecture=a.arch, method=a.method, lora_rank=a.lora_rank, lora_targets=a.lora_targets,
                    precision=a.precision, optimizer=a.optimizer, micro_batch_size=micro,
                    sequence_length=a.sequence_length, gradient_checkpointing=checkpointing, attention=a.attention,
                    strategy=strategy, world_size=world, offload=offload,
                )
                self.calls += 1
                hit = estimate_facts(self.estimator(setup))
            except SizingError as error:
                hit = error
            self.cache[key] = hit
        return hit


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def plan_job(
    spec: api.FineTuneJobSpec,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    *,
    exclude: Iterable[Any] = (),
    calibration: float | None = None,
    architecture: ModelArchitecture | None = None,
    estimator: Estimator | None = None,
) -> PlanningResult:
    """The cheapest plan that fits, or an Infeasible naming the nearest miss.

    `exclude`: plans that already failed (Plan, PlanKey or PlanStatus), never proposed again.
    `calibration`: factor on the estimate's required bytes, learned from an observed OOM.
    `architecture`: the model's architecture when the spec refers to a ConfigMap the caller has read.
    `estimator`: the memory model (default: `sizing.estimate_memory`); tests pass their own.
    """
    return _plan(spec, pools, policy, exclude, calibration, architecture, estimator, exhaustive=False)


def exhaustive_plan(
    spec: api.FineTuneJobSpec,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    *,
    exclude: Iterable[Any] = (),
    calibration: float | None = None,
    architecture: ModelArchitecture | None = None,
    estimator: Estimator | None = None,
) -> PlanningResult:
    """The same choice by brute force over the whole space (every micro-batch, no bounds). For checks."""
    return _plan(spec, pools, policy, exclude, calibration, architecture, estimator, exhaustive=True)


@dataclass
class _Stats:
    """What the search saw, for the reason and the infeasible message."""

    rejected: dict[str, int] = field(default_factory=dict)
    closest: tuple[float, _Group, int, int, int] | None = None  # (ratio, group, micro, required, usable)
    closest_host: tuple[float, _Group, int, int] | None = None  # (ratio, group, host needed, host there)
    closest_floor: tuple[float, _Group] | None = None  # (weights floor / usable, group): not sized
    cheaper_misses: list[tuple[float, _Group, int, int]] = field(default_factory=list)  # (cost, group, required, usable)
    groups: int = 0
    groups_visited: int = 0
    groups_skipped: int = 0  # within the bound, but unable to win or to name a runner-up pool

    def reject(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def _plan(spec, pools, policy, exclude, calibration, architecture, estimator, *, exhaustive: bool) -> PlanningResult:
    if calibration is not None and not (calibration > 0 and math.isfinite(calibration)):
        raise ValueError(f"calibration: must be a positive number, got {calibration!r}")
    ask_or_error = _ask_from_spec(spec, policy, architecture)
    if isinstance(ask_or_error, Infeasible):
        return ask_or_error
    ask = ask_or_error
    excluded = {plan_key_of(e) for e in exclude}
    estimates = _Estimates(ask, estimator or _default_estimator())
    work = job_work(
        ask.arch, method=ask.method, lora_rank=ask.lora_rank, lora_targets=ask.lora_targets, precision=ask.precision,
        sequence_length=ask.sequence_length, global_batch_size=ask.global_batch_size,
    )
    if not ask.regions:
        wanted = ", ".join(spec.placement.regions)
        allowed = ", ".join(policy.allowed_regions) or "none"
        return Infeasible(
            message=f"no region is allowed: spec.placement.regions ({wanted}) and the cluster policy's"
            f" allowed regions ({allowed}) have no region in common",
            allowed_regions=[],
        )
    considered, no_pool = _pools_for(ask, pools)
    if no_pool is not None:
        return no_pool
    found, stats = _search(ask, considered, work, estimates, excluded, calibration or 1.0, exhaustive=exhaustive)
    if not found:
        return _infeasible(ask, pools, considered, work, estimates, excluded, calibration or 1.0, stats)
    winner, others = _choose(found, ask.cost_window)
    return _to_plan(ask, winner, others, stats, work, calibration or 1.0, exhaustive)


# ---------------------------------------------------------------------------
# From the spec
# ---------------------------------------------------------------------------


def _ask_from_spec(spec: api.FineTuneJobSpec, policy: ClusterPolicy, architecture: ModelArchitecture | None) -> _Ask | Infeasible:
    try:
        arch = architecture or architecture_of(spec)
    except SizingError as error:
        return Infeasible(message=f"spec.model.architecture: {error}")
    lora_rank, lora_targets = 16, "all-linear"
    if spec.lora is not None:
        lora_rank = spec.lora.rank
        targets = spec.lora.target_modules
        lora_targets = "all-linear" if targets == ["all-linear"] else tuple(targets)
        if spec.method != "full":
            try:
                arch.resolve_lora_targets(lora_targets)
            except SizingError as error:
                return Infeasible(message=f"spec.lora.targetModules: {error}")
    t, r = spec.training, spec.resources
    regions = tuple(reg for reg in spec.placement.regions if reg in set(policy.allowed_regions))
    try:
        # Object storage narrows further: data is trained on only where its endpoint may be read.
        reachable = storage_regions(spec, policy)
    except StorageError:
        reachable = None  # an endpoint the policy refuses: the job is Invalid (layout_of, render_attempt say so)
    if reachable is not None:
        regions = tuple(reg for reg in regions if reg in reachable)
    headroom = r.memory_headroom if r.memory_headroom is not None else policy.default_memory_headroom
    return _Ask(
        arch=arch,
        method=spec.method,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        precision=t.precision,
        optimizer=t.optimizer,
        attention=t.attention,
        sequence_length=t.sequence_length,
        global_batch_size=t.global_batch_size,
        steps=t.max_steps,
        gpus=r.gpus if isinstance(r.gpus, int) else None,
        max_gpus=r.gpus if isinstance(r.gpus, int) else r.max_gpus,
        strategies=_METHOD_STRATEGIES.get(spec.method, STRATEGIES) if r.strategy == "auto" else (r.strategy,),
        offloads=OFFLOADS if r.offload == "auto" else (r.offload,),
        checkpointing=(False, True) if t.gradient_checkpointing is None else (t.gradient_checkpointing,),
        micro_batch_size=t.micro_batch_size if isinstance(t.micro_batch_size, int) else None,
        headroom=headroom,
        node_pool=None if r.node_pool == "auto" else r.node_pool,
        gpu_types=tuple(r.gpu_types),
        regions=regions,
        fixed_strategy=r.strategy != "auto",
        fixed_offload=r.offload != "auto",
        fixed_checkpointing=t.gradient_checkpointing is not None,
        cost_window=cost_window_of(policy),
    )


def _pools_for(ask: _Ask, pools: Sequence[NodePool]) -> tuple[list[NodePool], Infeasible | None]:
    """The pools the job may use, or an Infeasible that says which constraint left none."""
    if not ask.regions:
        return [], Infeasible(
            message="no region is allowed: spec.placement.regions and the cluster policy's allowed regions have no"
            " region in common",
            allowed_regions=[],
        )
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


# ---------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------


def _splits(world: int, pool: NodePool) -> list[tuple[int, int]]:
    """Every even way to place `world` GPUs on the pool's nodes, fewest nodes first: (nodes, GPUs per node).

    More nodes than needed cost cross-node traffic, but they spread the per-pod host memory
    (every rank loads the model) and free GPUs scattered over nodes; the search weighs that.
    """
    return [
        (nodes, world // nodes)
        for nodes in range(max(1, -(-world // pool.gpus_per_node)), min(world, pool.max_nodes) + 1)
        if world % nodes == 0
    ]


def _divisors(n: int) -> list[int]:
    small, large = [], []
    for d in range(1, int(math.isqrt(n)) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _groups(ask: _Ask, pools: Sequence[NodePool], stats: _Stats) -> list[_Group]:
    priced = [p.price_per_gpu_hour for p in pools if p.price_per_gpu_hour is not None]
    unknown_price = max(priced) if priced else 1.0
    groups: list[_Group] = []
    order = 0
    for pool in pools:
        price = pool.price_per_gpu_hour if pool.price_per_gpu_hour is not None else unknown_price
        usable = int(pool.gpu_memory_bytes * (1 - ask.headroom))
        tflops = pool.tflops
        ceiling = min(ask.max_gpus, pool.max_gpus)
        worlds = [ask.gpus] if ask.gpus is not None else _divisors(ask.global_batch_size)
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
                micros = tuple(_divisors(per_rank))
            if not micros:
                stats.reject("micro-batch does not divide globalBatchSize / GPUs")
                continue
            splits = _splits(world, pool)
            if not splits:
                stats.reject("GPU count does not split evenly over the pool's nodes")
                continue
            for nodes, per_node in splits:
                for strategy in ask.strategies:
                    for offload in _STRATEGY_OFFLOADS[strategy]:
                        if offload not in ask.offloads:
                            continue
                        for ckpt in ask.checkpointing:
                            groups.append(_Group(pool, world, nodes, per_node, strategy, offload, ckpt, micros, price,
                                                 order, usable, tflops))
                            order += 1
    stats.groups = len(groups)
    return groups


def _changes(ask: _Ask, group: _Group) -> tuple[str, ...]:
    """Departures from the plain setup: things the user did not ask for that the plan turns on."""
    changes = []
    if group.checkpointing and not ask.fixed_checkpointing:
        changes.append("gradient checkpointing on")
    if group.offload != "none" and not ask.fixed_offload:
        changes.append(f"offload {group.offload}")
    if group.strategy != "ddp" and not ask.fixed_strategy:
        changes.append(f"strategy {group.strategy}")
    return tuple(changes)


def _fits(ask: _Ask, group: _Group, facts: EstimateFacts, calibration: float) -> str | None:
    """None when the setup fits the pool; else which memory does not."""
    if facts.required_bytes * calibration > group.usable:
        return "gpu"
    host = facts.host_bytes_per_rank * group.gpus_per_node
    if group.pool.host_memory_bytes and host > group.pool.host_memory_bytes:
        return "host"
    return None


def _search(
    ask: _Ask,
    pools: Sequence[NodePool],
    work: JobWork,
    estimates: _Estimates,
    excluded: set[PlanKey],
    calibration: float,
    *,
    exhaustive: bool,
) -> tuple[list[_Candidate], _Stats]:
    stats = _Stats()
    groups = _groups(ask, pools, stats)

    # Compute and communication do not depend on offload: the offload variants of a group share them.
    shared: dict[tuple, tuple[float, float]] = {}

    def cost_of(group: _Group, micro: int) -> tuple[float, float]:
        key = (id(group.pool), group.nodes, group.gpus_per_node, group.strategy, group.checkpointing, micro)
        parts = shared.get(key)
        if parts is None:
            parts = shared[key] = compute_and_communication(
                work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, strategy=group.strategy,
                gradient_checkpointing=group.checkpointing, micro_batch_size=micro, tflops=group.tflops,
            )
        transfers, cpu_step = offload_costs(
            work, group.pool, nodes=group.nodes, gpus_per_node=group.gpus_per_node, offload=group.offload,
            gradient_checkpointing=group.checkpointing, micro_batch_size=micro,
        )
        seconds = combine(parts[0], parts[1], transfers, cpu_step)
        return seconds, seconds * group.world / 3600 * group.price

    def candidate(group: _Group, micro: int, facts: EstimateFacts) -> _Candidate:
        seconds, cost = cost_of(group, micro)
        scale_up = not group.pool.fits_now(group.nodes, group.gpus_per_node)
        return _Candidate(group, micro, facts, seconds, cost, scale_up, _changes(ask, group))

    found: list[_Candidate] = []
    if exhaustive:
        for group in groups:
            for micro in group.micros:
                facts = estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micro)
                if isinstance(facts, SizingError):
                    stats.reject("setup not supported")
                    break
                if _fits(ask, group, facts, calibration) is None:
                    c = candidate(group, micro, facts)
                    if c.key(ask) not in excluded:
                        found.append(c)
        return found, stats

    bounded = sorted(((cost_of(g, g.micros[-1])[1], g.order, g) for g in groups), key=lambda t: (t[0], t[1]))
    # Besides the tie window, keep going until the best plan of the RUNNERS_UP + 1 cheapest pools is
    # known (within RUNNER_UP_SPAN of the cheapest): the runners-up say why the other pools lost.
    pool_best: dict[str, float] = {}
    lowest = math.inf  # cost of the cheapest candidate so far: the anchor of the tie window
    stop_above = math.inf
    leader: _Candidate | None = None  # the current choice (rank_key over the tie window)
    runner_up_visits = 0
    fit_cache: dict[tuple, tuple[int | None, str | None, EstimateFacts | None]] = {}
    for bound, _, group in bounded:
        if bound > stop_above:
            break
        if leader is not None and bound >= lowest:
            # Bounds only grow from here, so the anchor is final. This group matters for the choice
            # only if its tie-break prefix (known before sizing it) and its bound could still beat
            # the leader, and for the runners-up only if its pool has no candidate yet.
            prefix = (not group.pool.fits_now(group.nodes, group.gpus_per_node), group.world, group.nodes,
                      len(_changes(ask, group)))
            could_win = bound <= lowest * (1 + ask.cost_window) and prefix + (bound,) <= leader.rank_key()[:5]
            could_place = group.pool.name not in pool_best and runner_up_visits < RUNNER_UP_VISITS
            if not could_win and not could_place:
                stats.groups_skipped += 1
                continue
            if not could_win:
                runner_up_visits += 1
        stats.groups_visited += 1
        best = _largest_fitting_micro(ask, group, estimates, calibration, excluded, stats, bound, lowest, fit_cache)
        if best is None:
            continue
        micro, facts = best
        c = candidate(group, micro, facts)
        found.append(c)
        name = group.pool.name
        if c.cost_per_step < pool_best.get(name, math.inf) or c.cost_per_step < lowest:
            lowest = min(lowest, c.cost_per_step)
            pool_best[name] = min(pool_best.get(name, math.inf), c.cost_per_step)
            kth = sorted(pool_best.values())[RUNNERS_UP] if len(pool_best) > RUNNERS_UP else math.inf
            stop_above = max(lowest * (1 + ask.cost_window), min(kth, lowest * RUNNER_UP_SPAN))
        leader = _leader(found, ask.cost_window)
    return found, stats


def _largest_fitting_micro(
    ask: _Ask,
    group: _Group,
    estimates: _Estimates,
    calibration: float,
    excluded: set[PlanKey],
    stats: _Stats,
    bound: float,
    lowest: float,
    fit_cache: dict[tuple, tuple[int | None, str | None, EstimateFacts | None]],
) -> tuple[int, EstimateFacts] | None:
    micros = group.micros

    def probe(i: int) -> EstimateFacts | SizingError:
        return estimates.get(group.world, group.strategy, group.offload, group.checkpointing, micros[i])

    key = group.fit_key()
    cached = fit_cache.get(key)
    if cached is None:
        cached = fit_cache[key] = _fit_index(ask, group, probe, calibration)
    index, why, first = cached
    if index is None:
        if why == "unsupported":
            stats.reject("setup not supported")
            return None
        stats.reject("host memory" if why == "host" else "GPU memory")
        if why == "gpu" and first is None:  # rejected on the weights alone, without sizing
            ratio = _weights_floor(ask, group) * calibration / group.usable
            if stats.closest_floor is None or ratio < stats.closest_floor[0]:
                stats.closest_floor = (ratio, group)
        elif why == "gpu" and first is not None:
            required = int(first.required_bytes * calibration)
            ratio = required / group.usable
            if stats.closest is None or ratio < stats.closest[0]:
                stats.closest = (ratio, group, micros[0], required, group.usable)
            if bound < lowest:
                stats.cheaper_misses.append((bound, group, required, group.usable))
        elif why == "host" and first is not None:
            needed = first.host_bytes_per_rank * group.gpus_per_node
            ratio = needed / group.pool.host_memory_bytes
            if stats.closest_host is None or ratio < stats.closest_host[0]:
                stats.closest_host = (ratio, group, needed, group.pool.host_memory_bytes)
        return None
    # Recovery: skip micro-batches of plans that already failed (smaller ones fit too).
    for i in range(index, -1, -1):
        if excluded and PlanKey(group.pool.name, group.nodes, group.gpus_per_node, ask.method, group.strategy,
                                group.offload, ask.optimizer, micros[i], group.checkpointing) in excluded:
            stats.reject("excluded (failed before)")
            continue
        facts = probe(i)
        if isinstance(facts, SizingError):
            return None
        return micros[i], facts
    return None


def _weights_floor(ask: _Ask, group: _Group) -> float:
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


def _fit_index(ask: _Ask, group: _Group, probe: Callable[[int], Any], calibration: float
               ) -> tuple[int | None, str | None, EstimateFacts | None]:
    """(index of the largest micro-batch that fits, None) or (None, why the smallest does not, its estimate)."""
    if _weights_floor(ask, group) * calibration > group.usable:
        return None, "gpu", None
    first = probe(0)
    if isinstance(first, SizingError):
        return None, "unsupported", None
    why = _fits(ask, group, first, calibration)
    if why is not None:
        return None, why, first
    # Memory grows with the micro-batch: binary search the largest that fits.
    lo, hi = 0, len(group.micros) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        facts = probe(mid)
        if not isinstance(facts, SizingError) and _fits(ask, group, facts, calibration) is None:
            lo = mid
        else:
            hi = mid - 1
    return lo, None, first


def choose_cheapest_or_startable(items: Sequence[T], *, cost: Callable[[T], float], startable: Callable[[T], bool],
                                 tie_break: Callable[[T], Any], window: float) -> T:
    """The planner's choice rule, for its own candidates and for recovery's finished plans:
    the best `tie_break` among items within COST_TIE of the cheapest; when that one must wait
    for its pool and the policy prefers starting now (`window` wider than COST_TIE, see
    `cost_window_of`), the cheapest within `window` that can start now."""
    lowest = min(cost(i) for i in items)
    best = min((i for i in items if cost(i) <= lowest * (1 + COST_TIE)), key=tie_break)
    if not startable(best) and window > COST_TIE:
        now = [i for i in items if startable(i) and cost(i) <= lowest * (1 + window)]
        if now:
            return min(now, key=lambda i: (cost(i), tie_break(i)))
    return best


def cost_window_of(policy: ClusterPolicy) -> float:
    """Costs within this fraction of the cheapest are weighed against starting now."""
    return max(COST_TIE, policy.start_time_cost_margin) if policy.placement_preference == "startTime" else COST_TIE


def _leader(found: list[_Candidate], window: float) -> _Candidate:
    return choose_cheapest_or_startable(found, cost=lambda c: c.cost_per_step, startable=lambda c: not c.needs_scale_up,
                                        tie_break=_Candidate.rank_key, window=window)


def _choose(found: list[_Candidate], window: float) -> tuple[_Candidate, list[_Candidate]]:
    winner = _leader(found, window)
    others = sorted((c for c in found if c is not winner), key=lambda c: (c.cost_per_step, c.rank_key()))
    return winner, others


# ---------------------------------------------------------------------------
# Explaining the result
# ---------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _shape(group: _Group) -> str:
    if group.nodes == 1:
        return f"{group.world} x {group.pool.gpu_type}"
    return f"{group.nodes} nodes x {group.gpus_per_node} x {group.pool.gpu_type}"


def _setup_words(group: _Group, micro: int | None = None) -> str:
    parts = [group.strategy]
    if group.offload != "none":
        parts.append(f"offload {group.offload}")
    parts.append("checkpointing" if group.checkpointing else "no checkpointing")
    if micro is not None:
        parts.append(f"micro-batch {micro}")
    return ", ".join(parts)


def _money(ask: _Ask, c: _Candidate) -> str:
    if ask.steps is not None and c.group.pool.price_per_gpu_hour is not None:
        return f"{c.cost_per_step * ask.steps:,.2f}"
    return ""


def _choice_words(ask: _Ask, winner: _Candidate, others: list[_Candidate]) -> str:
    """Why this plan: the cheapest, or a dearer one chosen because it can start now."""
    cheapest = min(others, key=lambda c: c.cost_per_step, default=None)
    if cheapest is None or cheapest.cost_per_step >= winner.cost_per_step * (1 - COST_TIE):
        return "is the cheapest feasible plan"
    pct = (winner.cost_per_step / cheapest.cost_per_step - 1) * 100
    return (f"starts now: it costs {pct:.0f}% more than the cheapest plan ({_shape(cheapest.group)} in"
            f" {cheapest.group.pool.name}), whose pool must scale up or free GPUs first (the policy prefers"
            f" starting now within {ask.cost_window:.0%} of the cheapest cost)")


def _why_lost(ask: _Ask, winner: _Candidate, other: _Candidate) -> str:
    if other.cost_per_step > winner.cost_per_step * (1 + COST_TIE):
        pct = (other.cost_per_step / winner.cost_per_step - 1) * 100
        return f"costs {pct:.0f}% more"
    if other.cost_per_step < winner.cost_per_step * (1 - COST_TIE) and other.needs_scale_up:
        pct = (1 - other.cost_per_step / winner.cost_per_step) * 100
        return f"costs {pct:.0f}% less, but its pool must scale up or free GPUs first"
    if other.needs_scale_up and not winner.needs_scale_up:
        return "as cheap, but its pool must scale up"
    if other.world != winner.world:
        return f"as cheap, but uses {other.world} GPUs instead of {winner.world}"
    if other.group.nodes != winner.group.nodes:
        return f"as cheap, but spans {other.group.nodes} nodes"
    if len(other.changes) > len(winner.changes):
        return "as cheap, but changes more of what the job asked (" + ", ".join(other.changes) + ")"
    return "as cheap; lost the final tie-break on exact cost"


def _runner_up_line(ask: _Ask, winner: _Candidate, other: _Candidate) -> str:
    g = other.group
    return (
        f"{_shape(g)} in {g.pool.name} ({g.pool.region}), {_setup_words(g, other.micro)}: "
        f"{_gib(other.facts.required_bytes)} per GPU; {_why_lost(ask, winner, other)}"
    )


def _to_plan(ask: _Ask, winner: _Candidate, others: list[_Candidate], stats: _Stats, work: JobWork,
             calibration: float, exhaustive: bool) -> Plan:
    g, f = winner.group, winner.facts
    pool = g.pool
    hours = winner.seconds_per_step * ask.steps / 3600 if ask.steps is not None else None
    cost = None
    if hours is not None and pool.price_per_gpu_hour is not None:
        cost = hours * g.world * pool.price_per_gpu_hour
    usable = int(pool.gpu_memory_bytes * (1 - ask.headroom))
    required = int(f.required_bytes * calibration)
    runners: list[str] = []
    # The best plan of each other pool, then the best other setup in the winner's pool.
    seen_pools = {pool.name}
    for other in others:
        if other.group.pool.name not in seen_pools and len(runners) < RUNNERS_UP - 1:
            seen_pools.add(other.group.pool.name)
            runners.append(_runner_up_line(ask, winner, other))
    same_pool = [o for o in others if o.group.pool.name == pool.name]
    differs = [o for o in same_pool if (o.group.strategy, o.group.offload, o.group.checkpointing)
               != (g.strategy, g.offload, g.checkpointing)]
    for other in (differs or same_pool)[:RUNNERS_UP - len(runners)]:
        runners.append(_runner_up_line(ask, winner, other))
    # The cheaper setup that came closest to fitting says the most about why the winner costs what it does.
    cheaper = sorted((m for m in stats.cheaper_misses if m[0] < winner.cost_per_step), key=lambda m: m[2] / m[3])
    if cheaper:
        cost_m, group_m, required_m, usable_m = cheaper[0]
        runners.append(
            f"{_shape(group_m)} in {group_m.pool.name} ({group_m.pool.region}), {_setup_words(group_m)}: would cost"
            f" {(1 - cost_m / winner.cost_per_step) * 100:.0f}% less but needs {_gib(required_m)} per GPU,"
            f" {_gib(usable_m)} usable"
        )
    free_words = (
        f"the pool has {pool.free_gpus} GPUs free now"
        if not winner.needs_scale_up
        else "the pool must scale up first (" + (
            "free GPUs unknown" if pool.free_gpus is None
            else f"{pool.free_gpus} free now, not {g.nodes} node(s) with {g.gpus_per_node} free each") + ")"
    )
    cost_words = f"{hours * g.world:,.1f} GPU-hours" if hours is not None else "cost per step"
    if cost is not None:
        cost_words += f", {cost:,.2f} at {pool.price_per_gpu_hour:g} per GPU-hour"
    calib = f" (estimate x {calibration:g} from an observed out-of-memory failure)" if calibration != 1.0 else ""
    searched = "every candidate" if exhaustive else f"{stats.groups_visited} of {stats.groups} setups"
    reason = (
        f"{_shape(g)} in pool {pool.name} ({pool.region}) with {_setup_words(g)}, micro-batch {winner.micro} x"
        f" accumulation {ask.global_batch_size // (winner.micro * g.world)}: it needs {_gib(required)} per GPU{calib}"
        f" of {_gib(usable)} usable ({pool.gpu_memory_bytes / GiB:.1f} GiB less {ask.headroom:.0%} headroom), peak in"
        f" {f.peak_phase or 'training'}, and {_choice_words(ask, winner, others)} ({cost_words}; searched {searched})."
        f" {free_words[0].upper() + free_words[1:]}."
        + (f" Changes: {', '.join(winner.changes)}." if winner.changes else "")
        + f" Allowed regions: {', '.join(ask.regions)}."
    )
    return Plan(
        pool=pool,
        region=pool.region,
        gpu_type=pool.gpu_type,
        nodes=g.nodes,
        gpus_per_node=g.gpus_per_node,
        method=ask.method,
        strategy=g.strategy,
        offload=g.offload,
        optimizer=ask.optimizer,
        micro_batch_size=winner.micro,
        gradient_accumulation=ask.global_batch_size // (winner.micro * g.world),
        gradient_checkpointing=g.checkpointing,
        attention=ask.attention,
        precision=ask.precision,
        sequence_length=ask.sequence_length,
        global_batch_size=ask.global_batch_size,
        estimate=f.document,
        predicted_peak_bytes=f.peak_bytes,
        required_bytes=required,
        breakdown_bytes=f.breakdown,
        peak_phase=f.peak_phase,
        host_memory_bytes=f.host_bytes_per_rank * g.gpus_per_node,
        calibration=calibration,
        memory_headroom=ask.headroom,
        estimated_hours=hours,
        estimated_cost=cost,
        cost_per_step=winner.cost_per_step,
        seconds_per_step=winner.seconds_per_step,
        needs_scale_up=winner.needs_scale_up,
        free_now=not winner.needs_scale_up,
        allowed_regions=list(ask.regions),
        changes=list(winner.changes),
        reason=reason,
        runners_up=runners,
    )


def _infeasible(ask: _Ask, all_pools: Sequence[NodePool], considered: Sequence[NodePool], work: JobWork,
                estimates: _Estimates, excluded: set[PlanKey], calibration: float, stats: _Stats) -> Infeasible:
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
            facts = estimates.get(group.world, group.strategy, group.offload, group.checkpointing, group.micros[0])
            if not isinstance(facts, SizingError):
                required = int(facts.required_bytes * calibration)
                if closest is None or required / group.usable < closest[0]:
                    closest = (required / group.usable, group, group.micros[0], required, group.usable)
        assert closest is not None or stats.closest_floor is not None
        if closest is None:  # the floor's setup could not be sized: say what is known
            group = stats.closest_floor[1]
            floor = int(_weights_floor(ask, group) * calibration)
            closest = (0.0, group, group.micros[0], floor, group.usable)
        _, group, micro, required, usable = closest
        gpus = "1 GPU" if group.world == 1 else f"{group.world} GPUs"
        parts.append(
            f"needs {_gib(required)} per GPU on {gpus} at best ({_setup_words(group, micro)} on {group.pool.name});"
            f" {group.pool.gpu_type} gives {_gib(usable)} usable"
        )
    elif stats.rejected:
        parts.append("no candidate is left: " + "; ".join(f"{why} ({n})" for why, n in sorted(stats.rejected.items())))
    else:
        parts.append("no candidate is left")
    if stats.closest_host is not None:
        _, group, needed, there = stats.closest_host
        parts.append(
            f"{stats.rejected.get('host memory', 0)} setups fit in GPU memory but not in host memory: the closest"
            f" ({_shape(group)} on {group.pool.name}, {_setup_words(group)}) needs {_gib(needed)} per pod,"
            f" its nodes have {_gib(there)}"
        )
    suggestion = _relaxed_suggestion(ask, all_pools, work, estimates, excluded, calibration)
    if suggestion:
        parts.append(suggestion)
    nearest = parts[0]
    return Infeasible(
        message="nothing fits: " + "; ".join(parts),
        allowed_regions=list(ask.regions),
        nearest_miss=nearest,
        rejected=dict(stats.rejected),
    )


def _relaxed_suggestion(ask: _Ask, all_pools: Sequence[NodePool], work: JobWork, estimates: _Estimates,
                        excluded: set[PlanKey], calibration: float) -> str | None:
    """Try lifting one constraint at a time; say what would fit and which constraint stops it."""
    from dataclasses import replace

    biggest = max((p.max_gpus for p in all_pools), default=1)
    relaxations: list[tuple[_Ask, str, bool]] = []  # (relaxed ask, what stops it, search all regions)
    # More GPUs: the smallest count that fits is the suggestion, so try the counts in turn.
    stopper = f"gpus is fixed at {ask.gpus}" if ask.gpus is not None else f"maxGPUs is {ask.max_gpus}"
    for count in _divisors(ask.global_batch_size):
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
            replace(ask, strategies=_METHOD_STRATEGIES.get(ask.method, STRATEGIES), offloads=OFFLOADS, checkpointing=(False, True), micro_batch_size=None,
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
            pools, none = _pools_for(relaxed, all_pools)
            if none is not None:
                continue
        found, _ = _search(relaxed, pools, work, estimates, excluded, calibration, exhaustive=False)
        if not found:
            continue
        winner, _ = _choose(found, relaxed.cost_window)
        g = winner.group
        what = f"{_shape(g)} in {g.pool.region} ({g.pool.name}, {_setup_words(g, winner.micro)})"
        if any_region:
            return f"{what} would fit, but {g.pool.region} is not an allowed region"
        return f"{what} would fit but {stopper}"
    return None
