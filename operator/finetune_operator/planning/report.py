"""What `finetune-operator plan` prints: the plan as a table a person reads, or as JSON.

Also the inputs of the command: a pools file (a catalog, optionally with the
`allowedRegions` to use when no policy is given) and optional Node/Pod lists
(`kubectl get nodes -o json`) for discovery.
"""

from __future__ import annotations

from typing import Any

import yaml

from finetune_trainer.memory_levers import BY_NAME

from .plan import Infeasible, Plan, PlanningResult
from .policy import ClusterPolicy, PolicyError, load_policy
from .pools import GiB, CatalogError, NodePool, discover, load_catalog, merge_pools


class PlanInputError(ValueError):
    """A pools, policy or nodes file that cannot be used; the message names the file and field."""


def _parse(path: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise PlanInputError(f"{path}: not valid YAML or JSON: {error}") from None


def _items(path: str, document: Any) -> list[dict[str, Any]]:
    """Objects of a `kubectl get -o json|yaml` list, or a bare list."""
    if isinstance(document, dict) and isinstance(document.get("items"), list):
        return [i for i in document["items"] if isinstance(i, dict)]
    if isinstance(document, list):
        return [i for i in document if isinstance(i, dict)]
    raise PlanInputError(f"{path}: expected a List with 'items' (kubectl get ... -o json) or a list of objects")


def planning_inputs(
    pools_path: str | None,
    pools_text: str | None,
    policy_path: str | None,
    policy_text: str | None,
    nodes: tuple[str, str] | None = None,
    pods: tuple[str, str] | None = None,
) -> tuple[list[NodePool], ClusterPolicy]:
    """The pools and the policy the CLI plans with.

    Without a policy file, the pools file's `allowedRegions` (or, failing that, every
    region of its pools) is the policy: the CLI is a what-if tool, the cluster's policy
    is what the operator enforces.
    """
    catalog: list[NodePool] | None = None
    pools_doc: Any = None
    if pools_text is not None:
        pools_doc = _parse(pools_path or "pools", pools_text)
        try:
            catalog = load_catalog(pools_doc)
        except CatalogError as error:
            raise PlanInputError(f"{pools_path}: {error}") from None
    if policy_text is not None:
        try:
            policy = load_policy(policy_text)
        except PolicyError as error:
            raise PlanInputError(f"{policy_path}: {error}") from None
        if catalog is not None:
            policy = policy.model_copy(update={"catalog": catalog})
    else:
        if catalog is None:
            raise PlanInputError("give --pools or --policy (a policy with a catalog)")
        allowed = pools_doc.get("allowedRegions") if isinstance(pools_doc, dict) else None
        if allowed is not None and (not isinstance(allowed, list) or not all(isinstance(r, str) for r in allowed)):
            raise PlanInputError(f"{pools_path}: allowedRegions: must be a list of region names")
        regions = list(allowed) if allowed is not None else sorted({p.region for p in catalog})
        policy = ClusterPolicy(allowed_regions=regions, catalog=catalog)
    pools = list(policy.catalog)
    if nodes is not None:
        node_items = _items(nodes[0], _parse(nodes[0], nodes[1]))
        pod_items = _items(pods[0], _parse(pods[0], pods[1])) if pods is not None else []
        pools = merge_pools(pools, discover(node_items, pod_items, policy).pools)
    return pools, policy


def result_json(result: PlanningResult) -> dict[str, Any]:
    if isinstance(result, Plan):
        return {"feasible": True, **result.to_json()}
    return result.to_json()


def _row(label: str, value: Any) -> str:
    return f"  {label:<24} {value}"


def format_table(result: PlanningResult, job_name: str = "") -> str:
    """The plan, its memory breakdown and the runners-up, for a terminal."""
    lines: list[str] = []
    title = f"Plan for {job_name}" if job_name else "Plan"
    if isinstance(result, Infeasible):
        lines.append(f"{title}: INFEASIBLE")
        lines.append(_row("allowed regions", ", ".join(result.allowed_regions) or "(none)"))
        lines.append("")
        lines.append(result.message)
        return "\n".join(lines) + "\n"
    p = result
    lines.append(f"{title}")
    lines.append(_row("node pool", f"{p.pool.name} ({p.pool.source})"))
    lines.append(_row("region", f"{p.region}   (allowed: {', '.join(p.allowed_regions)})"))
    lines.append(_row("GPUs", f"{p.nodes} node(s) x {p.gpus_per_node} x {p.gpu_type} = {p.gpus}"))
    lines.append(_row("method", f"{p.method}, {p.precision}, optimizer {p.optimizer}, attention {p.attention}"))
    lines.append(_row("strategy", p.strategy + ("" if p.offload == "none" else f", offload {p.offload}")))
    lines.append(_row("batch", f"micro {p.micro_batch_size} x accumulation {p.gradient_accumulation} x"
                              f" {p.gpus} GPUs = {p.global_batch_size} sequences of {p.sequence_length}"))
    lines.append(_row("gradient checkpointing", "on" if p.gradient_checkpointing else "off"))
    levers = p.levers.words()
    if levers:
        savings = ", ".join(f"{BY_NAME[k].label} {v / GiB:.1f} GiB" for k, v in p.lever_savings_bytes.items())
        lines.append(_row("memory levers", ", ".join(levers) + (f" (each saves per GPU: {savings})" if savings else "")))
    usable = p.pool.gpu_memory_bytes * (1 - p.memory_headroom)
    lines.append(_row("GPU memory", f"{p.required_bytes / GiB:.1f} GiB required of {usable / GiB:.1f} GiB usable"
                                    f" ({p.pool.gpu_memory_bytes / GiB:.1f} GiB, {p.memory_headroom:.0%} headroom)"))
    lines.append(_row("host memory per pod", f"{p.host_memory_bytes / GiB:.1f} GiB"))
    if p.estimated_hours is not None:
        lines.append(_row("time", f"{p.estimated_hours:,.2f} h ({p.seconds_per_step:.2f} s/step)"))
    else:
        lines.append(_row("time", f"{p.seconds_per_step:.2f} s/step (length in epochs: total unknown)"))
    if p.estimated_cost is not None:
        lines.append(_row("cost", f"{p.estimated_cost:,.2f} ({p.gpus * p.estimated_hours:,.1f} GPU-hours)"))
    lines.append(_row("capacity", "free now" if p.free_now else "needs scale-up"))
    lines.append("")
    lines.append(f"  Memory per GPU (peak in {p.peak_phase or '?'}):")
    for term, value in p.breakdown_bytes.items():
        if value:
            lines.append(f"    {term:<22} {value / GiB:8.2f} GiB")
    lines.append(f"    {'peak allocated':<22} {p.predicted_peak_bytes / GiB:8.2f} GiB")
    lines.append(f"    {'required':<22} {p.required_bytes / GiB:8.2f} GiB")
    lines.append("")
    lines.append("  Why: " + p.reason)
    if p.runners_up:
        lines.append("")
        lines.append("  Runners-up:")
        lines.extend(f"    - {line}" for line in p.runners_up)
    return "\n".join(lines) + "\n"
