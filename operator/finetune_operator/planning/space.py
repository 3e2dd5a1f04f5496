"""The search space of one job: what it fixes, what is `auto`, and the groups of setups to size.

  pool (in the allowed regions, of an allowed GPU type, or the one the job names)
  x GPUs W (divides globalBatchSize, at most maxGPUs and the pool's ceiling; or the fixed
    count), split evenly over nodes (nodes x GPUs per node, within the pool's ceiling and
    node size: more nodes add cross-node traffic but spread the per-pod host memory and can
    use free GPUs scattered over nodes)
  x strategy (ddp, fsdp, zero1-3) x offload (none, optimizer, optimizer+params, where the
    strategy can) x gradient checkpointing (off, on) x micro-batch (divisors of
    globalBatchSize / W, so that micro x accumulation x W = globalBatchSize exactly).
  Fields the job fixes are not searched.

A `Group` is one (pool, W, nodes, strategy, offload, checkpointing); the micro-batch is searched
inside it. A `Candidate` is a group at one micro-batch that fits, with its cost.
Feasible: required bytes (the sizing estimate, times the calibration factor) <= GPU memory x
(1 - headroom), and the pod's host memory (per-rank host bytes x ranks per node) fits the
node's allocatable memory (when the pool says what that is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Sequence

from .. import api
from ..sizing import ModelArchitecture, SizingError
from ..sizing.export import estimate_export
from ..sizing.from_job import architecture_of
from ..sizing.saved_modules import saved_modules
from finetune_trainer.contract import default_export
from finetune_trainer.combinations import OFFLOADS, STRATEGIES, Choices, allows, offloads_for, strategies_for
from finetune_trainer.memory_levers import (
    NO_LEVERS,
    LeverAsk,
    Levers,
    lever_ask,
    lever_changes,
    lever_options,
    needs_whole_batch,
)

from .choice import COST_TIE, cost_window_of
from .estimates import EstimateFacts
from .plan import Infeasible, PlanKey
from .policy import ClusterPolicy
from .pools import NodePool, same_gpu_type
from .storage import StorageError, storage_regions

# What the master pod's upload sidecar asks for (rendering/pod.py renders it): its requests add to
# the pod's, so a node must have this much host memory beside the ranks'.
UPLOAD_SIDECAR_HOST_BYTES = 512 * 2**20

# Strategies and offloads come from combinations.py (the one home of what combines with what),
# filtered there for the method, precision, optimizer and levers of each group.
@dataclass(frozen=True)
class Ask:
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
    levers: LeverAsk = LeverAsk()  # the lean-trainer levers the job fixes or leaves to the planner
    target_experts: bool = False
    packing: bool = False  # spec.dataset.packing (examples packed with their boundaries)
    lora_dropout: float = 0.0  # spec.lora.dropout (> 0 saves a dropout mask per adapted input)
    lora_modules_to_save: tuple[str, ...] = ()  # spec.lora.modulesToSave (trained in full beside the adapters)
    # Host memory the export after training needs (sizing/export.py; 0 for an adapter): rank 0 merges
    # on the CPU once the other ranks have exited, so one pod's memory must hold it.
    export_host_bytes: int = 0
    # Host memory one pod asks for beside its training container (the master's upload sidecar, for an
    # output in object storage): the pod is scheduled on its requests, so a node must hold both.
    pod_extra_host_bytes: int = 0
    # spec.evaluation.microBatchSize: evaluation's own micro-batch, which must fit beside what the
    # setup keeps resident (estimates.Estimates.eval_required); None: the plan's micro-batch.
    eval_micro_batch: int | None = None

    def base_choices(self, strategy: str, offload: str, checkpointing: bool) -> Choices:
        """A group's choices before its levers, for combinations.py."""
        return Choices(method=self.method, strategy=strategy, offload=offload, optimizer=self.optimizer,
                       precision=self.precision, gradient_checkpointing=checkpointing,
                       target_experts=self.target_experts if self.method != "full" else None,
                       modules_to_save=bool(self.lora_modules_to_save) if self.method != "full" else None,
                       moe=self.arch.is_moe, logit_transform=bool(self.arch.final_logit_softcapping))


@dataclass(slots=True, eq=False)
class Group:
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
    levers: Levers = NO_LEVERS

    def fit_key(self) -> tuple:
        """What decides which micro-batches fit: the setup and the memory it must fit in, not the pool's name."""
        return (self.world, self.strategy, self.offload, self.checkpointing, self.micros, self.usable,
                self.pool.host_memory_bytes, self.gpus_per_node, self.levers)


