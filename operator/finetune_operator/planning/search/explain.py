"""After the choice: the plan of the winning candidate, with the reason it carries (why this pool
and setup, what it costs, what it changes, what its memory levers save) and the runners-up (the
best plan of other pools, and why each lost)."""

from __future__ import annotations

from finetune_trainer.memory_levers import BY_NAME

from ..plan import Plan
from ..pools import GiB
from .ask import Ask
from .choose import COST_TIE, RUNNERS_UP
from .fit import Candidate, pod_host_bytes
from .space import Group, Stats, accumulation_of


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def shape(group: Group) -> str:
    if group.nodes == 1:
        return f"{group.world} x {group.pool.gpu_type}"
    return f"{group.nodes} nodes x {group.gpus_per_node} x {group.pool.gpu_type}"


def setup_words(group: Group, micro: int | None = None) -> str:
    parts = [group.strategy]
    if group.offload != "none":
        parts.append(f"offload {group.offload}")
    parts.append("checkpointing" if group.checkpointing else "no checkpointing")
    parts.extend(group.levers.words(chunks=False))
    if micro is not None:
        parts.append(f"micro-batch {micro}")
    return ", ".join(parts)


def choice_words(winner: Candidate, others: list[Candidate], window: float) -> str:
    """Why this plan: the cheapest, or a dearer one chosen because it can start now."""
    cheapest = min(others, key=lambda c: c.cost_per_step, default=None)
    if cheapest is None or cheapest.cost_per_step >= winner.cost_per_step * (1 - COST_TIE):
        return "is the cheapest feasible plan"
    pct = (winner.cost_per_step / cheapest.cost_per_step - 1) * 100
    if winner.needs_scale_up:  # nothing starts now: chosen for its shorter queue (choose_cheapest_or_startable)
        return (f"has the shorter queue: it costs {pct:.0f}% more than the cheapest plan ({shape(cheapest.group)} in"
                f" {cheapest.group.pool.name}), whose pool has {queue_words(cheapest.group.pool)}, this one"
                f" {queue_words(winner.group.pool)} (the policy prefers starting sooner within {window:.0%}"
                " of the cheapest cost)")
    return (f"starts now: it costs {pct:.0f}% more than the cheapest plan ({shape(cheapest.group)} in"
            f" {cheapest.group.pool.name}), whose pool must scale up or free GPUs first (the policy prefers"
            f" starting now within {window:.0%} of the cheapest cost)")


def why_lost(ask: Ask, winner: Candidate, other: Candidate) -> str:
    if other.cost_per_step > winner.cost_per_step * (1 + COST_TIE):
        pct = (other.cost_per_step / winner.cost_per_step - 1) * 100
        return f"costs {pct:.0f}% more"
    if other.cost_per_step < winner.cost_per_step * (1 - COST_TIE) and other.needs_scale_up:
        pct = (1 - other.cost_per_step / winner.cost_per_step) * 100
        if winner.needs_scale_up:
            return f"costs {pct:.0f}% less, but its pool's queue is longer ({queue_words(other.group.pool)})"
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


def queue_words(pool) -> str:
    return f"{pool.queued_gpus} GPUs queued on {pool.nodes_now * pool.gpus_per_node} up"


def runner_up_line(ask: Ask, winner: Candidate, other: Candidate) -> str:
    g = other.group
    return (
        f"{shape(g)} in {g.pool.name} ({g.pool.region}), {setup_words(g, other.micro)}: "
        f"{gib(other.facts.required_bytes)} per GPU; {why_lost(ask, winner, other)}"
    )


def lever_words(savings: dict[str, int]) -> str:
    """What each lever in use saves, for the reason: "bf16 master weights save 30.1 GiB, ..."."""
    return ", ".join(f"{BY_NAME[k].phrase} {gib(v)}" for k, v in savings.items())


