"""A golden of plans: a large seeded matrix of jobs x pools x policies planned, each result's JSON
written one per line, so that a change to the planner's code that must not change what it plans
can be checked byte for byte.

    python3 bench/plan_golden.py --out /tmp/plans.jsonl           # write the golden
    python3 bench/plan_golden.py --check /tmp/plans.jsonl         # plan again, compare, exit 1 on a difference

The matrix (all seeded; nothing reads the clock or the environment):
  catalogs   examples/pools.yaml, bench/planner.py's 20 pools in 4 regions, and 4 random small
             catalogs with free GPUs now, queues, nodes up, scattered free GPUs, pools without a
             price and small hosts
  policies   per catalog: cost preference, startTime at margins 0.25 and 0.6, other memory
             headrooms, object storage endpoints (for jobs that read or write S3)
  jobs       the examples (as written, with each memory lever fixed, with fields fixed) and
             random specs drawn from per-case seeds (presets dense and MoE, full/LoRA/QLoRA,
             optimizers, precisions, levers, fixed GPUs/strategy/offload/micro-batch/checkpointing,
             GPU types, node pools, packing, padding-free rows and declared micro-batch tokens, dropout,
             target modules (the head's too), modules to save, eval micro-batch, export, S3 output, regions)
  calls      plan_job for every case; some with a calibration, some excluding their own first plan,
             some with the tests' simple memory model (sized every time, no process-wide memo),
             some also through exhaustive_plan; recovery re-plans through recovery/adjust.py's
             decide_next after a GPU OOM (three rungs climbed), a host OOM, an eviction and a
             lost node (its pool gone)
A line is {"id", "call", "result"}: `result` is Plan.to_json() / Infeasible.to_json(), or for a
recovery step its retry, changes, why and plan. The last line printed is the count and the sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "operator", ROOT / "images" / "trainer", ROOT, ROOT / "bench"):
    sys.path.insert(0, str(path))

import yaml  # noqa: E402

import planner as bench_planner  # noqa: E402  (bench/planner.py: its catalog of 20 pools)
from finetune_operator import api  # noqa: E402
from finetune_operator.planning import ClusterPolicy, Plan, exhaustive_plan, load_catalog, load_policy, plan_job  # noqa: E402
from finetune_operator.planning.pools import GiB  # noqa: E402
from finetune_operator.recovery.adjust import FailedRun, decide_next  # noqa: E402
from finetune_operator.recovery.classify import Failure, FailureKind  # noqa: E402
from finetune_trainer.combinations import OPTIMIZERS  # noqa: E402
from tests.planning.simple_estimator import simple_estimate  # noqa: E402
from tests.planning.test_search import with_changes  # noqa: E402

REGIONS = ["eu-de-berlin", "eu-fr-paris", "eu-nl-amsterdam", "us-east-virginia"]
STORAGE = [{"endpoint": f"https://s3.{r}.example", "region": r} for r in REGIONS[:3]]
KINDS = [("H100-80GB", 8, 3.3), ("A100-80GB", 8, 2.0), ("A100-40GB", 8, 1.45), ("L40S-48GB", 4, 1.05),
         ("H200-141GB", 8, 4.3)]
PRESETS = ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "mistral-7b-v0.3", "qwen2.5-7b", "qwen2.5-14b",
           "qwen2.5-32b", "gemma-2-2b", "gemma-2-9b", "phi-3-mini", "qwen3-4b", "qwen3-8b", "mixtral-8x7b",
           "qwen3-30b-a3b", "llama-3.1-70b", "olmo-2-7b", "granite-3.1-8b"]
BIG = ("qwen2.5-32b", "mixtral-8x7b", "qwen3-30b-a3b", "llama-3.1-70b")
MOE = ("mixtral-8x7b", "qwen3-30b-a3b")
EXAMPLES = ["llama-8b-lora.yaml", "llama-8b-full.yaml", "llama-70b-qlora.yaml"]


# ---------------------------------------------------------------------------
# Catalogs and policies
# ---------------------------------------------------------------------------


def random_catalog(rng: random.Random, regions: list[str]) -> list:
    pools = []
    for i, region in enumerate(regions):
        for gpu, per_node, price in rng.sample(KINDS, 3):
            nodes = rng.choice([1, 2, 4])
            free = rng.choice([None, 0, per_node // 2, per_node, per_node * nodes])
            pool: dict[str, Any] = {
                "name": f"{gpu.lower()}-{i}", "region": region, "gpuType": gpu, "gpusPerNode": per_node,
                "maxNodes": nodes, "freeGpus": free,
                "intraNode": "pcie" if gpu.startswith("L40S") else "nvlink",
                "interNodeGbps": rng.choice([100, 800, 3200]),
                "hostMemory": rng.choice(["1900Gi", "480Gi", "160Gi", "64Gi"]),
            }
            price_now = rng.choice([None, round(price * rng.uniform(0.9, 1.1), 2)])
            if price_now is not None:
                pool["pricePerGpuHour"] = price_now
            if free is not None:
                pool["nodesNow"] = rng.choice([0, nodes, nodes])
                pool["queuedGpus"] = rng.choice([0, 0, per_node, per_node * 3, per_node * 10])
                if nodes > 1 and rng.random() < 0.5:
                    pool["freeGpusPerNode"] = [min(per_node, max(0, free - k * per_node)) for k in range(nodes)]
            pools.append(pool)
    return load_catalog({"pools": pools})


def policies(regions: list[str]) -> list[tuple[str, ClusterPolicy]]:
    base = {"allowedRegions": regions, "objectStorage": STORAGE}
    return [
        ("cost", load_policy({**base, "placementPreference": "cost"})),
        ("start25", load_policy(base)),
        ("start60-headroom5", load_policy({**base, "startTimeCostMargin": 0.6, "defaultMemoryHeadroom": 0.05})),
        ("cost-headroom20", load_policy({**base, "placementPreference": "cost", "defaultMemoryHeadroom": 0.2})),
    ]


def catalogs() -> list[tuple[str, list, list[str]]]:
    examples = load_catalog((ROOT / "examples" / "pools.yaml").read_text())
    found = [("examples", examples, ["eu-de-berlin", "eu-fr-paris", "us-east-virginia"]),
             ("bench", bench_planner.catalog(random.Random(1)), REGIONS)]
    for k in range(4):
        rng = random.Random(f"catalog-{k}")
        regions = REGIONS[: rng.choice([2, 3])]
        found.append((f"random{k}", random_catalog(rng, regions), regions))
    return found


# ---------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------


def example_doc(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / name).read_text())
    doc["metadata"].update(namespace="team-a", uid="uid-1", generation=1)
    return doc


EXAMPLE_VARIANTS: list[dict[str, Any]] = [
    {},
    {"spec.training.masterWeights": "fp32", "spec.training.optimizerInBackward": False,
     "spec.training.lossChunks": 1, "spec.training.activationOffloading": False},
    {"spec.training.lossChunks": 4},
    {"spec.training.activationOffloading": True},
    {"spec.training.gradientCheckpointing": False},
    {"spec.training.microBatchSize": 2},
    {"spec.resources.strategy": "fsdp", "spec.resources.offload": "optimizer"},
    {"spec.resources.gpus": 4},
    {"spec.resources.gpuTypes": None, "spec.placement.regions": ["eu-de-berlin", "eu-fr-paris"]},
    {"spec.resources.nodePool": "a100-berlin", "spec.resources.gpuTypes": None},
    {"spec.training.sequenceLength": 1024},
    {"spec.evaluation": {"heldOutFraction": 0.05, "microBatchSize": 8}},
]


def example_specs() -> Iterator[tuple[str, api.FineTuneJobSpec]]:
    for name in EXAMPLES:
        for v, variant in enumerate(EXAMPLE_VARIANTS):
            doc = with_changes(example_doc(name), variant)
            try:
                yield f"{name}#{v}", api.parse_job(doc).spec
            except ValueError:
                continue  # a variant the example's method refuses (masterWeights on LoRA...)


def random_doc(rng: random.Random, regions: list[str]) -> dict[str, Any]:
    preset = rng.choice(PRESETS)
    method = rng.choice(["lora", "lora", "qlora"] if preset in BIG else ["full", "full", "lora", "qlora"])
    training: dict[str, Any] = {
        "sequenceLength": rng.choice([512, 1024, 2048, 4096, 8192]),
        "globalBatchSize": rng.choice([8, 12, 16, 32, 48, 64, 96, 128, 256]),
    }
    if rng.random() < 0.8:
        training["maxSteps"] = rng.choice([200, 1000, 5000])
    else:
        training["epochs"] = 2.0
    training["optimizer"] = "paged-adamw-8bit" if method == "qlora" and rng.random() < 0.7 else rng.choice(
        ["adamw", "adamw", "adamw"] + list(OPTIMIZERS))
    if rng.random() < 0.15:
        training["precision"] = rng.choice(["fp16", "fp32"])
    if rng.random() < 0.1:
        training["attention"] = rng.choice(["eager", "flash"])
    if rng.random() < 0.2:
        training["gradientCheckpointing"] = rng.choice([True, False])
    if rng.random() < 0.1:
        training["microBatchSize"] = rng.choice([1, 2, 4])
    if method == "full" and rng.random() < 0.3:
        training["masterWeights"] = rng.choice(["fp32", "bf16", "auto"])
    if rng.random() < 0.2:
        training["optimizerInBackward"] = rng.choice([True, False])
    if rng.random() < 0.2:
        training["lossChunks"] = rng.choice([1, 2, 8])
    if rng.random() < 0.2:
        training["activationOffloading"] = rng.choice([True, False])
    if preset.startswith(("llama", "mistral", "qwen2.5")) and rng.random() < 0.05:
        training["ligerKernel"] = True
    resources: dict[str, Any] = {"maxGPUs": rng.choice([1, 2, 4, 8, 16, 32])}
    if rng.random() < 0.1:
        resources["gpus"] = rng.choice([1, 2, 4, 8])
        resources["maxGPUs"] = max(resources["maxGPUs"], resources["gpus"])
    if rng.random() < 0.15:
        resources["strategy"] = rng.choice(["ddp", "fsdp", "zero1", "zero2", "zero3"])
    if rng.random() < 0.1:
        resources["offload"] = rng.choice(["none", "optimizer", "optimizer+params"])
    if rng.random() < 0.25:
        resources["gpuTypes"] = rng.sample([k[0] for k in KINDS], rng.randint(1, 3))
    if rng.random() < 0.1:
        resources["memoryHeadroom"] = rng.choice([0.0, 0.05, 0.3])
    doc: dict[str, Any] = {
        "model": {"name": preset, "architecture": {"preset": preset}, "source": {"pvc": {"claimName": "models"}}},
        "dataset": {"source": {"pvc": {"claimName": "data"}}, "packing": rng.random() < 0.2},
        "method": method,
        "training": training,
        "resources": resources,
        "placement": {"regions": rng.sample(regions, rng.randint(1, len(regions)))},
    }
    if not doc["dataset"]["packing"]:  # padding-free rows, and micro-batches sized from declared tokens
        if rng.random() < 0.2:
            doc["dataset"]["paddingFree"] = True
        if rng.random() < 0.3:
            lengths = sorted((rng.randint(16, training["sequenceLength"]) for _ in range(rng.randint(1, 16))),
                             reverse=True)
            doc["dataset"]["microBatchTokens"] = list(itertools.accumulate(lengths))
    if method != "full":
        lora: dict[str, Any] = {"rank": rng.choice([8, 16, 64]), "dropout": rng.choice([0.0, 0.0, 0.05])}
        if rng.random() < 0.2:
            lora["targetModules"] = rng.choice([["q_proj", "v_proj"], ["q_proj", "v_proj", "lm_head"]])
        if rng.random() < 0.1:
            lora["modulesToSave"] = rng.choice([["lm_head"], ["embed_tokens", "lm_head"]])
        if preset in MOE and rng.random() < 0.3:
            lora["targetExperts"] = True
        doc["lora"] = lora
    if rng.random() < 0.1:
        doc["evaluation"] = {"heldOutFraction": 0.05, "microBatchSize": rng.choice([1, 8, 64])}
    if rng.random() < 0.1:
        doc["export"] = rng.choice(["adapter", "merged"]) if method != "full" else "full"
    if rng.random() < 0.1:
        endpoint = rng.choice(STORAGE)["endpoint"]
        where = rng.choice(["output", "dataset"])
        s3 = {"endpoint": endpoint, "bucket": "team-a", "key": "out/" if where == "output" else "train.jsonl",
              "credentialsSecretRef": {"name": "s3"}}
        if where == "output":
            doc["output"] = {"s3": s3}
        else:
            doc["dataset"]["source"] = {"s3": s3}
    return doc


def random_spec(seed: str, regions: list[str]) -> api.FineTuneJobSpec:
    """A valid random spec drawn from `seed` (draws the API refuses are drawn again from the same stream)."""
    rng = random.Random(seed)
    while True:
        doc = random_doc(rng, regions)
        try:
            return api.parse_spec(doc)
        except ValueError:
            continue


# ---------------------------------------------------------------------------
# Calls
# ---------------------------------------------------------------------------


def gpu_oom(plan: api.PlanStatus) -> Failure:
    capacity = int(plan.gpu_memory_gi_b * GiB)
    return Failure(FailureKind.GPU_OUT_OF_MEMORY, "CUDA out of memory", "report", phase="backward", step=3,
                   peak_allocated_bytes=int(capacity * 0.99), capacity_bytes=capacity)


HOST_OOM = Failure(FailureKind.HOST_OUT_OF_MEMORY, "OOMKilled", "kubelet", exit_code=137)
EVICTED = Failure(FailureKind.EVICTED, "PreemptionByScheduler: preempted", "pod")
NODE_LOST = Failure(FailureKind.NODE_LOST, "DeletionByTaintManager", "pod")


def step_json(step: Any) -> dict[str, Any]:
    return {"retry": step.retry, "changes": step.changes, "why": step.why,
            "plan": step.plan.to_json() if step.plan is not None else None}


def recovery(case: str, spec: api.FineTuneJobSpec, first: Plan, pools: list, policy: ClusterPolicy
             ) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """decide_next after each kind of failure of `first`; after a GPU OOM, three rungs climbed."""
    failed = first.to_status()
    history: list[FailedRun] = []
    for rung in range(3):
        step = decide_next(spec, gpu_oom(failed), failed, attempts_made=1 + rung, failed_keys=list(history),
                           pools=pools, policy=policy)
        yield f"{case}/gpu-oom{rung}", "decide_next", step_json(step)
        if not step.retry or step.plan is None:
            break
        history.append(FailedRun.of(failed, FailureKind.GPU_OUT_OF_MEMORY))
        failed = step.plan.to_status()
    failed = first.to_status()
    for name, failure, left in (("host-oom", HOST_OOM, pools), ("evicted", EVICTED, pools),
                                ("node-lost", NODE_LOST, [p for p in pools if p.name != first.pool.name])):
        step = decide_next(spec, failure, failed, attempts_made=1, failed_keys=[], pools=left, policy=policy)
        yield f"{case}/{name}", "decide_next", step_json(step)


def cases(random_jobs: int) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(id, call, result JSON) for the whole matrix, in a fixed order."""
    n = 0
    for cat_name, pools, regions in catalogs():
        jobs: list[tuple[str, api.FineTuneJobSpec]] = []
        if cat_name == "examples":
            jobs.extend(example_specs())
        jobs.extend((f"random{i}", random_spec(f"{cat_name}-{i}", regions)) for i in range(random_jobs))
        for pol_name, policy in policies(regions):
            for job_name, spec in jobs:
                case = f"{cat_name}/{pol_name}/{job_name}"
                n += 1
                result = plan_job(spec, pools, policy)
                yield case, "plan_job", result.to_json()
                if n % 7 == 0:
                    yield case, "plan_job calibration=1.25", plan_job(spec, pools, policy, calibration=1.25).to_json()
                if n % 9 == 0:
                    yield case, "plan_job simple_estimate", plan_job(spec, pools, policy,
                                                                     estimator=simple_estimate).to_json()
                if n % 10 == 0:
                    yield case, "exhaustive_plan", exhaustive_plan(spec, pools, policy).to_json()
                if isinstance(result, Plan):
                    if n % 5 == 0:
                        yield case, "plan_job exclude=first", plan_job(spec, pools, policy,
                                                                       exclude=[result]).to_json()
                    if cat_name == "examples" or n % 6 == 0:
                        yield from recovery(case, spec, result, pools, policy)


def lines(random_jobs: int) -> Iterator[str]:
    for case, call, result in cases(random_jobs):
        yield json.dumps({"id": case, "call": call, "result": result}, ensure_ascii=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="write the golden here (JSON lines)")
    target.add_argument("--check", help="plan again and compare with this golden")
    parser.add_argument("--random-jobs", type=int, default=60, help="random specs per catalog (default 60)")
    args = parser.parse_args()
    start = time.perf_counter()
    digest, count = hashlib.sha256(), 0
    if args.out:
        with open(args.out, "w", encoding="ascii") as out:
            for line in lines(args.random_jobs):
                out.write(line + "\n")
                digest.update(line.encode() + b"\n")
                count += 1
    else:
        with open(args.check, encoding="ascii") as golden:
            for line in lines(args.random_jobs):
                want = golden.readline().rstrip("\n")
                count += 1
                if line != want:
                    print(f"DIFFERS at line {count}:\n  golden: {want[:2000]}\n  now:    {line[:2000]}")
                    return 1
                digest.update(line.encode() + b"\n")
            if golden.readline():
                print(f"DIFFERS: the golden has more than {count} lines")
                return 1
    print(f"{count} results, sha256 {digest.hexdigest()}, {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