@dataclass(frozen=True)
class Candidate:
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

    def rank_key(self) -> tuple:
        g = self.group
        # At equal cost: free now, fewer GPUs and nodes, then what the plan gives up (the levers'
        # quality cost: fp32 master weights before bf16...), then fewer changes.
        return (self.needs_scale_up, g.world, g.nodes, g.levers.quality_cost, len(self.changes), self.cost_per_step,
                g.order, self.micro)

    def key(self, ask: Ask) -> PlanKey:
        return key_of(ask, self.group, self.micro)


def key_of(ask: Ask, g: Group, micro: int) -> PlanKey:
    """The PlanKey of group `g` at micro-batch `micro`."""
    return PlanKey(g.pool.name, g.nodes, g.gpus_per_node, ask.method, g.strategy, g.offload, ask.optimizer,
                   micro, g.checkpointing, g.levers)



@dataclass
class Stats:
    """What the search saw, for the reason and the infeasible message."""

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


def ask_from_spec(spec: api.FineTuneJobSpec, policy: ClusterPolicy, architecture: ModelArchitecture | None) -> Ask | Infeasible:
    try:
        arch = architecture or architecture_of(spec)
    except SizingError as error:
        return Infeasible(message=f"spec.model.architecture: {error}")
    lora_rank, lora_targets, lora_dropout, saved = 16, "all-linear", 0.0, ()
    if spec.lora is not None:
        lora_rank, lora_dropout = spec.lora.rank, spec.lora.dropout
        targets = spec.lora.target_modules
        lora_targets = "all-linear" if targets == ["all-linear"] else tuple(targets)
        saved = tuple(spec.lora.modules_to_save)
        if spec.method != "full":
            try:
                arch.resolve_lora_targets(lora_targets)
                saved_modules(arch, saved, lora_targets)
            except SizingError as error:
                field = "modulesToSave" if error.field == "lora_modules_to_save" else "targetModules"
                return Infeasible(message=f"spec.lora.{field}: {error.message}")
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
    export = spec.export or default_export(spec.method)
    target_experts = bool(spec.lora is not None and spec.lora.target_experts)
    if export == "merged" and arch.is_moe and (lora_targets == "all-linear" or target_experts):
        # peft puts all-linear adapters on the fused expert weights too (model_setup.apply_lora), and the
        # trainer's merge refuses those: say so now, not after the training.
        return Infeasible(message="spec.export: merged does not merge adapters on a mixture-of-experts model's fused "
                                  "expert weights, which lora.targetModules all-linear (and lora.targetExperts) adapt; "
                                  "use export adapter, or name the attention modules in lora.targetModules")
    exported = estimate_export(arch, export=export, method=spec.method, precision=t.precision,
                               lora_targets=lora_targets, modules_to_save=saved, stored_bytes=_stored_bytes(arch),
                               trained_bytes=2 if t.master_weights == "bf16" else 4)
    return Ask(
        arch=arch,
        method=spec.method,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        precision=t.precision,
        optimizer=t.optimizer,
        attention=t.attention,
        packing=spec.dataset.packing,
        lora_dropout=lora_dropout if spec.method != "full" else 0.0,
        lora_modules_to_save=saved if spec.method != "full" else (),
        sequence_length=t.sequence_length,
        global_batch_size=t.global_batch_size,
        steps=t.max_steps,
        gpus=r.gpus if isinstance(r.gpus, int) else None,
        max_gpus=r.gpus if isinstance(r.gpus, int) else r.max_gpus,
        strategies=strategies_for(spec.method, t.precision, t.optimizer) if r.strategy == "auto" else (r.strategy,),
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
        levers=lever_ask(t, spec.method, bool(arch.final_logit_softcapping)),
        target_experts=target_experts,
        export_host_bytes=exported.host_bytes if exported is not None else 0,
        pod_extra_host_bytes=UPLOAD_SIDECAR_HOST_BYTES if spec.output is not None and spec.output.s3 is not None else 0,
        eval_micro_batch=spec.evaluation.micro_batch_size if spec.evaluation is not None else None,
    )


def _stored_bytes(arch: ModelArchitecture) -> int:
    """Bytes per element of the base checkpoint on disk, as its config.json says (16-bit unless fp32)."""
    dtype = arch.extra_hf_config.get("torch_dtype") or arch.extra_hf_config.get("dtype")
    return 4 if dtype == "float32" else 2


def pools_for(ask: Ask, pools: Sequence[NodePool]) -> tuple[list[NodePool], Infeasible | None]:
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

