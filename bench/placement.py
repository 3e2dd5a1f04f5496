"""Placement benchmark: N new jobs reconciled through the real `Reconciler` by K worker threads on the
strict fake API (tests/operator/fake_kube.py), every one of them planning. CPU only, no cluster.

    python bench/placement.py [--jobs 120] [--workers 1 4 8] [--latency-ms 0 3] [--plan-wait-ms 0 20]
                              [--repeat 3] [--before /work/main] [--json] [--out FILE]

All N jobs are put on the queue at once (a burst: an operator restart, a batch of submissions) and
K threads take them, as workqueue.py's workers do. Per combination of workers, API latency and plan
wait it prints: plans per second (N over the wall time), enqueue to the decision committed (the
claim noted in the claim book, where other plans see it: p50/p99, queueing included), reconcile
start to committed (p50/p99: the time one reconcile holds a worker before its claim counts), the
plans made again under the placement lock (`Reconciler.replans`, where the tree has it), and
whether a pool was over-committed (more GPUs planned to start now than it has free).

- `--latency-ms`: each API call waits this long outside the fake's lock (a round trip, the GIL
  released), as an API server in the cluster answers in a few milliseconds.
- `--plan-wait-ms`: each `lifecycle.step` waits this long before planning, the GIL released: a
  model of planning that waits on I/O or runs native code. Today's step is pure Python and holds
  the GIL throughout (0); this shows what concurrency planning could gain if it did not.
- `--before TREE`: run the same in another checkout (its operator/ and images/trainer/, this
  tree's fake API) in a child process, taking turns with this one, and print both.
- `--repeat R`: each combination R times; the row shown is the run of median plans per second.

CPython's GIL runs one thread's Python at a time: with pure-Python planning, K workers plan no
faster than one, whether the lock is held over planning or not.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REGIONS = ["eu-de-berlin", "eu-fr-paris"]
# (pool, GPU product label, region, nodes, GPUs per node): 48 free GPUs for the burst to compete for.
NODES = [("h100-berlin", "NVIDIA-H100-80GB-HBM3", "eu-de-berlin", 2, 8),
         ("a100-berlin", "NVIDIA-A100-SXM4-80GB", "eu-de-berlin", 2, 8),
         ("h100-paris", "NVIDIA-H100-80GB-HBM3", "eu-fr-paris", 2, 8)]


def import_tree(tree: Path) -> None:
    """The operator and the trainer's contract from `tree`; the fake API from this checkout."""
    sys.path[:0] = [str(tree / "operator"), str(tree / "images" / "trainer"), str(ROOT / "tests" / "operator")]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def documents(jobs: int, seed: int) -> list[dict[str, Any]]:
    from reconcile_world import job_document

    rng = random.Random(seed)
    docs = []
    for i in range(jobs):
        doc = job_document(f"job-{i:04d}")
        spec = doc["spec"]
        spec["training"]["sequenceLength"] = rng.choice([2048, 4096, 8192])
        spec["resources"] = rng.choice([{"gpus": 1, "maxGPUs": 1}, {"gpus": 2, "maxGPUs": 2}, {"maxGPUs": 8}])
        spec["resources"]["gpuTypes"] = ["H100-80GB", "A100-80GB"]
        spec["placement"] = {"regions": rng.sample(REGIONS, rng.randint(1, 2))}
        docs.append(doc)
    return docs