def to_plan(ask: Ask, winner: Candidate, others: list[Candidate], stats: Stats, calibration: float, window: float,
            exhaustive: bool, savings: dict[str, int] | None = None) -> Plan:
    """The plan of the winning candidate, with its reason and runners-up. `window`: the cost window
    the choice used (cost_window_of)."""
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
            runners.append(runner_up_line(ask, winner, other))
    same_pool = [o for o in others if o.group.pool.name == pool.name]
    # One that costs as much and lost on the tie-break (it must wait, uses more GPUs...) says why
    # this shape; then other setups (strategy, offload, checkpointing) say why this setup.
    tied = [o for o in same_pool if o.cost_per_step <= winner.cost_per_step * (1 + COST_TIE)][:1]
    differs = [o for o in same_pool if (o.group.strategy, o.group.offload, o.group.checkpointing, o.group.levers)
               != (g.strategy, g.offload, g.checkpointing, g.levers) and o not in tied]
    for other in (tied + (differs or [o for o in same_pool if o not in tied]))[:RUNNERS_UP - len(runners)]:
        runners.append(runner_up_line(ask, winner, other))
    # The cheaper setup that came closest to fitting says the most about why the winner costs what it does.
    cheaper = sorted((m for m in stats.gpu_misses if m[0] < winner.cost_per_step), key=lambda m: m[2] / m[3])
    if cheaper:
        cost_m, group_m, required_m, usable_m = cheaper[0]
        runners.append(
            f"{shape(group_m)} in {group_m.pool.name} ({group_m.pool.region}), {setup_words(group_m)}: would cost"
            f" {(1 - cost_m / winner.cost_per_step) * 100:.0f}% less but needs {gib(required_m)} per GPU,"
            f" {gib(usable_m)} usable"
        )
    free_words = (
        f"the pool has {pool.free_gpus} GPUs free now"
        if not winner.needs_scale_up
        else "the pool must free GPUs or scale up first (" + (
            "free GPUs unknown" if pool.free_gpus is None
            else f"{pool.free_gpus} free now, not {g.nodes} node(s) with {g.gpus_per_node} free each"
            + (f"; {queue_words(pool)}" if pool.queued_gpus else "")) + ")"
    )
    cost_words = f"{hours * g.world:,.1f} GPU-hours" if hours is not None else "cost per step"
    if cost is not None:
        cost_words += f", {cost:,.2f} at {pool.price_per_gpu_hour:g} per GPU-hour"
    calib = f" (estimate x {calibration:g}, calibrated by observed peaks)" if calibration != 1.0 else ""
    searched = "every candidate" if exhaustive else f"{stats.groups_visited} of {stats.groups} setups"
    reason = (
        f"{shape(g)} in pool {pool.name} ({pool.region}) with {setup_words(g)}, micro-batch {winner.micro} x"
        f" accumulation {accumulation_of(ask, g, winner.micro)}: it needs {gib(required)} per GPU{calib}"
        f" of {gib(usable)} usable ({pool.gpu_memory_bytes / GiB:.1f} GiB less {ask.headroom:.0%} headroom), peak in"
        f" {f.peak_phase or 'training'}, and {choice_words(winner, others, window)} ({cost_words}; searched {searched})."
        f" {free_words[0].upper() + free_words[1:]}."
        + (f" Changes: {', '.join(winner.changes)}." if winner.changes else "")
        + (f" Memory levers save per GPU: {lever_words(savings)}." if savings else "")
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
        gradient_accumulation=accumulation_of(ask, g, winner.micro),
        gradient_checkpointing=g.checkpointing,
        attention=ask.attention,
        precision=ask.precision,
        **g.levers.setup_fields(),
        lever_savings_bytes=dict(savings or {}),
        sequence_length=ask.sequence_length,
        global_batch_size=ask.global_batch_size,
        estimate=f.document,
        predicted_peak_bytes=f.peak_bytes,
        required_bytes=required,
        breakdown_bytes=f.breakdown,
        peak_phase=f.peak_phase,
        host_memory_bytes=pod_host_bytes(ask, f, g.gpus_per_node),
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

