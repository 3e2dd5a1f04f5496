"""What the next attempt changes: the adjustment ladder.

For a GPU out-of-memory failure the estimate is first *calibrated* by what was observed:
the attempt needed more than the GPU has, so the true figure is at least
`capacity / predicted`, times a safety margin (and at least `(reported peak + the
allocation that failed) / predicted peak`, when the trainer or the log tail gave them, and
at least `planned GPU memory / capacity seen` when the process saw less than the pool
promises), never below what earlier failures taught.
Then the planner is asked again, with the calibrated estimate, allowing one more kind
of change per rung, in this documented order:

  1. gradientCheckpointing  turn activation recomputation on
  2. chunkedLoss            the cross-entropy over sequence chunks (the same loss)
  3. microBatch             smaller micro-batch, more accumulation (the global batch is kept)
  4. sharding               ddp -> fsdp / zero2 -> zero3
  5. activationOffloading   checkpointed activations to host memory (time, not results)
  6. optimizer8bit          the optimizer may switch to its counterpart (optimizers.py: AdamW and
                            bitsandbytes' 8-bit AdamW, torchao's 8-bit and 4-bit AdamW)
  7. offload                optimizer (and parameter) states to host memory
  8. optimizerInBackward    each parameter's step inside backward (no gradient clipping then)
  9. moreGPUs               more GPUs, or another pool, in the allowed regions
 10. masterWeights          bf16 weights, gradients and optimizer states (full fine-tuning)
 11. method                 LoRA -> QLoRA; only when `recovery.allowedAdjustments` lists `method`

The lean-trainer levers come in the order of what they give up: nothing (chunked loss),
time (activation offloading), gradient clipping (the step in backward), the low bits of
each update (bf16 master weights, only when more GPUs cannot help). The ladder frees
`masterWeights` and `optimizerInBackward` only where the job left them `auto`/unset: a job
that asks for fp32 master weights, or for no step in backward, keeps it.

Rungs the job does not allow are skipped. Each rung keeps the freedoms of the rungs
before it and adds its own: a freedom, never an obligation. The planner cannot choose the
optimizer itself (`training.optimizer` is a fixed field of its search), so from rung 4 on
each rung is planned once with the failed plan's optimizer and once with the other one,
and the two answers are ranked the way the planner ranks its own candidates (cheapest
within the cost tie, then free now, fewer GPUs, fewer nodes, fewer changes, where the
switch counts as a change). A later rung may so keep AdamW and use ZeRO with offload,
which bitsandbytes' 8-bit optimizers cannot run under. The answer is the cheapest change
that fits, found as early in the ladder as possible. Placement is never touched, so the
regions stay as allowed. When the optimizer changes, the next attempt cannot resume the
optimizer state of the checkpoint (other shapes, other dtypes): the trainer starts the
optimizer afresh from the checkpointed weights, and the change says so.

A host out-of-memory kill (OOMKilled, exit 137, or one torchrun worker killed by the
kernel) raises the pod's memory within what the node has; when that is exhausted and the
plan offloads to host memory, offload is turned off instead. Eviction and node loss run
the same plan again; when that plan can no longer be placed (its pool is gone or
changed), the job is re-planned elsewhere (`replan_after_loss`).

Recovery ends, with the reason in the answer, when the failure is one a retry cannot fix
(DataError, ConfigError, Unknown: classify.py says which evidence gives which), when
`recovery.maxAttempts` (or the policy's default) attempts were made, or when no allowed
change fits.

Two invariants hold for every plan this module proposes, whatever the failure:

* Never a plan that ran out of memory again. A plan that failed with a GPU OOM (its key,
  `PlanKey`: pool, shape, method, strategy, offload, optimizer, micro-batch,
  checkpointing) is never proposed again, in any form, nor spread differently over nodes
  (2 x 2 GPUs instead of 1 x 4: the same memory per GPU). A plan that failed with a host
  OOM is proposed again only with strictly more pod memory than it failed with (the GPU
  side of it was not at fault; pod memory is part of what ran). A plan that was evicted
  or lost its node did not fail by its own doing and may run again: that is what
  RETRY_SAME is for. `failed_runs` reads these facts from a job's attempt history; a bare
  `PlanKey` given instead counts as "never again", the stricter reading, except the failed
  plan's own key: a caller that lists every attempt lists the one that just failed too,
  and how that one failed is `failure`, known here.
* The calibration learned is never lost: every plan proposed carries a calibration at
  least as large as the failed plan's (and as the one the caller passes, e.g. the
  largest of the history, `learned_calibration`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .. import api
from ..planning.plan import Infeasible, Plan, PlanKey, plan_key_of
from ..planning.policy import ClusterPolicy
from ..planning.pools import GiB, NodePool
from ..planning.search import choose_cheapest_or_startable, cost_window_of, plan_job
from ..sizing import ModelArchitecture
from .classify import Failure, FailureKind, Remedy
from finetune_trainer import optimizers
from finetune_trainer.combinations import Choices, allows
from finetune_trainer.memory_levers import LEVERS, by_rung

# After an OOM the next plan must fit the calibrated estimate with this much to spare,
# on top of the job's own headroom: the observation bounds the truth from below only.
CALIBRATION_MARGIN = 1.05
# Host memory grows by this factor per host OOM, up to what the node offers.
HOST_MEMORY_GROWTH = 1.5
# Share of a node's memory a training pod may take (the kubelet, system daemons and the
# eviction threshold need the rest).
HOST_MEMORY_NODE_SHARE = 0.90

# Attempt outcomes (status.attempts[].outcome) that are the plan's own fault.
MEMORY_OUTCOMES: dict[str, FailureKind] = {
    FailureKind.GPU_OUT_OF_MEMORY.value: FailureKind.GPU_OUT_OF_MEMORY,
    FailureKind.HOST_OUT_OF_MEMORY.value: FailureKind.HOST_OUT_OF_MEMORY,
}
_MEMORY_KINDS = frozenset(MEMORY_OUTCOMES.values())

# The optimizer rung lets the plan switch between these two (see the module's docstring).


@dataclass(frozen=True)
class Rung:
    name: str  # as in spec.recovery.allowedAdjustments
    knobs: frozenset[str]  # what this rung lets the planner change


# What each rung lets the planner change: the other adjustments' knobs here, each lever's own
# field for its rung (memory_levers). The order is the API's (api.ADJUSTMENTS); hostMemory is no
# rung of this ladder: it is the remedy of a host OOM (`_after_host_oom`).
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
_LEVERS_BY_RUNG = by_rung(rung.name for rung in LADDER)


@dataclass(frozen=True)
class NextStep:
    """The decision after a failed attempt."""

    retry: bool
    plan: Plan | None  # the next attempt's plan when retry
    changes: str  # what changes, for a person ("turned on gradient checkpointing ...")
    why: str  # the failure and the reasoning, for a person


@dataclass(frozen=True)
class FailedRun:
    """A plan that ran out of memory, as it ran: never to be proposed again as it was."""

    key: PlanKey
    host_memory_bytes: int  # the pod memory it ran with
    kind: FailureKind  # GPU_OUT_OF_MEMORY or HOST_OUT_OF_MEMORY

    def __post_init__(self) -> None:
        if self.kind not in _MEMORY_KINDS:
            raise ValueError(f"FailedRun: {self.kind.value} is not a memory failure; only those exclude a plan")

    def repeated_by(self, key: PlanKey, host_memory_bytes: int) -> bool:
        """Whether running `key` with `host_memory_bytes` of pod memory would repeat this failure."""
        if self.kind is FailureKind.HOST_OUT_OF_MEMORY:
            # Pod memory is per node: another split is another run for host memory.
            return key == self.key and host_memory_bytes <= self.host_memory_bytes
        # GPU memory does not depend on how the GPUs are spread over nodes.
        return _unsplit(key) == _unsplit(self.key)

    def keys(self) -> tuple[PlanKey, ...]:
        """The keys the planner must not propose again because of this failure."""
        if self.kind is FailureKind.HOST_OUT_OF_MEMORY:
            return (self.key,)
        return _all_splits(self.key)

    @classmethod
    def of(cls, plan: api.PlanStatus, kind: FailureKind) -> "FailedRun":
        return cls(plan_key_of(plan), _host_bytes(plan), kind)


Excluded = PlanKey | FailedRun


def failed_runs(attempts: Iterable[api.AttemptStatus]) -> tuple[FailedRun, ...]:
    """The runs of a job's history that ran out of memory (outcome GPU/HostOutOfMemory).

    Evicted, lost and unschedulable attempts are not among them: their plans did not fail."""
    return tuple(
        FailedRun.of(a.plan, MEMORY_OUTCOMES[a.outcome])
        for a in attempts
        if a.plan is not None and a.outcome in MEMORY_OUTCOMES
    )


def learned_calibration(attempts: Iterable[api.AttemptStatus]) -> float:
    """The largest calibration any attempt's plan carried (1.0 when none): the floor for the next plan."""
    return max([1.0] + [a.plan.calibration for a in attempts if a.plan is not None and a.plan.calibration])


