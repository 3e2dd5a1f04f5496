"""Planner benchmark: latency and optimality of `plan_job` on 20 pools in 4 regions and 200 varied jobs.

    python bench/planner.py [--jobs 200] [--seed 1] [--json]

Latency: wall time of `plan_job` per job (the real sizing model, a fresh estimate cache
per call, as the operator calls it), and plans per second (jobs / the sum of those wall
times). Targets: p99 < 50 ms.
Optimality: for every job, the plan `plan_job` chooses (branch and bound) against the one
`exhaustive_plan` chooses by estimating every point of the same space (every pool, GPU
count, strategy, offload, checkpointing and micro-batch). Target: 100% the same plan,
and the same lowest cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from finetune_operator import api  # noqa: E402
from finetune_operator.planning import ClusterPolicy, Plan, exhaustive_plan, load_catalog, plan_job  # noqa: E402
from finetune_operator.sizing import estimate_memory  # noqa: E402

REGIONS = ["eu-de-berlin", "eu-fr-paris", "eu-nl-amsterdam", "us-east-virginia"]
# (gpu type, GPUs per node, intra-node, inter-node Gbit/s, base price per GPU-hour)
GPU_KINDS = [
    ("H200-141GB", 8, "nvlink", 3200, 4.3),
    ("H100-80GB", 8, "nvlink", 3200, 3.3),
    ("A100-80GB", 8, "nvlink", 1600, 2.0),
    ("A100-40GB", 8, "nvlink", 800, 1.45),
    ("L40S-48GB", 4, "pcie", 100, 1.05),
]
PRESETS = ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen2.5-14b",
           "qwen2.5-32b", "gemma-2-9b", "gemma-2-27b", "phi-3-mini", "mixtral-8x7b", "llama-3.1-70b",
           "qwen2.5-72b"]


def catalog(rng: random.Random) -> list:
    pools = []
    for r, region in enumerate(REGIONS):
        for gpu, per_node, intra, inter, price in GPU_KINDS:
            max_nodes = rng.choice([1, 2, 4, 8])
            pools.append({
                "name": f"{gpu.lower()}-{region.split('-')[-1]}",
                "region": region, "gpuType": gpu, "gpusPerNode": per_node, "maxNodes": max_nodes,
                "pricePerGpuHour": round(price * (1 + 0.08 * r) * rng.uniform(0.95, 1.05), 2),
                "freeGpus": rng.choice([None, 0, per_node // 2, per_node, per_node * max_nodes]),
                "intraNode": intra, "interNodeGbps": inter, "hostMemory": "1900Gi" if per_node == 8 else "480Gi",
            })
    return load_catalog({"pools": pools})


def job(rng: random.Random, index: int) -> api.FineTuneJobSpec:
    preset = rng.choice(PRESETS)
    big = preset.endswith(("70b", "72b", "32b", "27b")) or preset.startswith("mixtral")
    method = rng.choice(["lora", "lora", "qlora"] if big else ["full", "lora", "lora", "qlora"])
    training: dict[str, Any] = {
        "sequenceLength": rng.choice([512, 1024, 2048, 4096, 8192]),
        "globalBatchSize": rng.choice([8, 16, 32, 48, 64, 96, 128, 256]),
    }
    if rng.random() < 0.8:
        training["maxSteps"] = rng.choice([200, 1000, 5000])
    else:
        training["epochs"] = 2.0
    if method == "qlora":
        training["optimizer"] = "paged-adamw-8bit"
    resources: dict[str, Any] = {"maxGPUs": rng.choice([1, 2, 4, 8, 16, 32])}
    if rng.random() < 0.3:
        resources["gpuTypes"] = rng.sample([k[0] for k in GPU_KINDS], rng.randint(1, 3))
    if rng.random() < 0.15 and method != "qlora":
        resources["strategy"] = rng.choice(["fsdp", "zero2", "zero3"])
    if rng.random() < 0.15:
        training["gradientCheckpointing"] = rng.choice([True, False])
    if rng.random() < 0.1:
        resources["gpus"] = rng.choice([1, 2, 4, 8])
        resources["maxGPUs"] = max(resources["maxGPUs"], resources["gpus"])
        while training["globalBatchSize"] % resources["gpus"]:
            training["globalBatchSize"] *= 2
    document = {
        "model": {"name": preset, "architecture": {"preset": preset}, "source": {"pvc": {"claimName": "models"}}},
        "dataset": {"source": {"pvc": {"claimName": "data"}}},
        "method": method,
        "training": training,
        "resources": resources,
        "placement": {"regions": rng.sample(REGIONS, rng.randint(1, 3))},
    }
    if method != "full":
        document["lora"] = {"rank": rng.choice([8, 16, 64])}
    return api.parse_spec(document)


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, setup):
        self.calls += 1
        return estimate_memory(setup)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    pools = catalog(rng)
    policy = ClusterPolicy(allowed_regions=REGIONS[:3] + ["us-east-virginia"])
    jobs = [job(rng, i) for i in range(args.jobs)]
    plan_job(jobs[0], pools, policy)  # imports and first-call costs out of the figures

    latencies, cpu_times, exhaustive_latencies, estimates, exhaustive_estimates = [], [], [], [], []
    same_plan = same_cost = feasible = 0
    mismatches: list[str] = []
    for index, spec in enumerate(jobs):
        counter = Counting()
        start, cpu_start = time.perf_counter(), time.process_time()
        fast = plan_job(spec, pools, policy, estimator=counter)
        latencies.append((time.perf_counter() - start) * 1000)
        cpu_times.append((time.process_time() - cpu_start) * 1000)
        estimates.append(counter.calls)
        counter = Counting()
        start = time.perf_counter()
        slow = exhaustive_plan(spec, pools, policy, estimator=counter)
        exhaustive_latencies.append((time.perf_counter() - start) * 1000)
        exhaustive_estimates.append(counter.calls)
        if isinstance(fast, Plan) and isinstance(slow, Plan):
            feasible += 1
            same_plan += fast.key == slow.key
            same_cost += abs(fast.cost_per_step - slow.cost_per_step) <= 1e-12 * slow.cost_per_step
            if fast.key != slow.key:
                mismatches.append(f"job {index}: {fast.summary()}  vs exhaustive  {slow.summary()}")
        elif type(fast) is type(slow):
            same_plan += 1
            same_cost += 1
        else:
            mismatches.append(f"job {index}: planner {type(fast).__name__}, exhaustive {type(slow).__name__}")

    n = len(jobs)
    figures = {
        "pools": len(pools),
        "regions": len({p.region for p in pools}),
        "jobs": n,
        "feasible": feasible,
        "latency_ms": {"p50": percentile(latencies, 50), "p90": percentile(latencies, 90),
                       "p99": percentile(latencies, 99), "max": max(latencies)},
        "cpu_ms": {"p50": percentile(cpu_times, 50), "p99": percentile(cpu_times, 99)},
        "plans_per_second": 1000 * n / sum(latencies),
        "load_average": os.getloadavg()[0],
        "exhaustive_latency_ms": {"p50": percentile(exhaustive_latencies, 50), "p99": percentile(exhaustive_latencies, 99)},
        "estimates_per_plan": {"mean": statistics.mean(estimates), "max": max(estimates)},
        "exhaustive_estimates_per_plan": {"mean": statistics.mean(exhaustive_estimates)},
        "same_plan_pct": 100.0 * same_plan / n,
        "same_cost_pct": 100.0 * same_cost / n,
        "mismatches": mismatches,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        lat, ex = figures["latency_ms"], figures["exhaustive_latency_ms"]
        rows = [
            ("catalog", f"{figures['pools']} pools in {figures['regions']} regions"),
            ("jobs", f"{n} ({feasible} feasible, {n - feasible} infeasible)"),
            ("plan_job plans per second", f"{figures['plans_per_second']:.0f}   (one after another, on one thread)"),
            ("plan_job latency p50", f"{lat['p50']:.1f} ms"),
            ("plan_job latency p90", f"{lat['p90']:.1f} ms"),
            ("plan_job latency p99", f"{lat['p99']:.1f} ms   (target < 50 ms)"),
            ("plan_job latency max", f"{lat['max']:.1f} ms"),
            ("plan_job CPU time p50/p99", f"{figures['cpu_ms']['p50']:.1f} / {figures['cpu_ms']['p99']:.1f} ms"
                                          f"   (load average {figures['load_average']:.1f} on {os.cpu_count()} CPUs)"),
            ("estimates per plan", f"{figures['estimates_per_plan']['mean']:.0f} mean, {figures['estimates_per_plan']['max']} max"),
            ("exhaustive latency p50/p99", f"{ex['p50']:.0f} / {ex['p99']:.0f} ms"),
            ("exhaustive estimates per plan", f"{figures['exhaustive_estimates_per_plan']['mean']:.0f} mean"),
            ("same plan as exhaustive", f"{figures['same_plan_pct']:.1f}%   (target 100%)"),
            ("same lowest cost as exhaustive", f"{figures['same_cost_pct']:.1f}%"),
        ]
        width = max(len(r[0]) for r in rows)
        print("Planner benchmark")
        for label, value in rows:
            print(f"  {label:<{width}}  {value}")
        for line in mismatches:
            print("  MISMATCH", line)
    ok = figures["latency_ms"]["p99"] < 50 and not mismatches
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