def run(jobs: int, workers: int, latency_ms: float, plan_wait_ms: float, seed: int) -> dict[str, Any]:
    from unittest import mock

    from fake_kube import FakeKube, Serialised
    from finetune_operator import lifecycle
    from finetune_operator.shell.claim_book import ClaimBook
    from finetune_operator.shell.cluster import Cluster
    from finetune_operator.shell.reconciler import Later, PolicyHolder, Reconciler
    from reconcile_world import NAMESPACE, T0, gpu_node, policy_with_catalog

    kube = FakeKube()
    for pool, product, region, count, gpus in NODES:
        for n in range(count):
            kube.put("Node", gpu_node(f"{pool}-{n}", pool, product, gpus, region=region))
    docs = documents(jobs, seed)
    for doc in docs:
        kube.put("FineTuneJob", copy.deepcopy(doc))
    api_lock = threading.Lock()
    cluster = Cluster(mock.MagicMock())
    cluster.core, cluster.custom, cluster.networking = (
        Serialised(f, api_lock, latency_ms / 1000) for f in (kube.core, kube.custom, kube.networking))

    committed: dict[str, float] = {}

    class TimedBook(ClaimBook):
        """The claim book, noting when each job's first decision was committed (its claim noted)."""

        def note(self, key, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().note(key, *args, **kwargs)
            committed.setdefault(key[1], time.perf_counter())

    reconciler = Reconciler(cluster=cluster, policy=PolicyHolder(policy_with_catalog()), clock=lambda: T0,
                            claims=TimedBook(), alongside=Later)
    real_step = lifecycle.step

    def step(observed: Any) -> Any:
        if plan_wait_ms:
            time.sleep(plan_wait_ms / 1000)
        return real_step(observed)

    work: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    started: dict[str, float] = {}
    errors: list[str] = []

    def worker() -> None:
        while (name := work.get()) is not None:
            started[name] = time.perf_counter()
            try:
                reconciler.reconcile(NAMESPACE, name)
            except Exception as error:  # noqa: BLE001 - counted and printed
                errors.append(f"{name}: {error!r}")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    with mock.patch.object(lifecycle, "step", step):
        enqueued = time.perf_counter()
        for doc in docs:
            work.put(doc["metadata"]["name"])
        for _ in threads:
            work.put(None)
        cpu = time.process_time()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - enqueued
        cpu = time.process_time() - cpu

    statuses = {d["metadata"]["name"]: (kube.get("FineTuneJob", NAMESPACE, d["metadata"]["name"]).get("status") or {})
                for d in docs}
    free = {pool: count * gpus for pool, _, _, count, gpus in NODES}
    starting: dict[str, int] = {}
    for status in statuses.values():
        plan = status.get("plan")
        if plan and not plan["needsScaleUp"]:
            starting[plan["nodePool"]] = starting.get(plan["nodePool"], 0) + plan["nodes"] * plan["gpusPerNode"]
    overcommitted = {pool: f"{gpus}/{free.get(pool, 0)}" for pool, gpus in starting.items() if gpus > free.get(pool, 0)}
    to_commit = [(committed[n] - enqueued) * 1000 for n in committed]
    in_reconcile = [(committed[n] - started[n]) * 1000 for n in committed]
    return {
        "jobs": jobs, "workers": workers, "latency_ms": latency_ms, "plan_wait_ms": plan_wait_ms,
        "wall_s": wall, "cpu_s": cpu, "plans_per_s": len(committed) / wall,
        "enqueue_to_commit_ms": {"p50": percentile(to_commit, 50), "p99": percentile(to_commit, 99)},
        "reconcile_to_commit_ms": {"p50": percentile(in_reconcile, 50), "p99": percentile(in_reconcile, 99)},
        "replans": getattr(reconciler, "replans", None),
        "starting_now": sum(starting.values()), "free_gpus": sum(free.values()),
        "overcommitted": overcommitted, "errors": errors[:5], "error_count": len(errors),
        "planned": sum(1 for s in statuses.values() if s.get("plan")),
    }


def matrix(args: argparse.Namespace) -> list[dict[str, Any]]:
    run(8, 1, 0, 0, args.seed + 1)  # imports and first-call costs out of the figures
    rows = []
    for latency in args.latency_ms:
        for wait in args.plan_wait_ms:
            for workers in args.workers:
                rows.append(run(args.jobs, workers, latency, wait, args.seed))
    return rows


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per tree and combination, the run of median plans per second (its figures together), with
    every run's over-commits and errors."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["tree"], r["latency_ms"], r["plan_wait_ms"], r["workers"]), []).append(r)
    rows = []
    for group in groups.values():
        middle = sorted(group, key=lambda r: r["plans_per_s"])[len(group) // 2]
        rows.append(dict(middle, runs=len(group),
                         overcommitted={k: v for r in group for k, v in r["overcommitted"].items()},
                         error_count=sum(r["error_count"] for r in group),
                         errors=[e for r in group for e in r["errors"]][:5],
                         planned=min(r["planned"] for r in group)))
    return sorted(rows, key=lambda r: (r["latency_ms"], r["plan_wait_ms"], r["workers"], r["tree"] != "before"))


def table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'tree':<8} {'lat ms':>6} {'wait ms':>7} {'workers':>7} {'plans/s':>8} {'wall s':>7} {'cpu s':>6} "
              f"{'enq->commit p50/p99 ms':>23} {'recon->commit p50/p99 ms':>25} {'replans':>7} "
              f"{'start now/free':>14} {'overcommit':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        e, c = r["enqueue_to_commit_ms"], r["reconcile_to_commit_ms"]
        replans = "n/a" if r["replans"] is None else str(r["replans"])
        print(f"{r['tree']:<8} {r['latency_ms']:>6g} {r['plan_wait_ms']:>7g} {r['workers']:>7} {r['plans_per_s']:>8.1f} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>6.2f} {e['p50']:>11.0f} / {e['p99']:>8.0f} {c['p50']:>12.1f} / {c['p99']:>9.1f} "
              f"{replans:>7} {r['starting_now']:>6}/{r['free_gpus']:<7} {'none' if not r['overcommitted'] else json.dumps(r['overcommitted']):>10}")
        for error in r["errors"]:
            print("   ERROR", error)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=120)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 3.0])
    parser.add_argument("--plan-wait-ms", type=float, nargs="+", default=[0.0, 20.0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each combination (the median is shown)")
    parser.add_argument("--before", type=Path, help="another checkout to measure the same way, first")
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)  # the child of --before
    parser.add_argument("--label", default="this", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here (bench/results/placement.json)")
    args = parser.parse_args()

    runs: list[dict[str, Any]] = []
    import_tree(args.tree)
    for _ in range(args.repeat):  # before and after take turns: a load that comes and goes hits both
        if args.before is not None:
            child = [sys.executable, __file__, "--tree", str(args.before.resolve()), "--label", "before", "--json",
                     "--repeat", "1", "--jobs", str(args.jobs), "--seed", str(args.seed),
                     "--workers", *map(str, args.workers), "--latency-ms", *map(str, args.latency_ms),
                     "--plan-wait-ms", *map(str, args.plan_wait_ms)]
            runs += json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout)
        for row in matrix(args):
            runs.append(dict(row, tree=args.label if args.before is None else "after"))
    rows = medians(runs)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"Placement benchmark: {args.jobs} new jobs at once, {sum(n * g for *_, n, g in NODES)} free GPUs in "
          f"{len(NODES)} pools; the median of {args.repeat} runs; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    table(rows)
    bad = [r for r in rows if r["overcommitted"] or r["error_count"] or r["planned"] != r["jobs"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