def is_repeat(key: PlanKey, host_memory_bytes: int, excluded: Iterable[Excluded]) -> bool:
    """Whether a plan with `key` and `host_memory_bytes` repeats one of `excluded`."""
    for item in excluded:
        if isinstance(item, FailedRun):
            if item.repeated_by(key, host_memory_bytes):
                return True
        elif plan_key_of(item) == key:
            return True
    return False


def _host_bytes(plan: api.PlanStatus) -> int:
    return int(round(plan.host_memory_gi_b * GiB))


def _unsplit(key: PlanKey) -> tuple:
    """A key with its nodes x GPUs-per-node replaced by the GPU count."""
    return (key.node_pool, key.nodes * key.gpus_per_node, *key[3:])


def _all_splits(key: PlanKey) -> tuple[PlanKey, ...]:
    """`key` with its GPUs spread over nodes in every even way (the key itself first)."""
    gpus = key.nodes * key.gpus_per_node
    others = (key._replace(nodes=n, gpus_per_node=gpus // n) for n in range(1, gpus + 1) if gpus % n == 0)
    return tuple(dict.fromkeys((key, *others)))


def _keys(excluded: Iterable[Excluded]) -> tuple[PlanKey, ...]:
    """What the planner excludes: every key that failed (a host-OOM'd key too: the planner
    would propose it with the pod memory it failed with, or less; a GPU-OOM'd key in every
    split)."""
    keys: list[PlanKey] = []
    for e in excluded:
        keys.extend(e.keys() if isinstance(e, FailedRun) else (plan_key_of(e),))
    return tuple(dict.fromkeys(keys))


def calibration_factor(failure: Failure, failed: api.PlanStatus) -> float:
    """How much the raw estimate of the failed plan under-predicted, at least (>= 1).

    The plan's required figure already carries the calibration it was planned with; the
    raw estimate is that divided back out, so repeated failures do not compound the factor.
    When the process saw less GPU memory than the pool promises (a MIG slice, memory held
    by another process, a driver reserve larger than the catalog's), the estimate is scaled
    by that shortfall too, so that the next plan fits in what was really there: otherwise
    nothing is learned, and the same settings would be proposed again.
    """
    old = failed.calibration or 1.0
    planned = int(failed.gpu_memory_gi_b * GiB)
    capacity = failure.capacity_bytes or planned
    raw_required = failed.required_gi_b * GiB / old
    factor = capacity / raw_required if raw_required > 0 else 1.0
    if 0 < capacity < planned:
        factor = max(factor, old * planned / capacity)
    peak = failed.predicted_peak_gi_b * GiB
    if failure.peak_allocated_bytes and peak > 0:
        observed = failure.peak_allocated_bytes + (failure.tried_to_allocate_bytes or 0)
        factor = max(factor, observed / peak)
    # The old factor was learned from an earlier failure and still holds; never go below it.
    return max(factor * CALIBRATION_MARGIN, old, 1.0)


def decide_next(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    *,
    attempts_made: int,
    failed_keys: Sequence[Excluded],
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
    calibration: float | None = None,
) -> NextStep:
    """The next attempt's plan after `failure` of the plan `failed`, or why there is none.

    `failed_keys`: what earlier attempts ruled out: `failed_runs(status.attempts)` (or bare
    PlanKeys, each then ruled out entirely). The failed plan itself is added here when
    `failure` is a memory failure, so the caller need not have recorded it yet.
    `calibration`: the largest calibration learned so far (`learned_calibration`), when
    the history knows more than `failed` does; the next plan never has less.
    `architecture`: the model's, when the spec refers to a ConfigMap (see `plan_job`)."""
    what = failure.describe()
    if failure.remedy is Remedy.GIVE_UP:
        return NextStep(False, None, "", f"{what}; a retry cannot fix this")
    max_attempts = spec.recovery.max_attempts or policy.default_max_attempts
    if attempts_made >= max_attempts:
        return NextStep(False, None, "", f"{what}; all {max_attempts} attempts are used")
    floor = _calibration_floor(failed, calibration)
    own = plan_key_of(failed)
    # A bare key of the failed plan itself says no more than `failure` does (and, read as
    # "never again", would forbid running an evicted plan again or giving a host-OOM'd plan
    # more memory). Earlier failures of this very plan can only have been host OOMs with
    # less pod memory: after a GPU OOM it is never proposed again.
    excluded: list[Excluded] = [k for k in failed_keys if isinstance(k, FailedRun) or plan_key_of(k) != own]
    if failure.kind in _MEMORY_KINDS:
        excluded.append(FailedRun.of(failed, failure.kind))
    if failure.remedy is Remedy.RETRY_SAME:
        return _after_loss(spec, failed, excluded, floor, pools, policy, what, architecture)
    if failure.kind is FailureKind.HOST_OUT_OF_MEMORY:
        return _after_host_oom(spec, failed, excluded, floor, pools, policy, what, architecture)
    return _after_gpu_oom(spec, failure, failed, excluded, floor, pools, policy, what, architecture)


def _calibration_floor(failed: api.PlanStatus, calibration: float | None) -> float:
    if calibration is not None and not (calibration > 0 and math.isfinite(calibration)):
        raise ValueError(f"calibration: must be a positive number, got {calibration!r}")
    return max(failed.calibration or 1.0, calibration or 1.0, 1.0)


def replan_after_loss(
    spec: api.FineTuneJobSpec,
    recorded: api.PlanStatus,
    *,
    failed: Sequence[Excluded] = (),
    calibration: float | None = None,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
) -> Plan | Infeasible:
    """The plan for an attempt whose recorded plan must be run again (eviction, node loss, a
    child to create again), keeping what was learned: first the recorded plan itself;
    when it cannot be placed any more (its pool is gone or changed), the same settings on
    other GPUs or pools; then a fresh plan of the spec. Never a plan of `failed`
    (`failed_runs(status.attempts)`), never a calibration below the recorded plan's or
    `calibration` (`learned_calibration(status.attempts)`)."""
    floor = _calibration_floor(recorded, calibration)
    same = replan_pinned(spec, recorded, pools, policy, architecture, calibration=floor)
    if isinstance(same, Plan) and not is_repeat(same.key, same.host_memory_bytes, failed):
        return same
    keys = _keys(failed)
    elsewhere = plan_job(pinned_spec(spec, recorded, {"gpus", "node_pool"}), pools, policy, exclude=keys,
                         calibration=floor, architecture=architecture)
    if isinstance(elsewhere, Plan):
        return elsewhere
    return plan_job(spec, pools, policy, exclude=keys, calibration=floor, architecture=architecture)


def _after_loss(
    spec: api.FineTuneJobSpec,
    failed: api.PlanStatus,
    excluded: Sequence[Excluded],
    floor: float,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    what: str,
    architecture: ModelArchitecture | None,
) -> NextStep:
    plan = replan_after_loss(spec, failed, failed=excluded, calibration=floor, pools=pools, policy=policy,
                             architecture=architecture)
    if isinstance(plan, Infeasible):
        return NextStep(False, None, "", f"{what}; the plan can no longer be placed and nothing else fits: {plan.message}")
    if plan.key == plan_key_of(failed):
        return NextStep(True, plan, "same plan (the failure was not the plan's)", what)
    return NextStep(True, plan, f"the same plan cannot run again: {describe_change(failed, plan)}", what)


def _after_gpu_oom(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    excluded: Sequence[Excluded],
    floor: float,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    what: str,
    architecture: ModelArchitecture | None,
) -> NextStep:
    factor = max(calibration_factor(failure, failed), floor)
    allowed = set(spec.recovery.allowed_adjustments)
    keys = _keys(excluded)
    planner = _Planner(pools, policy, keys, factor, architecture)
    free: set[str] = set()
    tried: list[str] = []
    last: Infeasible | None = None
    for rung in LADDER:
        if rung.name not in allowed:
            continue
        if rung.name == "method" and spec.method != "lora":
            continue  # only LoRA -> QLoRA; full fine-tuning is never silently turned into adapters
        free |= rung.knobs
        tried.append(rung.name)
        result = _best_of_optimizers(planner, spec, failed, free)
        if isinstance(result, Plan):
            change = describe_change(failed, result)
            why = f"{what}; the estimate under-predicted, calibrated x{factor:.2f}"
            return NextStep(True, result, change, why)
        last = result
    detail = f": {last.message}" if last is not None else ""
    return NextStep(
        False,
        None,
        "",
        f"{what}; nothing fits with the estimate calibrated x{factor:.2f} after trying {', '.join(tried) or 'no adjustments'}{detail}",
    )


class _Planner:
    """plan_job with the ladder's fixed arguments, remembering answers: successive rungs ask
    the same question again (a rung whose optimizer choice keeps the failed plan's optimizer
    repeats the previous rung's search)."""

    def __init__(self, pools: Sequence[NodePool], policy: ClusterPolicy, exclude: tuple[PlanKey, ...],
                 calibration: float, architecture: ModelArchitecture | None) -> None:
        self.pools, self.policy, self.exclude = pools, policy, exclude
        self.calibration, self.architecture = calibration, architecture
        self._answers: dict[str, Plan | Infeasible] = {}

    def plan(self, spec: api.FineTuneJobSpec) -> Plan | Infeasible:
        question = spec.model_dump_json()
        answer = self._answers.get(question)
        if answer is None:
            answer = self._answers[question] = plan_job(
                spec, self.pools, self.policy, exclude=self.exclude, calibration=self.calibration,
                architecture=self.architecture,
            )
        return answer


def _optimizer_choices(failed: api.PlanStatus, free: set[str]) -> tuple[str, ...]:
    """The optimizers the plan may use: the failed plan's first (no change), then, from the
    optimizer rung on, its counterpart."""
    if "optimizer" not in free:
        return (failed.optimizer,)
    return (failed.optimizer, optimizers.kind(failed.optimizer).counterpart)


def _best_of_optimizers(planner: _Planner, spec: api.FineTuneJobSpec, failed: api.PlanStatus,
                        free: set[str]) -> Plan | Infeasible:
    found: list[tuple[Plan, int]] = []
    last: Infeasible | None = None
    for optimizer in _optimizer_choices(failed, free):
        result = planner.plan(pinned_spec(spec, failed, free, optimizer=optimizer))
        if isinstance(result, Plan):
            found.append((result, int(optimizer != failed.optimizer)))
        else:
            last = result
    if not found:
        assert last is not None
        return last
    return _preferred(found, planner.policy)


def _preferred(found: list[tuple[Plan, int]], policy: ClusterPolicy) -> Plan:
    """The planner's own choice rule over finished plans (cost, then starting now, then fewer
    GPUs, nodes and changes, where `extra` counts the changes the planner did not see, such as
    the optimizer). On a full tie the earlier plan wins: the one that keeps the optimizer."""

    def cost(pe: tuple[Plan, int]) -> float:
        return pe[0].cost_per_step if pe[0].cost_per_step is not None else math.inf

    return choose_cheapest_or_startable(
        found, cost=cost, startable=lambda pe: not pe[0].needs_scale_up,
        tie_break=lambda pe: (pe[0].needs_scale_up, pe[0].gpus, pe[0].nodes, len(pe[0].changes) + pe[1], cost(pe)),
        window=cost_window_of(policy))[0]


def _after_host_oom(
    spec: api.FineTuneJobSpec,
    failed: api.PlanStatus,
    excluded: Sequence[Excluded],
    floor: float,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    what: str,
    architecture: ModelArchitecture | None,
) -> NextStep:
    allowed = set(spec.recovery.allowed_adjustments)
    pool = next((p for p in pools if p.name == failed.node_pool), None)
    current = _host_bytes(failed)
    node_limit = int(pool.host_memory_bytes * HOST_MEMORY_NODE_SHARE) if pool is not None else 0
    raise_failed = ""  # why raising pod memory did not work, when it was tried and the node had room
    if pool is not None and "hostMemory" in allowed and current < node_limit:
        same = replan_pinned(spec, failed, pools, policy, architecture, calibration=floor)
        if not isinstance(same, Plan):
            raise_failed = f"; the plan can no longer be placed with more pod memory: {same.message}"
        elif same.pool.name != failed.node_pool:
            raise_failed = f"; the plan no longer fits its pool {failed.node_pool}"
        if isinstance(same, Plan) and same.pool.name == failed.node_pool:
            bigger = min(node_limit, int(current * HOST_MEMORY_GROWTH))
            plan = same.model_copy(update={"host_memory_bytes": max(bigger, same.host_memory_bytes)})
            # Strictly more than it failed with, by construction (current < node_limit);
            # checked all the same, against every run of this plan that failed before.
            if not is_repeat(plan.key, plan.host_memory_bytes, excluded):
                change = (f"raised pod memory {current / GiB:.0f} -> {plan.host_memory_bytes / GiB:.0f} GiB"
                          f" (node has {pool.host_memory_bytes / GiB:.0f} GiB)")
                return NextStep(True, plan, change, what)
    for lever in LEVERS:
        # A lever that keeps state in host memory (activation offloading) is turned off.
        if not (lever.host_memory and lever.rung in allowed and lever.in_use(failed)):
            continue
        candidate = pinned_spec(spec, failed, set())
        candidate = candidate.model_copy(update={"training": candidate.training.model_copy(update=dict(lever.off))})
        result = plan_job(candidate, pools, policy, exclude=_keys(excluded), calibration=floor,
                          architecture=architecture)
        if isinstance(result, Plan):
            return NextStep(True, result, f"turned off {lever.label}: host memory is exhausted", what)
    if "offload" in allowed and failed.offload != "none":
        candidate = pinned_spec(spec, failed, set())
        candidate = candidate.model_copy(
            update={"resources": candidate.resources.model_copy(update={"offload": "none"})}
        )
        result = plan_job(candidate, pools, policy, exclude=_keys(excluded), calibration=floor,
                          architecture=architecture)
        if isinstance(result, Plan):
            return NextStep(True, result, f"turned offload off ({failed.offload} -> none): host memory is exhausted", what)
        tried = f"; without offload it does not fit: {result.message}"
    else:
        tried = "; nothing else is allowed"
    if pool is None:
        return NextStep(False, None, "", f"{what}; node pool {failed.node_pool} is gone{tried}")
    if "hostMemory" not in allowed:
        return NextStep(False, None, "", f"{what}; raising pod memory is not allowed{tried}")
    if raise_failed:
        # The node had room: say what really stopped it, not the node's limit.
        return NextStep(False, None, "", f"{what}{raise_failed}{tried}")
    return NextStep(False, None, "", f"{what}; pod memory is at the node's limit ({node_limit / GiB:.0f} GiB){tried}")


def pinned_spec(spec: api.FineTuneJobSpec, plan: api.PlanStatus, free: set[str],
                *, optimizer: str | None = None) -> api.FineTuneJobSpec:
    """The job's spec with every knob of `plan` fixed, except those in `free` (left to the planner).

    The planner has no `auto` for the optimizer: it is pinned to `optimizer` (default the
    plan's); the ladder frees it by asking once per optimizer (`_optimizer_choices`)."""
    asked = spec.training
    levers: dict[str, object] = {}
    for lever in LEVERS:
        # A lever that costs result quality stays as the job set it (Lever.keeps_explicit); left
        # auto, its rung frees it.
        lever_free = lever.name in free and (
            not lever.keeps_explicit or getattr(asked, lever.name) == lever.auto[lever.name])
        levers.update({field: lever.auto[field] if lever_free else getattr(plan, field) for field in lever.off})
    training = spec.training.model_copy(
        update={
            "micro_batch_size": "auto" if "micro_batch_size" in free else plan.micro_batch_size,
            "gradient_checkpointing": None if "gradient_checkpointing" in free else plan.gradient_checkpointing,
            "optimizer": optimizer or plan.optimizer,
            **levers,
        }
    )
    resources = spec.resources.model_copy(
        update={
            "gpus": "auto" if "gpus" in free else plan.gpus,
            "node_pool": "auto" if "node_pool" in free else plan.node_pool,
            "strategy": "auto" if "strategy" in free else plan.strategy,
            "offload": "auto" if "offload" in free else plan.offload,
        }
    )
    method = plan.method
    if "method" in free and plan.method == "lora":
        method = "qlora"
        # Keep the plan's strategy and offload where QLoRA can run with them (combinations.py).
        keep = allows(Choices(method="qlora", strategy=plan.strategy, offload=plan.offload))
        resources = resources.model_copy(update={
            "strategy": "auto" if "strategy" in free else (plan.strategy if keep else "ddp"),
            "offload": "auto" if "offload" in free else (plan.offload if keep else "none")})
    return spec.model_copy(update={"method": method, "training": training, "resources": resources})


def replan_pinned(
    spec: api.FineTuneJobSpec,
    plan: api.PlanStatus,
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
    *,
    calibration: float | None = None,
) -> Plan | Infeasible:
    """The plan described by a PlanStatus, rebuilt by the planner (to render it again), with
    its pod memory and at least its calibration (or `calibration`, when larger).

    The spec can pin the GPU count but not how the GPUs are spread over nodes: every other
    split is excluded, so the answer is the recorded plan itself or an Infeasible."""
    key = plan_key_of(plan)
    result = plan_job(pinned_spec(spec, plan, set()), pools, policy, calibration=_calibration_floor(plan, calibration),
                      architecture=architecture, exclude=_all_splits(key)[1:])
    if isinstance(result, Plan):
        wanted = _host_bytes(plan)
        if wanted > result.host_memory_bytes:
            result = result.model_copy(update={"host_memory_bytes": wanted})
    return result


def describe_change(old: api.PlanStatus, new: Plan) -> str:
    """What differs between two plans, the way a person says it."""
    parts: list[str] = []
    if new.gradient_checkpointing and not old.gradient_checkpointing:
        parts.append("turned on gradient checkpointing")
    elif old.gradient_checkpointing and not new.gradient_checkpointing:
        parts.append("turned off gradient checkpointing")
    if new.micro_batch_size != old.micro_batch_size:
        verb = "halved" if new.micro_batch_size * 2 == old.micro_batch_size else "changed"
        parts.append(
            f"{verb} the micro-batch {old.micro_batch_size} -> {new.micro_batch_size}, "
            f"accumulation {old.gradient_accumulation} -> {new.gradient_accumulation}"
        )
    if new.strategy != old.strategy:
        parts.append(f"sharding {old.strategy} -> {new.strategy}")
    if new.optimizer != old.optimizer:
        # The trainer drops the checkpoint's optimizer state on purpose when the optimizer
        # differs (its states have other shapes and dtypes); a person must know the
        # moments restart from zero.
        parts.append(
            f"optimizer {old.optimizer} -> {new.optimizer} (optimizer state is not carried over on resume:"
            " the weights resume from the checkpoint, the optimizer starts afresh)"
        )
    if new.offload != old.offload:
        parts.append(f"offload {old.offload} -> {new.offload}")
    for lever in _LEVERS_BY_RUNG:
        change = lever.change_between(lever.setting_of(old), lever.setting_of(new))
        if change:
            parts.append(change)
    if new.gpus != old.gpus or new.pool.name != old.node_pool:
        parts.append(
            f"GPUs {old.gpus} x {old.gpu_type} ({old.node_pool}) -> {new.gpus} x {new.gpu_type} ({new.pool.name})"
        )
    elif (new.nodes, new.gpus_per_node) != (old.nodes, old.gpus_per_node):
        parts.append(f"nodes {old.nodes} x {old.gpus_per_node} GPUs -> {new.nodes} x {new.gpus_per_node} GPUs")
    if new.method != old.method:
        parts.append(f"method {old.method} -> {new.method}")
    if not parts:
        return "same settings"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]
